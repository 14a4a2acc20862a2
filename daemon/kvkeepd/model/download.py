"""One file's download over HTTP that gives up, for the models of the Hub (hub.py).

The rest of a file is asked for by a range request from what its part file holds, read as it
arrives and appended there. A download gives up (DownloadError, one line) when:

- nothing arrives for `Limits.read_timeout` seconds, or the connection breaks, and going on
  does not help: the download resumes from where it stopped, at most `Limits.resumes` times,
  and only after a try that brought the file further than any before it (a server that
  stalls at the same byte, or that answers a range request from byte 0 and stalls where it
  did before, is given up on its second try);
- it is slower than `Limits.min_rate` bytes a second over a window of `Limits.window`
  seconds (a server that drips a byte now and then never reaches a read timeout);
- the server answers with an error, or with other bytes than those asked for.

What was written stays in the part file, so the next run goes on from there. An
Authorization header is sent to the URL's own host only, never after a redirect to another
(the Hub redirects downloads to its CDN).
"""

from __future__ import annotations

import http.client
import logging
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import IO

log = logging.getLogger(__name__)

_CHUNK = 1 << 20


@dataclass(frozen=True)
class Limits:
    """When a download gives up. The defaults let a model of gigabytes come over a slow
    link, and end a download that has stopped within a minute; tests pass small ones."""

    #: Seconds without a byte (or without an answer to the request) before the connection is
    #: dropped, and the download resumed.
    read_timeout: float = 30.0
    #: The least bytes a second, over each window of `window` seconds.
    min_rate: int = 32 << 10
    window: float = 30.0
    #: Tries after the first, each after a try that brought the file further.
    resumes: int = 5


LIMITS = Limits()


class DownloadError(Exception):
    """A download gave up: one line, for the operator."""


class _Broken(Exception):
    """A try's connection broke or went silent: resuming may go on."""


def download(
    url: str,
    headers: Mapping[str, str],
    fd: int,
    size: int,
    limits: Limits = LIMITS,
    progress: Callable[[int], None] | None = None,
) -> None:
    """Write the rest of the file at `url`, `size` bytes in all, to the part file open at
    `fd` (read and write), after the bytes it holds; `progress` is told of the bytes written
    (a negative count where the server started again from byte 0). DownloadError if it gives
    up (see the module's docstring)."""
    if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
        raise DownloadError(f"cannot download from {url}: not an http or https URL")
    furthest = os.fstat(fd).st_size
    if furthest >= size:
        return
    resumes = 0
    while True:
        try:
            _try(url, headers, fd, size, limits, progress)
            return
        except _Broken as e:
            at = os.fstat(fd).st_size
            where = f"{e} at {_amount(at)} of {_amount(size)}"
            if at <= furthest:
                again = " (no further than the try before)" if resumes else ""
                raise DownloadError(f"{where}{again}") from None
            if resumes == limits.resumes:
                raise DownloadError(f"{where}, after {resumes} resumes") from None
            furthest = at
            resumes += 1
            log.warning("%s; resuming (%d of at most %d)", where, resumes, limits.resumes)


def _try(
    url: str,
    headers: Mapping[str, str],
    fd: int,
    size: int,
    limits: Limits,
    progress: Callable[[int], None] | None,
) -> None:
    """One request for the bytes from the part file's end to `size`, appended as they come."""
    have = os.lseek(fd, 0, os.SEEK_END)
    request = urllib.request.Request(url, headers={**headers, "Range": f"bytes={have}-"})
    started = time.monotonic()
    try:
        response = _OPENER.open(request, timeout=limits.read_timeout)
    except urllib.error.HTTPError as e:
        raise DownloadError(f"the server answered {e.code} {e.reason}") from None
    except (urllib.error.URLError, http.client.HTTPException, OSError) as e:
        reason = e.reason if isinstance(e, urllib.error.URLError) else e
        if isinstance(reason, TimeoutError):
            raise _Broken(f"no answer came for {limits.read_timeout:g} s") from None
        raise _Broken(f"the request failed ({_why(reason)})") from None
    assert isinstance(response, http.client.HTTPResponse)  # http(s) only: see download
    with response:
        have = _start(response, fd, have, progress)
        window_start, window_bytes = started, have
        while have < size:
            chunk = _read(response, min(_CHUNK, size - have), limits)
            os.write(fd, chunk)
            have += len(chunk)
            if progress is not None:
                progress(len(chunk))
            now = time.monotonic()
            if now - window_start >= limits.window:
                rate = (have - window_bytes) / (now - window_start)
                if rate < limits.min_rate:
                    raise DownloadError(
                        f"too slow: {_amount(rate)}/s over the last {now - window_start:.3g} s, "
                        f"under the {_amount(limits.min_rate)}/s a download needs, "
                        f"at {_amount(have)} of {_amount(size)}"
                    )
                window_start, window_bytes = now, have


def _start(
    response: http.client.HTTPResponse, fd: int, have: int, progress: Callable[[int], None] | None
) -> int:
    """Where the response's bytes go in the part file: after the `have` it holds (206), or
    from its start (200: the server ignored the range)."""
    if response.status == 206:
        answered = response.headers.get("Content-Range", "")
        if not answered.startswith(f"bytes {have}-"):
            raise DownloadError(f"the server answered a request for the bytes from {have} with {answered!r}")
        return have
    if response.status != 200:
        raise DownloadError(f"the server answered {response.status} {response.reason}")
    if have:
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        if progress is not None:
            progress(-have)
    return 0


def _read(response: http.client.HTTPResponse, n: int, limits: Limits) -> bytes:
    """What has arrived, up to `n` bytes (one read of the socket: a slow server's bytes are
    counted as they come); _Broken if the connection ends or nothing comes in time."""
    try:
        chunk = response.read1(n)
    except TimeoutError:
        raise _Broken(f"nothing came for {limits.read_timeout:g} s") from None
    except (http.client.HTTPException, OSError) as e:
        raise _Broken(f"the connection broke ({_why(e)})") from None
    if not chunk:
        raise _Broken("the server closed the connection")
    return chunk


class _SameHostAuth(urllib.request.HTTPRedirectHandler):
    """Redirects to http(s) only, without the Authorization header where the host changes
    (urllib keeps it: the Hub's token would go to its CDN, or wherever a mirror points)."""

    def redirect_request(
        self,
        req: urllib.request.Request,
        fp: IO[bytes],
        code: int,
        msg: str,
        headers: http.client.HTTPMessage,
        newurl: str,
    ) -> urllib.request.Request | None:
        target = urllib.parse.urlsplit(urllib.parse.urljoin(req.full_url, newurl))
        if target.scheme not in ("http", "https"):
            raise urllib.error.HTTPError(newurl, code, f"a redirect to {target.scheme}:", headers, fp)
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and target.netloc != urllib.parse.urlsplit(req.full_url).netloc:
            new.remove_header("Authorization")
        return new


_OPENER = urllib.request.build_opener(_SameHostAuth)


def _why(e: object) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]


def _amount(n: float) -> str:
    """Bytes for a person: `512 B`, `0.5 B` (a rate), `31.5 KiB`, `4.2 GiB`."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024:
            return f"{round(size, 1):g} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"

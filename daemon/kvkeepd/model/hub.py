"""Models from the Hugging Face Hub: `--model hf:OWNER/REPO[:QUANT]` and `kvkeep pull`.

huggingface_hub finds the repository's files (`model_info`, from HF_ENDPOINT, a mirror where
set, with HF_TOKEN's token); kvkeepd.model.download streams the chosen file, and gives up on a
server that stalls or drips (see its Limits). The file goes to `MODEL_CACHE/OWNER/REPO/NAME.part`
first, so a download cut short (a lost connection, Ctrl-C, a give-up) goes on from where it
stopped at the next try, by a range request; it becomes `NAME` once its SHA-256 is the one the
Hub lists for it, and `NAME.sha256` records that it was checked. Which file a reference chose
is kept too (`refs/QUANT`), so a start without a network uses the copy it has.

    MODEL_CACHE/OWNER/REPO/
      NAME.gguf           a checked model file
      NAME.gguf.sha256    its SHA-256, as checked
      NAME.gguf.part      a download under way, or cut short
      refs/QUANT          the file a reference chose last ("default" without a QUANT)
      lock                held while a daemon or `kvkeep pull` downloads here

The Hub (any HF_ENDPOINT) is not trusted with paths: a file name that is absolute, holds
`..`, a backslash or a control character, or would land outside its repository's folder is
refused, and so is a listing whose files do not fit on the disk. The cache keeps the state
directory's rules (kvkeepd.files): directories 0700, files 0600, and no symbolic link
followed below `--model-cache` itself (the operator's path), one line naming what is refused.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import re
import shutil
import socket
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from kvkeepd import __version__
from kvkeepd.files import (
    StateDirError,
    check_entry,
    fsync_dir,
    open_private,
    private_dir,
    private_subdir,
    read_private,
    write_private,
)
from kvkeepd.model.choice import HfRef
from kvkeepd.model.download import LIMITS, DownloadError, Limits, download

log = logging.getLogger(__name__)

#: What a repository without a QUANT gives, in this order (llama-server's -hf default first).
PREFERRED = ("Q4_K_M", "Q4_0", "Q8_0")
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")
_HASH_CHUNK = 1 << 20
# How refusals name the model cache (kvkeepd.files' lines).
_PLACE = "its model cache"


class HubError(Exception):
    """A model could not be had from the Hub: one line for the operator."""


@dataclass(frozen=True)
class Remote:
    """A GGUF file of a repository, as the Hub lists it."""

    name: str
    size: int
    sha256: str


def fetch(ref: HfRef, cache: Path, limits: Limits = LIMITS) -> Path:
    """The local path of the GGUF file `ref` names (its first part, for a split model),
    downloaded into `cache` and checked unless it is there already; HubError if it cannot be
    had. `limits`: when a download gives up (kvkeepd.model.download's defaults, small in tests)."""
    try:
        return _fetch(ref, cache, limits)
    except StateDirError as e:  # a link or another kind of thing where the cache keeps its own
        raise HubError(str(e)) from None
    except OSError as e:  # the disk's: full, read-only, not ours
        where = f" ({e.filename})" if e.filename else ""
        raise HubError(
            f"cannot use the model cache {cache}{where}: {e.strerror or e}; choose another with --model-cache"
        ) from None


def _fetch(ref: HfRef, cache: Path, limits: Limits) -> Path:
    private_dir(cache)
    private_subdir(cache / ref.owner, place=_PLACE)
    where = cache / ref.owner / ref.repo
    private_subdir(where, place=_PLACE)
    with _locked(where / "lock"):
        try:
            revision, files = _listing(ref)
        except HubError as e:
            kept = _kept(ref, where)
            if kept is None:
                raise
            log.warning("%s; using the copy of %s kept in %s", e, ref, where)
            return kept
        chosen = choose(ref, files)
        places = [_place(ref, where, remote.name) for remote in chosen]
        _check_room(
            ref, where, [_missing(remote, place) for remote, place in zip(chosen, places, strict=True)]
        )
        for remote, place in zip(chosen, places, strict=True):
            _download(ref, revision, remote, where, place, limits)
        refs = where / "refs"
        private_subdir(refs, place=_PLACE)
        write_private(_place(ref, refs, ref.quant or "default"), chosen[0].name.encode() + b"\n")
        return places[0]


def choose(ref: HfRef, files: Sequence[Remote]) -> list[Remote]:
    """The files of the model `ref` names among a repository's: the one whose name carries
    its QUANT (or is it), else the first of PREFERRED that one carries, else the first GGUF;
    every part of a split model. HubError if there is none."""
    ggufs = sorted(
        (f for f in files if f.name.endswith(".gguf") and "mmproj" not in f.name), key=lambda f: f.name
    )
    if not ggufs:
        raise HubError(f"{ref} has no GGUF file")
    wanted = [ref.quant] if ref.quant else [*PREFERRED, ""]
    for quant in wanted:
        found = [f for f in ggufs if _carries(f.name, quant)]
        if found:
            first = found[0]
            split = _SPLIT.search(first.name)
            if split is None:
                return [first]
            stem = first.name[: split.start()]
            return [f for f in found if f.name.startswith(stem) and _SPLIT.search(f.name)]
    quants = ", ".join(sorted({_quant_of(f.name) for f in ggufs}))
    raise HubError(f"{ref.repo_id} has no GGUF file for {ref.quant}; it has: {quants}")


def _carries(name: str, quant: str) -> bool:
    """Whether file `name` is `quant`'s: that quantization ends its name, or it is `quant`."""
    if not quant:
        return True
    if quant.endswith(".gguf"):
        return name == quant or name.endswith("/" + quant)
    bare = _SPLIT.sub(".gguf", name)
    return re.search(rf"(^|[-./]){re.escape(quant)}\.gguf$", bare, re.IGNORECASE) is not None


def _quant_of(name: str) -> str:
    bare = _SPLIT.sub(".gguf", name).removesuffix(".gguf")
    return re.split(r"[-./]", bare)[-1] or name


def _listing(ref: HfRef) -> tuple[str, list[Remote]]:
    """The repository's revision and its files with their sizes and SHA-256s."""
    from huggingface_hub import HfApi

    try:
        info = HfApi().model_info(ref.repo_id, files_metadata=True)
    except Exception as e:  # the Hub's errors, and the network's
        if _unreachable(e):
            from huggingface_hub import constants

            raise HubError(
                f"cannot reach the Hub at {constants.ENDPOINT} to list the files of {ref} "
                f"({_first_line(e)}): set HF_ENDPOINT to a mirror this machine reaches, or serve "
                "a GGUF file it has with --model PATH"
            ) from None
        raise HubError(f"cannot list the files of {ref} on the Hub: {_first_line(e)}") from None
    files = [
        Remote(s.rfilename, s.size or s.lfs.size, s.lfs.sha256)
        for s in info.siblings or ()
        if s.lfs is not None
    ]
    return info.sha or "main", files


def _place(ref: HfRef, where: Path, name: str) -> Path:
    """Where the file `name` goes in the folder `where`; HubError, naming it, for a name that
    is absolute, holds `..`, a backslash or a control character (NUL, a newline), or is not
    a path below `where`."""
    why = ""
    if name.startswith("/"):
        why = "an absolute path"
    elif ".." in name:
        why = "it holds '..'"
    elif "\\" in name:
        why = "it holds a backslash"
    elif any(ord(c) < 0x20 or ord(c) == 0x7F for c in name):
        why = "it holds a control character"
    elif any(part in ("", ".") for part in name.split("/")):
        why = "an empty or '.' part"
    path = Path(os.path.normpath(where / name))
    if not why and where not in path.parents:
        why = f"not a path inside {where}"
    if why:
        raise HubError(f"refused the file {name!r} of {ref}: {why}; nothing was written")
    return path


def _missing(remote: Remote, place: Path) -> int:
    """The bytes of `remote` still to download to `place` (0: it is there, checked)."""
    if check_entry(place, place=_PLACE) and _read(_mark(place)) == remote.sha256:
        return 0
    part = _part(place)
    have = part.lstat().st_size if check_entry(part, place=_PLACE) else 0
    return remote.size - have if have <= remote.size else remote.size  # a longer part starts again


def _check_room(ref: HfRef, where: Path, missing: Sequence[int]) -> None:
    """HubError if the disk has less room than the bytes still to download: a model that
    cannot fit is refused before it fills the disk."""
    need, free = sum(missing), shutil.disk_usage(where).free
    if need > free:
        raise HubError(
            f"{ref} needs {_gib(need)} more in {where}, which has {_gib(free)} free: "
            "make room, or choose another --model-cache"
        )


def _download(ref: HfRef, revision: str, remote: Remote, where: Path, final: Path, limits: Limits) -> None:
    """`remote` into `final` (in the repository's folder `where`), unless it is there and
    checked: resumed from its part file, then checked against its SHA-256 before it takes its
    name."""
    mark = _mark(final)
    if check_entry(final, place=_PLACE) and _read(mark) == remote.sha256:
        return
    from huggingface_hub import get_token, hf_hub_url

    folder = where
    for name in final.relative_to(where).parts[:-1]:  # a file in a folder of the repository's
        folder = folder / name
        private_subdir(folder, place=_PLACE)
    part = _part(final)
    fd = open_private(part, os.O_RDWR, place=_PLACE)
    try:
        have = os.fstat(fd).st_size
        if have > remote.size:
            os.ftruncate(fd, 0)
            have = 0
        if have:
            log.info("downloading %s: going on from %d of %d bytes", remote.name, have, remote.size)
        else:
            log.info("downloading %s from %s (%d bytes) into %s", remote.name, ref, remote.size, where)
        url = hf_hub_url(ref.repo_id, remote.name, revision=revision)
        headers = {"User-Agent": f"kvkeep/{__version__}"}
        if token := get_token():
            headers["Authorization"] = f"Bearer {token}"
        with _bar(remote.name, remote.size, have) as bar:
            try:
                download(url, headers, fd, remote.size, limits, bar)
            except DownloadError as e:  # what was written stays in the part file for the next try
                raise HubError(f"cannot download {remote.name} of {ref}: {e}; run again to go on") from None
        digest = _sha256(fd)
        if digest != remote.sha256:
            os.unlink(part)
            raise HubError(
                f"{remote.name} of {ref} does not have the SHA-256 the Hub lists ({digest[:12]} instead of "
                f"{remote.sha256[:12]}); the download was removed: run again"
            )
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(part, final)
    fsync_dir(final.parent)
    write_private(mark, remote.sha256.encode() + b"\n")


def _kept(ref: HfRef, where: Path) -> Path | None:
    """The file `ref` chose last time, if it is still here and was checked."""
    name = _read(_place(ref, where / "refs", ref.quant or "default"))
    if not name:
        return None
    path = _place(ref, where, name)
    return path if check_entry(path, place=_PLACE) and _read(_mark(path)) else None


def _mark(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _part(path: Path) -> Path:
    return path.with_name(path.name + ".part")


@contextlib.contextmanager
def _bar(name: str, size: int, have: int) -> Iterator[Callable[[int], None] | None]:
    """A bar of the download's bytes on stderr, when it is a terminal."""
    if not sys.stderr.isatty():
        yield None
        return
    bar = tqdm(
        total=size, initial=have, desc=name, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr
    )

    def update(n: int) -> None:
        bar.update(n)

    try:
        yield update
    finally:
        bar.close()


def _sha256(fd: int) -> str:
    digest = hashlib.sha256()
    at = 0
    while chunk := os.pread(fd, _HASH_CHUNK, at):
        digest.update(chunk)
        at += len(chunk)
    return digest.hexdigest()


def _read(path: Path) -> str:
    """A small file's text, stripped ("" if absent); a link there is refused, not followed."""
    try:
        return read_private(path, place=_PLACE).decode(errors="replace").strip()
    except FileNotFoundError:
        return ""


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def _unreachable(e: BaseException) -> bool:
    """Whether `e` (or what caused it) says the Hub was not reached at all: a name that does
    not resolve, a connection refused or timed out; not an answer that refused the request."""
    seen: BaseException | None = e
    for _ in range(8):  # a chain of causes is short; this bounds a cycle
        if seen is None:
            return False
        name = type(seen).__name__
        if isinstance(seen, (socket.gaierror, ConnectionError, TimeoutError)) or name in (
            "ConnectError",
            "ConnectTimeout",
            "OfflineModeIsEnabled",
        ):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold `path`'s lock: one download into a repository's directory at a time."""
    fd = open_private(path, os.O_RDWR, place=_PLACE)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)

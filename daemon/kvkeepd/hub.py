"""Models from the Hugging Face Hub: `--model hf:OWNER/REPO[:QUANT]` and `kvkeep pull`.

huggingface_hub finds the repository's files (`model_info`, from HF_ENDPOINT, a mirror where
set, with HF_TOKEN's token) and streams the chosen file (`http_get`, with a progress bar).
The file goes to `MODEL_CACHE/OWNER/REPO/NAME.part` first, so a download cut short (a lost
connection, Ctrl-C) goes on from where it stopped at the next try, by a range request; it
becomes `NAME` once its SHA-256 is the one the Hub lists for it, and `NAME.sha256` records
that it was checked. Which file a reference chose is kept too (`refs/QUANT`), so a start
without a network uses the copy it has.

    MODEL_CACHE/OWNER/REPO/
      NAME.gguf           a checked model file
      NAME.gguf.sha256    its SHA-256, as checked
      NAME.gguf.part      a download under way, or cut short
      refs/QUANT          the file a reference chose last ("default" without a QUANT)
      lock                held while a daemon or `kvkeep pull` downloads here
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvkeepd.config.models import HfRef

log = logging.getLogger(__name__)

#: What a repository without a QUANT gives, in this order (llama-server's -hf default first).
PREFERRED = ("Q4_K_M", "Q4_0", "Q8_0")
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")
_HASH_CHUNK = 1 << 20


class HubError(Exception):
    """A model could not be had from the Hub: one line for the operator."""


@dataclass(frozen=True)
class Remote:
    """A GGUF file of a repository, as the Hub lists it."""

    name: str
    size: int
    sha256: str


def fetch(ref: HfRef, cache: Path) -> Path:
    """The local path of the GGUF file `ref` names (its first part, for a split model),
    downloaded and checked unless it is there already; HubError if it cannot be had."""
    where = cache / ref.owner / ref.repo
    try:
        where.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise HubError(
            f"cannot use the model cache {where}: {e.strerror or e}; choose another with --model-cache"
        ) from None
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
        for remote in chosen:
            _download(ref, revision, remote, where)
        refs = where / "refs"
        refs.mkdir(exist_ok=True)
        (refs / (ref.quant or "default")).write_text(chosen[0].name + "\n")
        return where / chosen[0].name


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
        raise HubError(f"cannot list the files of {ref} on the Hub: {_first_line(e)}") from None
    files = [
        Remote(s.rfilename, s.size or s.lfs.size, s.lfs.sha256)
        for s in info.siblings or ()
        if s.lfs is not None
    ]
    return info.sha or "main", files


def _download(ref: HfRef, revision: str, remote: Remote, where: Path) -> None:
    """`remote` into `where`, unless it is there and checked: resumed from its part file,
    then checked against its SHA-256 before it takes its name."""
    final = where / remote.name
    mark = final.with_name(final.name + ".sha256")
    if final.is_file() and _read(mark) == remote.sha256:
        return
    from huggingface_hub import get_token, hf_hub_url
    from huggingface_hub.file_download import http_get

    final.parent.mkdir(parents=True, exist_ok=True)
    part = final.with_name(final.name + ".part")
    have = part.stat().st_size if part.is_file() else 0
    if have > remote.size:
        part.unlink()
        have = 0
    if have:
        log.info("downloading %s: going on from %d of %d bytes", remote.name, have, remote.size)
    else:
        log.info("downloading %s from %s (%d bytes) into %s", remote.name, ref, remote.size, where)
    url = hf_hub_url(ref.repo_id, remote.name, revision=revision)
    try:
        with part.open("ab") as f:
            http_get(
                url,
                f,
                resume_size=have,
                headers={"authorization": f"Bearer {token}"} if (token := get_token()) else {},
                expected_size=remote.size,
                displayed_filename=remote.name,
            )
    except Exception as e:  # what was written stays in the part file for the next try
        raise HubError(
            f"cannot download {remote.name} of {ref}: {_first_line(e)}; run again to go on"
        ) from None
    digest = _sha256(part)
    if digest != remote.sha256:
        part.unlink()
        raise HubError(
            f"{remote.name} of {ref} does not have the SHA-256 the Hub lists ({digest[:12]} instead of "
            f"{remote.sha256[:12]}); the download was removed: run again"
        )
    os.replace(part, final)
    mark.write_text(remote.sha256 + "\n")


def _kept(ref: HfRef, where: Path) -> Path | None:
    """The file `ref` chose last time, if it is still here and was checked."""
    name = _read(where / "refs" / (ref.quant or "default"))
    path = where / name if name else None
    if path is None or not path.is_file() or not _read(path.with_name(path.name + ".sha256")):
        return None
    return path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold `path`'s lock: one download into a repository's directory at a time."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)

"""Bounded per request and per connection: imports stream through a temporary file (memory
holds a chunk, not the file), a few at a time; prompts too long for the prompt limit are
refused by their byte length before anything tokenizes them."""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from checkpoint_helpers import EXPORT_MAGIC, GREEDY, gen
from daemons import DaemonProcess
from procfs import vm

import kvkeep

IMPORT_BYTES = 150 << 20
PARALLEL = 10
#: The most RSS may grow while they run: the model and one session are loaded before the
#: baseline is taken; the imports themselves hold only gRPC's buffers of their chunks.
RSS_GROWTH = 96 << 20


class SlowExport:
    """A file-like 150 MB stream that looks like an export (magic, one block record of all
    of it) and arrives slowly: its digest can only fail at the very end."""

    def __init__(self, size: int) -> None:
        self.left = size
        self.head = EXPORT_MAGIC + struct.pack("<BI", 2, size - len(EXPORT_MAGIC) - 5) + b"0" * 64

    def read(self, n: int = -1) -> bytes:
        if self.head:
            out, self.head = self.head, b""
            self.left -= len(out)
            return out
        n = min(n if n > 0 else 1 << 20, self.left)
        self.left -= n
        time.sleep(0.002)
        return bytes(n)


@pytest.mark.timeout(600)
def test_parallel_slow_imports_keep_memory_bounded(spawn_daemon: Callable[..., DaemonProcess]) -> None:
    d = spawn_daemon("--ctx-per-session", "2048")
    outcomes: list[BaseException | None] = []
    with kvkeep.Client(d.address, timeout=600) as client:
        session = client.create_session(sampling=GREEDY)
        gen(session, "Warm up the engine once.", n=4)
        baseline = vm(d.pid, "VmRSS")
        # The peak from here on: reset it (writing 5 to clear_refs resets VmHWM).
        Path(f"/proc/{d.pid}/clear_refs").write_text("5")

        def run() -> None:
            try:
                client.import_checkpoint(SlowExport(IMPORT_BYTES))  # type: ignore[arg-type]
                outcomes.append(None)
            except BaseException as e:
                outcomes.append(e)

        threads = [threading.Thread(target=run) for _ in range(PARALLEL)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        peak = vm(d.pid, "VmHWM")
        assert len(gen(session, n=3)) == 3  # serving all along
    kinds = sorted(type(e).__name__ for e in outcomes)
    print(f"RSS {baseline >> 20} MiB before, peak {peak >> 20} MiB while {PARALLEL} imports ran: {kinds}")
    busy = kinds.count("BusyError")
    corrupt = kinds.count("CorruptCheckpointError")
    assert busy + corrupt == PARALLEL, kinds
    assert 1 <= corrupt <= 4 and busy >= PARALLEL - 4, kinds  # at most 4 received at once
    assert peak - baseline <= RSS_GROWTH, f"RSS grew by {(peak - baseline) >> 20} MiB"
    assert not [p for p in d.state_dir.iterdir() if p.is_file() and p.name.startswith("tmp")]


def test_a_prompt_too_long_in_bytes_is_refused_before_tokenizing(client: kvkeep.Client) -> None:
    info = client.info()
    session = client.create_session()
    text = "word " * (info.max_prompt_tokens * 64)
    with pytest.raises(kvkeep.InvalidRequestError, match="bytes"):
        session.complete(text, max_tokens=1)
    with pytest.raises(kvkeep.InvalidRequestError, match="bytes"):
        client.create_session(system_prompt=text)
    assert session.info().n_tokens == 0
    session.close()

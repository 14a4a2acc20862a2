"""Exact mode on flash attention: llama.cpp's CPU kernel with the batch-invariant switch that
patches/llama.cpp/ adds (GGML_CPU_FA_BATCH_INVARIANT), which the tests' processes turn on
(tests/support/daemons.py).

- a token's logits are bit-identical whether its sequence was evaluated whole (in chunks of
  the batch size) or as a cached prefix and a suffix of 1, 7, 63, 64, 65 or 500 tokens, alone
  or beside another session's token in the same batch, at 1k and 8k tokens: on SmolLM2 (8k:
  `scripts/test -m long`), on Gemma 3 270M (sliding window) and on a tiny Qwen3 (grouped
  query heads);
- the same logits with one thread or two;
- llama.cpp's own kernels (the switch off, in a process of their own) give other logits for
  the same tokens batched otherwise, so the probe finds it: the comparison can fail;
- the default daemon runs exact mode on flash attention, and says so; where the probe finds
  the kernels batch-dependent (here: the switch turned off by the operator, as a llama.cpp
  built without the patch would be), it runs exact mode without flash attention and says why
  in one line, and the next start knows it from the probe cache without trying again.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import testmodels
from daemons import DaemonProcess, model_path

import kvkeep
from kvkeepd.engine.context import BatchItem, LlamaContext
from kvkeepd.engine.context_config import ContextConfig

SUFFIXES = (1, 7, 63, 64, 65, 500)
BATCH = 512


def config(path: Path, n: int, threads: int = 2, **kw: object) -> ContextConfig:
    """Two slots of `n` cells, exact mode on batch-invariant flash attention."""
    fields: dict[str, object] = {
        "model_path": path,
        "slots": 2,
        "ctx_per_session": n,
        "batch_size": BATCH,
        "threads": threads,
        "gpu_layers": 0,
        "kv_type": "f16",
        "kv_unified": False,
        "exact_flash": True,
        **kw,
    }
    return ContextConfig(**fields)  # type: ignore[arg-type]


@pytest.fixture
def opened() -> Iterator[Callable[[ContextConfig], LlamaContext]]:
    made: list[LlamaContext] = []

    def open_(cfg: ContextConfig) -> LlamaContext:
        made.append(LlamaContext(cfg))
        return made[-1]

    yield open_
    for ctx in made:
        ctx.close()


def digest(row: np.ndarray) -> bytes:
    """A row of logits, bit for bit, in 16 bytes (a large vocabulary's rows take MBs)."""
    return hashlib.blake2b(np.ascontiguousarray(row).tobytes(), digest_size=16).digest()


def marks(n: int) -> set[int]:
    """The positions compared: each suffix's first, 63rd, 64th, 65th and last token."""
    found = {n - 1}
    for length in SUFFIXES:
        found.update(p for p in (n - length, n - length + 62, n - length + 63, n - length + 64) if p < n)
    return found


def whole(ctx: LlamaContext, slot: int, tokens: list[int], keep: set[int]) -> dict[int, bytes]:
    """Evaluate `tokens` from position 0 in chunks of the batch size; the kept rows' digests."""
    kept: dict[int, bytes] = {}
    for at in range(0, len(tokens), BATCH):
        part = range(at, min(at + BATCH, len(tokens)))
        wanted = [p for p in part if p in keep]
        rows = ctx.decode([BatchItem(slot, tokens[p], p, p in keep) for p in part])
        kept.update({p: digest(r) for p, r in zip(wanted, rows, strict=True)})
    return kept


CASES = [
    pytest.param(model_path, 1024, id="smollm2-1k"),
    # Four minutes of CPU on two loaded cores: by hand, scripts/test -m long.
    pytest.param(model_path, 8192, id="smollm2-8k", marks=pytest.mark.long),
    pytest.param(testmodels.gemma3_270m, 1024, id="gemma3-270m-1k"),
    pytest.param(lambda: testmodels.path("qwen3"), 1024, id="qwen3-tiny-1k"),
    pytest.param(lambda: testmodels.path("qwen3"), 8192, id="qwen3-tiny-8k"),
]


@pytest.mark.timeout(900)
@pytest.mark.parametrize(("model", "n"), CASES)
def test_a_suffix_after_a_cached_prefix_has_the_logits_of_the_whole(
    model: Callable[[], Path], n: int, opened: Callable[[ContextConfig], LlamaContext]
) -> None:
    ctx = opened(config(model(), n))
    assert ctx.cfg.flash_attention and ctx.cfg.exact
    rng = np.random.default_rng(n)
    tokens = [int(t) for t in rng.integers(0, ctx.n_vocab, n)]
    other = [int(t) for t in rng.integers(0, ctx.n_vocab, 64)]
    keep = marks(n)
    reference = whole(ctx, 0, tokens, keep)
    beside = 0  # the other session's next position (slot 1)
    for length in SUFFIXES:
        for with_other in (False, True):
            start = n - length
            assert ctx.remove_from(0, start)
            items = [BatchItem(0, tokens[p], p, p in keep) for p in range(start, n)]
            if with_other:
                items.append(BatchItem(1, other[beside % len(other)], beside, False))
                beside += 1
            rows = ctx.decode(items)
            got = {p: digest(r) for p, r in zip(sorted(keep & set(range(start, n))), rows, strict=True)}
            differ = [p for p, d in got.items() if d != reference[p]]
            assert not differ, (length, with_other, differ)


def test_one_thread_and_two_give_the_same_logits(opened: Callable[[ContextConfig], LlamaContext]) -> None:
    n = 1024
    one, two = opened(config(model_path(), n, threads=1)), opened(config(model_path(), n, threads=2))
    tokens = [int(t) for t in np.random.default_rng(1).integers(0, one.n_vocab, n)]
    keep = marks(n)
    assert whole(one, 0, tokens, keep) == whole(two, 0, tokens, keep)


STOCK = """
import sys
from pathlib import Path
from kvkeepd.engine.context import LlamaContext
from kvkeepd.engine.context_config import ContextConfig
from kvkeepd.engine.probes import batch_dependence
cfg = ContextConfig(model_path=Path(sys.argv[1]), slots=2, ctx_per_session=512, batch_size=512,
    threads=1, gpu_layers=0, kv_type="f16", kv_unified=False, flash_attn=True)
ctx = LlamaContext(cfg)
print(batch_dependence(ctx))
"""


@pytest.mark.parametrize("switch", ["unset", "1"])
def test_the_probe_finds_llama_cpp_s_own_flash_attention_depends_on_the_batch(switch: str) -> None:
    """In a process of its own: ggml reads the switch once per process."""
    env = {k: v for k, v in os.environ.items() if k != "GGML_CPU_FA_BATCH_INVARIANT"}
    if switch != "unset":
        env["GGML_CPU_FA_BATCH_INVARIANT"] = switch
    done = subprocess.run(
        [sys.executable, "-c", STOCK, str(model_path())], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    found = done.stdout.strip().splitlines()[-1]
    if switch == "unset":
        assert "away from those of one chunk of 260" in found, found
    else:
        assert found == "None", found


def test_the_default_daemon_runs_exact_mode_on_flash_attention(client: kvkeep.Client) -> None:
    info = client.info()
    assert (info.mode, info.flash_attention, info.attention_note) == ("exact", True, ""), info


def test_where_the_probe_finds_flash_attention_batch_dependent_exact_mode_runs_without_it(
    spawn_daemon: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    probes = tmp_path / "probes.json"
    off = {"GGML_CPU_FA_BATCH_INVARIANT": "0"}
    first = spawn_daemon("--probe-cache", str(probes), env=off)
    with kvkeep.Client(first.address) as c:
        info = c.info()
    assert (info.mode, info.flash_attention) == ("exact", False), info
    assert "not batch-invariant" in info.attention_note, info.attention_note
    log = first.log()
    said = [line for line in log.splitlines() if "exact mode evaluates without flash attention" in line]
    assert len(said) == 1, log
    assert log.count("exactness probe: checking") == 2, log  # flash attention's, then without
    assert "exact (attention without flash" in log, log
    first.terminate()

    again = spawn_daemon("--probe-cache", str(probes), state_dir=first.state_dir, env=off)
    with kvkeep.Client(again.address) as c:
        assert c.info().attention_note == info.attention_note
    log = again.log()
    assert "exactness probe: checking" not in log, log
    assert log.count("exact mode evaluates without flash attention") == 1, log

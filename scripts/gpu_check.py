"""scripts/gpu-check's checks and measurements, run on kvkeep's engine directly, and its report.

For each of exact mode without flash attention, llama.cpp's flash attention (compact), and
exact mode's batch-invariant flash attention (where the probe finds it exact; else the run
says why and is exact mode without it: `attention_note`), one engine of
16 slots, two docks and the scratch, on a model with random weights (scripts/gpu_model.py):

- exactness, bit for bit: the start-up probe (one token against chunks of 1 to 128, beside
  another sequence), a sequence evaluated in another slot, a state restored from host memory
  into another slot, and a session docked and undocked into another slot, each against the
  same tokens evaluated once in one slot; and the same tokens evaluated whole against a
  cached prefix and a suffix of 1, 7, 63, 64, 65 or 500 tokens, alone or beside another
  slot's token (with flash attention on, this answers whether exact mode can keep it on the
  device: `--exact-attention auto` falls back where it cannot);
- re-prefill of N tokens; a restore of their state from host memory (GB/s, and the copy into
  llama.cpp alone); resume + first token against re-prefill; a switch to a docked session
  (dock the one in the slot, undock the other, one token) less a plain one-token step; 16
  sessions decoding together against one.

The report (gpu-check.json, gpu-check.md) goes to --out with the targets and whether each
was met. Exit status 0 when every exactness check that the mode promises passed.

    python scripts/gpu_check.py --shape 1b --tokens 8000 --out "$OUT"
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "daemon"))

import gpu_model

from kvkeepd.engine import probes, streams
from kvkeepd.engine.context import BatchItem
from kvkeepd.engine.context_config import ContextConfig
from kvkeepd.engine.engine import Engine
from kvkeepd.engine.job import SeqState
from kvkeepd.state import pieces

T = TypeVar("T")
SLOTS = 16
DOCKS = 2
TARGETS = {
    "host_restore_gb_s": (">=", 20.0),
    "switch_to_docked_ms": ("<=", 1.0),
    "resume_speedup": (">=", 3.0),
    "decode_16_vs_1": (">=", 4.5),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(gpu_model.SHAPES), default="1b")
    parser.add_argument("--model", type=Path, default=None, help="GGUF (default: generated in --out)")
    parser.add_argument("--tokens", type=int, default=8000, help="tokens of the measured session")
    parser.add_argument("--steps", type=int, default=64, help="decode steps of the concurrency run")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"shape": args.shape, "tokens": args.tokens, "targets": TARGETS, "runs": []}
    model = args.model
    if model is None:
        model = args.out / f"random-{args.shape}.gguf"
        started = time.perf_counter()
        gpu_model.write(model, args.shape)
        report["model_seconds"] = round(time.perf_counter() - started, 1)
        print(f"model {model} ({model.stat().st_size >> 20} MiB) in {report['model_seconds']} s", flush=True)
    shape = gpu_model.SHAPES[args.shape]
    heads = shape["n_embd"] // shape["n_head"]
    row = streams.row_bytes(streams.ModelShape(shape["n_layer"], shape["n_head_kv"], heads, heads), "f16")
    # Exact mode's flash attention before compact mode's: ggml reads its CPU switch once per
    # process (on the CPU the compact run then has the batch-invariant kernels too; a GPU's
    # own kernels do not read it).
    for flash, exact_flash in ((False, False), (False, True), (True, False)):
        run = measure(model, row, flash, exact_flash, args)
        report["runs"].append(run)
        print(json.dumps(run), flush=True)
    report["machine"] = {"platform": platform.platform(), "python": platform.python_version()}
    if args.model is None:
        model.unlink()  # gigabytes: nothing of it goes back
    report["broken"] = broken(report)
    (args.out / "gpu-check.json").write_text(json.dumps(report, indent=1))
    (args.out / "gpu-check.md").write_text(markdown(report))
    print(markdown(report), flush=True)
    return 0 if not broken(report) else 1


def broken(report: dict[str, Any]) -> list[str]:
    """The checks that failed what the mode promises: stored KV restored (from host memory or
    a dock) is the same bytes in any mode; the rest only where the probe found exact mode."""
    always = ("restored into another slot", "dock round trip")
    return [
        f"{run['attention']}: {check}"
        for run in report["runs"]
        for check, found in run["checks"].items()
        if found != "same" and (run["exact"] or check in always)
    ]


def measure(
    model: Path, row: int, flash: bool, exact_flash: bool, args: argparse.Namespace
) -> dict[str, Any]:
    n = args.tokens
    ctx = -(-(n + 256) // 256) * 256
    cfg = ContextConfig(
        model_path=model,
        slots=SLOTS,
        ctx_per_session=ctx,
        batch_size=512,
        threads=args.threads,
        gpu_layers=-1,
        kv_type="f16",
        kv_unified=False,
        flash_attn=flash,
        exact_flash=exact_flash,
        kv_budget=(SLOTS + DOCKS + 1) * ctx * row,
    )
    engine = Engine(cfg)
    started = time.perf_counter()
    info = engine.start()
    loaded = time.perf_counter() - started
    try:
        run: dict[str, Any] = {
            "flash_attn": flash,
            "attention": _attention(flash, info.flash_attention),
            "attention_note": info.flash_note,
            "load_seconds": round(loaded, 2),
            "exact": info.exact,
            "mode_note": info.exact_note,
            "devices": [d.__dict__ for d in engine.devices],
            "pinned_transfers": engine.pinned,
            "streams": engine.streams.__dict__,
        }
        on = _on(engine)
        if flash:  # compact mode skips the start-up probe: run it for the record
            run["probe"] = on(lambda e: probes.batch_dependence(e.ctx)) or "no difference found"
        run["checks"] = on(lambda e: checks(e, min(n, 300)))
        run.update(on(lambda e: restores(e, n, args.repeat)))
        run["switch_to_docked_ms"] = on(lambda e: switch(e, n, args.repeat))
        run.update(on(lambda e: decoding(e, args.steps)))
    finally:
        engine.stop()
    run["met"] = {k: _met(k, run[k]) for k in TARGETS if k in run}
    return run


def _attention(compact: bool, flash: bool) -> str:
    if compact:
        return "flash attention on (compact mode)"
    return "exact mode, batch-invariant flash attention" if flash else "exact mode, flash attention off"


def _on(engine: Engine) -> Callable[[Callable[[Engine], T]], T]:
    return lambda fn: engine.call(fn).result()


def _met(key: str, value: float) -> bool:
    op, bound = TARGETS[key]
    return value >= bound if op == ">=" else value <= bound


def _tokens(e: Engine, n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, e.ctx.n_vocab, n)]


def prefill(e: Engine, slot: int, tokens: list[int], start: int = 0) -> np.ndarray:
    """Evaluate tokens into a slot from position `start`, in batches; the last logits row."""
    batch = e.config.batch_size
    row = None
    for at in range(0, len(tokens), batch):
        part = tokens[at : at + batch]
        last = at + len(part) == len(tokens)
        items = [BatchItem(slot, t, start + at + k, last and k == len(part) - 1) for k, t in enumerate(part)]
        rows = e.ctx.decode(items)
        row = rows[0] if rows else row
    assert row is not None
    return row


def step(e: Engine, slot: int, token: int, pos: int) -> np.ndarray:
    return e.ctx.decode([BatchItem(slot, token, pos, True)])[0]


def _same(a: np.ndarray, b: np.ndarray) -> str:
    return "same" if np.array_equal(a, b) else f"differs by up to {float(np.max(np.abs(a - b))):.3g}"


def checks(e: Engine, n: int) -> dict[str, str]:
    """Each way of reaching the same state, against one chunk in slot 0: the next token's logits."""
    tokens = _tokens(e, n + 1, 1)
    history, nxt = tokens[:n], tokens[n]
    ctx = e.ctx
    out = {}
    prefill(e, 0, history)
    reference = step(e, 0, nxt, n)
    ctx.clear(0)
    prefill(e, 5, history)
    out["another slot"] = _same(step(e, 5, nxt, n), reference)
    ctx.clear(5)
    for size in (1, 7, 64):
        for at in range(0, n, size):
            ctx.decode([BatchItem(3, t, at + k, False) for k, t in enumerate(history[at : at + size])])
        out[f"chunks of {size}"] = _same(step(e, 3, nxt, n), reference)
        ctx.clear(3)
    prefill(e, 0, history)
    state = SeqState(tokens=list(history), n_kv=n)
    kv = e.export(0, state)
    e.load(7, SeqState(tokens=list(history), n_kv=n), kv)
    out["restored into another slot"] = _same(step(e, 7, nxt, n), reference)
    ctx.clear(7)
    e.move(0, e.streams.dock_id(0))
    e.move(e.streams.dock_id(0), 9)
    out["dock round trip"] = _same(step(e, 9, nxt, n), reference)
    ctx.clear(9)
    out.update(suffixes(e, len(tokens) - 1))
    return out


SUFFIXES = (1, 7, 63, 64, 65, 500)


def suffixes(e: Engine, n: int) -> dict[str, str]:
    """The sequence evaluated whole (in chunks of the batch size), against a cached prefix and
    a suffix of 1 to 500 tokens evaluated alone or beside another slot's token: each suffix
    token's logits. Whether exact mode can keep flash attention on this device is this check
    with flash attention on (the kernels chosen by the number of queries must agree)."""
    n = max(n, max(SUFFIXES) + 1)
    tokens = _tokens(e, n, 3)
    ctx = e.ctx
    batch = e.config.batch_size
    reference: dict[int, np.ndarray] = {}
    # Compared: each suffix's first, 63rd, 64th, 65th and last token (a batch gives at most
    # LlamaContext.outputs_max rows of logits).
    marks = {n - length + k for length in SUFFIXES for k in (0, 62, 63, 64)}
    marks = {p for p in marks if p < n} | {n - 1}
    for at in range(0, n, batch):
        part = range(at, min(at + batch, n))
        rows = ctx.decode([BatchItem(0, tokens[p], p, p in marks) for p in part])
        reference.update(zip([p for p in part if p in marks], rows, strict=True))
    out = {}
    beside = 0
    for length in SUFFIXES:
        for other in (False, True):
            assert ctx.remove_from(0, n - length)
            items = [BatchItem(0, tokens[p], p, p in marks) for p in range(n - length, n)]
            if other:
                items.append(BatchItem(1, tokens[beside], beside, False))
                beside += 1
            rows = ctx.decode(items)
            kept = [p for p in range(n - length, n) if p in marks]
            worst = max(float(np.max(np.abs(r - reference[p]))) for p, r in zip(kept, rows, strict=True))
            key = f"suffix of {length}{' beside another' if other else ''}"
            out[key] = "same" if worst == 0 else f"differs by up to {worst:.3g}"
    ctx.clear(0)
    ctx.clear(1)
    return out


def restores(e: Engine, n: int, repeat: int) -> dict[str, float]:
    """Re-prefill of n tokens, their state restored from host memory, and resume + first token."""
    tokens = _tokens(e, n + 1, 2)
    ctx = e.ctx
    prefills, loads, copies, resumes = [], [], [], []
    kv = None
    for k in range(repeat + 1):  # the first warms up (graphs, allocations)
        ctx.clear(0)
        t0 = time.perf_counter()
        prefill(e, 0, tokens[:n])
        if k:
            prefills.append(time.perf_counter() - t0)
    kv = e.export(0, SeqState(tokens=tokens[:n], n_kv=n))
    ctx.clear(0)
    size = pieces.blob_size(kv)
    blob = pieces.assemble(kv, into=np.empty(size, np.uint8))
    for k in range(repeat + 1):
        state = SeqState(tokens=tokens[:n], n_kv=n)
        t0 = time.perf_counter()
        e.load(1, state, kv)
        t1 = time.perf_counter()
        step(e, 1, tokens[n], n)
        t2 = time.perf_counter()
        ctx.clear(1)
        t3 = time.perf_counter()
        ctx.set_state(1, blob)
        t4 = time.perf_counter()
        ctx.clear(1)
        if k:
            loads.append(t1 - t0)
            resumes.append(t2 - t0)
            copies.append(t4 - t3)
    best = min
    return {
        "state_bytes": size,
        "reprefill_ms": round(best(prefills) * 1e3, 2),
        "host_restore_ms": round(best(loads) * 1e3, 2),
        "host_restore_gb_s": round(size / best(loads) / 1e9, 2),
        "llama_copy_in_gb_s": round(size / best(copies) / 1e9, 2),
        "resume_first_token_ms": round(best(resumes) * 1e3, 2),
        "resume_speedup": round(best(prefills) / best(resumes), 2),
    }


def switch(e: Engine, n: int, repeat: int) -> float:
    """Milliseconds a switch to a docked session adds to its next token: one session in slot
    0, the other in a dock; dock the first, undock the other into slot 0, one token of it;
    less one plain step of it. Then the other way round."""
    ctx = e.ctx
    toks = [_tokens(e, n + 3 * repeat + 1, 3), _tokens(e, n + 3 * repeat + 1, 4)]
    pos = [n, n]
    prefill(e, 0, toks[1][:n])
    e.move(0, e.streams.dock_id(0))  # session 1 waits in dock 0
    prefill(e, 0, toks[0][:n])
    here, docked_at = 0, 0
    switched, plain = [], []
    for _ in range(repeat):
        step(e, 0, toks[here][pos[here]], pos[here])  # the slot's session, as it would run
        pos[here] += 1
        there, free = 1 - here, 1 - docked_at
        t0 = time.perf_counter()
        e.move(0, e.streams.dock_id(free))
        e.move(e.streams.dock_id(docked_at), 0)
        step(e, 0, toks[there][pos[there]], pos[there])
        switched.append(time.perf_counter() - t0)
        pos[there] += 1
        t0 = time.perf_counter()
        step(e, 0, toks[there][pos[there]], pos[there])
        plain.append(time.perf_counter() - t0)
        pos[there] += 1
        here, docked_at = there, free
    ctx.clear(0)
    ctx.clear(e.streams.dock_id(docked_at))
    return round((statistics.median(switched) - statistics.median(plain)) * 1e3, 3)


def decoding(e: Engine, steps: int) -> dict[str, float]:
    """Tokens per second of one session decoding alone and of 16 decoding together."""
    ctx = e.ctx
    prompt = 64
    rates = {}
    for count in (1, 4, SLOTS):
        for slot in range(count):
            prefill(e, slot, _tokens(e, prompt, 10 + slot))
        toks = _tokens(e, steps + 2, 5)
        for k in range(steps + 2):  # two steps warm up
            if k == 2:
                t0 = time.perf_counter()
            ctx.decode([BatchItem(slot, toks[k], prompt + k, True) for slot in range(count)])
        rates[count] = count * steps / (time.perf_counter() - t0)
        for slot in range(count):
            ctx.clear(slot)
    return {
        "decode_tok_s_1": round(rates[1], 1),
        "decode_tok_s_4": round(rates[4], 1),
        "decode_tok_s_16": round(rates[SLOTS], 1),
        "decode_16_vs_1": round(rates[SLOTS] / rates[1], 2),
    }


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# gpu-check: {report['shape']}-shaped model, {report['tokens']} tokens", ""]
    if report.get("broken"):
        lines += ["Failed: " + "; ".join(report["broken"]), ""]
    for run in report["runs"]:
        devices = ", ".join(f"{d['name']} ({d['description']})" for d in run["devices"])
        mode = "exact" if run["exact"] else f"compact: {run['mode_note']}"
        lines += [
            f"## {run['attention']}" + (f" ({run['attention_note']})" if run["attention_note"] else ""),
            "",
            f"Devices: {devices}. Mode: {mode}. Pinned transfers: {run['pinned_transfers']}.",
            "",
            "| check | next token's logits against one chunk in slot 0 |",
            "| --- | --- |",
            *(f"| {k} | {v} |" for k, v in run["checks"].items()),
        ]
        if "probe" in run:
            lines.append(f"| start-up probe | {run['probe']} |")
        lines += ["", "| measure | value | target | met |", "| --- | --- | --- | --- |"]
        for key in (
            "reprefill_ms",
            "host_restore_ms",
            "host_restore_gb_s",
            "llama_copy_in_gb_s",
            "resume_first_token_ms",
            "resume_speedup",
            "switch_to_docked_ms",
            "decode_tok_s_1",
            "decode_tok_s_4",
            "decode_tok_s_16",
            "decode_16_vs_1",
        ):
            op, bound = TARGETS.get(key, ("", ""))
            met = run["met"].get(key, "")
            lines.append(f"| {key} | {run[key]} | {op} {bound} | {met} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

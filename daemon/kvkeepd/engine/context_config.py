"""What the llama.cpp context is asked to be: ContextConfig, the daemon's settings it needs and
the mode they make (exact or compact, with or without flash attention), and the ggml switches
exact mode sets before any graph runs (kernel_environment)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from kvkeepd.config.settings import Settings, user_cache_dir


@dataclass(frozen=True)
class ContextConfig:
    """What the context needs from the daemon's settings."""

    model_path: Path
    slots: int
    ctx_per_session: int
    batch_size: int
    threads: int
    gpu_layers: int
    kv_type: str
    kv_unified: bool
    flash_attn: bool = False
    # Exact mode takes flash attention with batch-invariant kernels (see exact_flash below).
    exact_flash: bool = False
    # Where the exactness probe's results are kept (probes.py); None: probe at every start.
    probe_cache: Path | None = None
    # Bytes of KV the context may take (--gpu-kv-budget; 0: one stream per slot, no docks).
    kv_budget: int = 0
    # Most prompt tokens one step evaluates beside other work (steps.plan caps it at batch_size).
    prefill_chunk: int = 256
    # Seconds a step shared with other work aims at (steps.Pace); 0: prefill_chunk tokens.
    step_target: float = 0.5

    @classmethod
    def of(cls, settings: Settings) -> ContextConfig:
        """What the settings ask of the context. `--probe-cache none`: probe at every start."""
        probes: Path | None = None
        if settings.probe_cache != "none":
            probes = Path(settings.probe_cache) if settings.probe_cache else user_cache_dir() / "probes.json"
        return cls(
            model_path=settings.model_path,
            slots=settings.slots,
            ctx_per_session=settings.ctx_per_session,
            batch_size=settings.batch_size,
            prefill_chunk=settings.prefill_chunk,
            step_target=settings.step_target,
            threads=settings.threads,
            gpu_layers=settings.gpu_layers,
            kv_type=settings.kv_type,
            kv_unified=settings.kv_unified,
            flash_attn=settings.flash_attn,
            exact_flash=settings.exact_attention == "auto",
            probe_cache=probes,
            kv_budget=settings.gpu_kv_budget,
        )

    @property
    def flash_attention(self) -> bool:
        """Flash attention is on: asked for, needed by quantized K/V, or exact mode's own."""
        return self.flash_attn or self.kv_type != "f16" or self.batch_invariant_flash

    @property
    def batch_invariant_flash(self) -> bool:
        """Exact mode on flash attention whose kernels do not depend on the batch's shape:
        GGML_CPU_FA_BATCH_INVARIANT, which patches/llama.cpp/ adds to llama.cpp's CPU kernel
        (a build without it ignores the switch, and the start-up probe finds the dependence)."""
        return self.exact and self.exact_flash

    @property
    def exact(self) -> bool:
        """f16 K/V, a stream per slot, no flash attention but the batch-invariant kind: the
        bit-exact mode."""
        return self.kv_type == "f16" and not self.kv_unified and not self.flash_attn


def kernel_environment(cfg: ContextConfig) -> None:
    """Set the ggml switches exact mode needs before any graph runs: ggml reads each once,
    at the first kernel that asks (see LlamaContext.__init__)."""
    if cfg.exact:
        os.environ["GGML_CPU_TILED_MM"] = "0"
    if cfg.batch_invariant_flash:
        # An operator's own value stands (0: llama.cpp's kernels; the probe then decides).
        os.environ.setdefault("GGML_CPU_FA_BATCH_INVARIANT", "1")

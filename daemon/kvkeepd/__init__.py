"""kvkeepd: the kvkeep daemon. One GGUF model, many sessions, session checkpoints."""

__all__ = ["__version__"]

try:
    from importlib.metadata import version as _version

    __version__ = _version("kvkeep")
except Exception:  # pragma: no cover - running from a source tree
    __version__ = "0+unknown"

"""A process's memory figures, read from /proc."""

from __future__ import annotations

from pathlib import Path


def vm(pid: int, field: str) -> int:
    """A field of /proc/PID/status in bytes (VmRSS, VmHWM: the peak resident set)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)

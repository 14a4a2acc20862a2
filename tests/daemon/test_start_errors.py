"""A mistake at the daemon's start is one line naming the setting to change, never a traceback,
and comes before the model loads where it can."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from daemons import PROBE_CACHE, model_path


def _start(*args: str, prefix: Sequence[str] = (), **popen: object) -> tuple[int, list[str], float]:
    """`python -m kvkeepd` with `args` after the usual test settings, run by `prefix`: (exit
    status, stderr's lines, seconds it ran)."""
    command = [
        *prefix,
        sys.executable,
        "-m",
        "kvkeepd",
        "--threads",
        "1",
        "--ctx-per-session",
        "256",
        "--slots",
        "1",
        "--probe-cache",
        str(PROBE_CACHE),
        "--address",
        "127.0.0.1:0",
        "--http",
        "off",
        *args,
    ]
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, **popen)  # type: ignore[call-overload]
    return done.returncode, done.stderr.splitlines(), time.monotonic() - started


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port something else listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_a_busy_grpc_port_is_one_line_before_the_model_loads(busy_port: int, tmp_path: Path) -> None:
    status, lines, _ = _start("--address", f"127.0.0.1:{busy_port}", "--state-dir", str(tmp_path / "s"))
    assert status == 1
    assert lines == [
        f"error: cannot listen on 127.0.0.1:{busy_port} (gRPC): the port is in use (by another kvkeep "
        "daemon, or another program); choose another with --port (or --address)"
    ]


def test_a_busy_http_port_is_one_line_before_the_model_loads(busy_port: int, tmp_path: Path) -> None:
    status, lines, _ = _start("--http", f"127.0.0.1:{busy_port}", "--state-dir", str(tmp_path / "s"))
    assert status == 1
    assert lines == [
        f"error: cannot listen on 127.0.0.1:{busy_port} (HTTP): the port is in use (by another kvkeep "
        "daemon, or another program); choose another with --http-port (or --http), or turn the HTTP door "
        "off with --http off"
    ]


def test_a_file_that_is_not_gguf_is_one_line(tmp_path: Path) -> None:
    model = tmp_path / "model.gguf"
    model.write_text("<!DOCTYPE html><html>a login page saved as a model</html>")
    status, lines, _ = _start("--model", str(model), "--state-dir", str(tmp_path / "s"))
    assert status == 2
    assert lines == [
        f"error: model (flag --model): {model} is not a GGUF model file (llama.cpp's format; its name "
        "ends in .gguf)"
    ]
    # A file that names no model at all is the same kind of line.
    status, lines, _ = _start("--model", str(tmp_path / "missing.gguf"), "--state-dir", str(tmp_path / "s"))
    assert (status, lines) == (2, [f"error: model (flag --model): no file {tmp_path / 'missing.gguf'}"])


def test_a_state_dir_that_is_a_file_names_the_flag(tmp_path: Path) -> None:
    (tmp_path / "state").write_text("not a directory")
    status, lines, _ = _start("--state-dir", str(tmp_path / "state"))
    assert status == 1
    assert lines == [
        f"error: cannot use the state directory {tmp_path / 'state'}: not a directory; choose another "
        "with --state-dir"
    ]


def _without_file_access_override() -> list[str]:
    """The command prefix under which root, too, is held to files' modes (as every other user
    is): setpriv drops the capabilities that override them before it executes the daemon. Not
    a preexec_fn: that runs Python in a child forked from this process's threads (gRPC's),
    which can deadlock or abort it."""
    if os.geteuid() != 0:
        return []
    return ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--"]


def test_an_unwritable_or_unreadable_state_dir_names_the_flag(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    status, lines, _ = _start("--state-dir", str(locked / "state"), prefix=_without_file_access_override())
    assert status == 1
    assert lines == [
        f"error: cannot use the state directory {locked / 'state'}: permission denied; choose another "
        "with --state-dir"
    ]
    status, lines, _ = _start("--state-dir", str(locked), prefix=_without_file_access_override())
    assert status == 1
    assert lines == [
        f"error: cannot use the state directory {locked} ({locked / 'lock'}): permission denied; choose "
        "another with --state-dir"
    ]


def test_ctrl_c_while_starting_exits_130_without_a_traceback(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvkeepd",
            "--model",
            str(model_path()),
            *("--threads", "1", "--slots", "4", "--ctx-per-session", "1024"),  # the tests' probe, kept
            "--address",
            "127.0.0.1:0",
            "--http",
            "off",
            "--state-dir",
            str(tmp_path / "s"),
            "--probe-cache",
            str(PROBE_CACHE),
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    while "loading" not in proc.stderr.readline():
        pass
    proc.send_signal(signal.SIGINT)
    rest = proc.stderr.read()
    assert proc.wait(120) == 130, rest
    assert "Traceback" not in rest and "Aborted" not in rest
    assert not os.path.exists(tmp_path / "s" / "spill")


def test_ctrl_c_during_the_start_up_probe_stops_it_at_once(tmp_path: Path) -> None:
    # --probe-cache none: the probe runs at this start (seconds), and is given up at its next
    # graph node once Ctrl-C comes.
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvkeepd",
            "--model",
            str(model_path()),
            *("--threads", "1", "--slots", "2", "--ctx-per-session", "512"),
            *("--address", "127.0.0.1:0", "--http", "off", "--state-dir", str(tmp_path / "s")),
            *("--probe-cache", "none"),
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    while "exactness probe: checking" not in (line := proc.stderr.readline()):
        assert line, "the daemon ended before its probe"
    interrupted = time.monotonic()
    proc.send_signal(signal.SIGINT)
    rest = proc.stderr.read()
    assert proc.wait(60) == 130, rest
    took = time.monotonic() - interrupted
    assert "Traceback" not in rest and "Aborted" not in rest
    assert "exactness probe: passed" not in rest and "found a dependence" not in rest, rest
    assert took < 3, f"{took:.1f} s from Ctrl-C to the end"

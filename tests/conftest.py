"""Fixtures: real kvkeep daemons on the real default model.

- ``daemon``: one in-process daemon for the whole run (slots=4, ctx_per_session=1024); share
  it wherever a test does not need special settings.
- ``client``: a ``kvkeep.Client`` connected to it.
- ``start_daemon(**settings)``: an extra in-process daemon with other settings, stopped when
  the test ends.
- ``spawn_daemon(*args)``: ``python -m kvkeepd`` as a subprocess (DaemonProcess), for signals,
  kill -9 and restarts; its log is attached to the report of a failing test.
- ``redis_server``, ``start_redis``, ``s3_server``, ``start_haproxy``: real servers on
  loopback (tests/support/servers.py).
"""

from __future__ import annotations

import itertools
import signal
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import pytest
from daemons import VIOLATION, DaemonProcess, InProcessDaemon
from servers import redis_server, s3_server, start_haproxy, start_redis  # noqa: F401  (fixtures)

import kvkeep

_counter = itertools.count()

# A test process started in the background by a shell (`scripts/test &`), or a worker that
# inherited such a start, ignores SIGINT, and so would every daemon and script the tests
# start, which then cannot be given Ctrl-C: the tests of Ctrl-C would wait forever. Their
# children get SIGINT's default back from a handler here (exec resets handlers, not ignores).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Attach the logs of the test's subprocess daemons to its report when it fails."""
    report = yield
    if report.failed:
        for proc in getattr(item, "_kvkeep_daemon_processes", ()):
            report.sections.append((f"kvkeep daemon log ({proc.log_path})", proc.log()))
    return report


@pytest.fixture(autouse=True)
def invariant_holds() -> Iterator[None]:
    """After every test, each running daemon is idle and consistent: its slot table, the
    sessions' placements, the engine's sequences and the catalog agree."""
    yield
    for d in list(InProcessDaemon.live):
        problems = d.check_invariant()
        assert not problems, f"{d}: " + "; ".join(problems)


@pytest.fixture(scope="session")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessDaemon]:
    """The shared daemon: slots=4, ctx_per_session=1024, threads=1."""
    d = InProcessDaemon.with_settings(tmp_path_factory.mktemp("state"))
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture(scope="session")
def daemon_address(daemon: InProcessDaemon) -> str:
    return daemon.address


@pytest.fixture
def client(daemon_address: str) -> Iterator[kvkeep.Client]:
    with kvkeep.Client(daemon_address, timeout=30) as c:
        yield c


@pytest.fixture
def start_daemon(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[..., InProcessDaemon]]:
    """A factory of extra in-process daemons: ``start_daemon(slots=1, ctx_per_session=256)``."""
    started: list[InProcessDaemon] = []

    def start(**settings: Any) -> InProcessDaemon:
        d = InProcessDaemon.with_settings(tmp_path_factory.mktemp("state"), **settings)
        started.append(d)
        return d

    yield start
    try:
        for d in started:
            problems = d.check_invariant()
            assert not problems, f"{d}: " + "; ".join(problems)
    finally:
        for d in reversed(started):
            d.stop()


@pytest.fixture
def spawn_daemon(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[..., DaemonProcess]]:
    """A factory of subprocess daemons: ``spawn_daemon("--slots", "2", start=True)``.

    Extra arguments go after the defaults, so they override them. ``state_dir`` lets two
    daemons (or one, spawned again) share a state directory; ``tls_ca``: the CA of a daemon
    serving TLS. Every process is stopped at the
    end of the test, and its log is attached to the report if the test fails.
    """
    procs: list[DaemonProcess] = []
    request.node._kvkeep_daemon_processes = procs

    def spawn(
        *args: str,
        state_dir: Path | None = None,
        env: dict[str, str] | None = None,
        start: bool = True,
        tls_ca: Path | None = None,
    ) -> DaemonProcess:
        n = next(_counter)
        proc = DaemonProcess(
            state_dir=state_dir or tmp_path / f"state{n}",
            log_path=tmp_path / f"daemon{n}.log",
            args=args,
            env=env,
            tls_ca=tls_ca,
        )
        procs.append(proc)
        if start:
            proc.start()
        return proc

    yield spawn
    for proc in procs:
        proc.close()
    violations = [line for proc in procs for line in proc.log().splitlines() if VIOLATION in line]
    assert not violations, "\n".join(violations)

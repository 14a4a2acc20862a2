"""deploy/: the systemd unit and the Containerfile start `kvkeep serve` with settings it
accepts, and keep the promises their comments make (hardening, stop timeout, non-root)."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import click
import pytest
from daemons import InProcessDaemon, model_path
from servers import require_binary

from kvkeepd import cli, urls
from kvkeepd.config import resolution
from kvkeepd.config import settings as config
from kvkeepd.sessions.tenants import Quota, Tenants

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
UNIT = DEPLOY / "kvkeep.service"
CONTAINERFILE = DEPLOY / "Containerfile"


def logical_lines(path: Path, comment: str = "#") -> list[str]:
    """The file's lines with backslash continuations joined, comments and blanks dropped."""
    out: list[str] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith(comment)):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        out.append(pending + line)
        pending = ""
    return out


def unit_service() -> dict[str, list[str]]:
    """The [Service] section: key -> its values, in order (a key may repeat)."""
    section = ""
    entries: dict[str, list[str]] = {}
    for line in logical_lines(UNIT):
        if line.startswith("["):
            section = line.strip("[]")
        elif section == "Service":
            key, _, value = line.partition("=")
            entries.setdefault(key, []).append(value)
    return entries


def serve_flags(args: list[str]) -> dict[str, object]:
    """The flags as `kvkeep serve` parses them (click.UsageError for an unknown one)."""
    ctx = cli.serve.make_context("kvkeep serve", list(args))
    return {k: v for k, v in ctx.params.items() if k not in ("config_file", "print_config", "ready_file")}


def test_the_unit_starts_kvkeep_serve_with_valid_settings(tmp_path: Path) -> None:
    service = unit_service()
    (exec_start,) = service["ExecStart"]
    exec_start = exec_start.replace("${CACHE_DIRECTORY}", str(tmp_path / "cache"))
    argv = shlex.split(exec_start.replace("${STATE_DIRECTORY}", str(tmp_path / "state")))
    assert argv[0].endswith("/bin/kvkeep") and argv[1] == "serve"
    env = dict(a.split("=", 1) for v in service["Environment"] for a in shlex.split(v))
    assert all(k in {o.env for o in config.options()} for k in env)
    resolved = resolution.resolve(serve_flags(argv[2:]), {**env, "KVKEEP_MODEL": str(model_path())})
    settings = resolved.settings
    assert settings.state_dir == tmp_path / "state"
    assert settings.probe_cache == str(tmp_path / "cache" / "probes.json")
    assert urls.is_local(settings.grpc_listen)  # no auth file: loopback only
    assert settings.http_listen is not None and urls.is_local(settings.http_listen)
    # Stopping takes up to the grace period, then as long again plus 5 s for operations in
    # flight (SessionManager.shutdown), then saving: systemd must wait longer than that.
    (timeout,) = service["TimeoutStopSec"]
    assert int(timeout) > 2 * settings.grace_seconds + 5 + 30


def test_the_unit_is_hardened() -> None:
    service = unit_service()
    expected = {
        "StateDirectory": "kvkeep",
        "StateDirectoryMode": "0700",
        "UMask": "0077",
        "DynamicUser": "yes",
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "Restart": "on-failure",
        "RestartPreventExitStatus": str(cli.USAGE),
        "CapabilityBoundingSet": "",
    }
    for key, value in expected.items():
        assert service.get(key) == [value], key
    (families,) = service["RestrictAddressFamilies"]
    assert set(families.split()) == {"AF_INET", "AF_INET6", "AF_UNIX"}


def test_the_unit_shows_how_a_shared_store_key_is_handed_over(tmp_path: Path) -> None:
    # The credential lines are commented out (a single daemon needs none): as they would be
    # uncommented, they name a setting that reads the key from a file.
    commented = ("#LoadCredential=", "#Environment=")
    lines = [line[1:] for line in UNIT.read_text().splitlines() if line.startswith(commented)]
    credential = next(line for line in lines if line.startswith("LoadCredential="))
    name, _, source = credential.removeprefix("LoadCredential=").partition(":")
    assignments = [a for line in lines if line.startswith("Environment=") for a in shlex.split(line[12:])]
    env = dict(a.split("=", 1) for a in assignments)
    assert env == {"KVKEEP_STORE_KEY_FILE": f"%d/{name}"} and source.startswith("/etc/")
    key = tmp_path / name
    key.write_text("0f" * 32 + "\n")
    environ = {"KVKEEP_STORE_KEY_FILE": str(key), "KVKEEP_MODEL": str(model_path())}
    assert resolution.resolve({}, environ).settings.store_key_file == key


def test_systemd_analyze_verifies_the_unit(tmp_path: Path) -> None:
    analyze = require_binary("systemd-analyze", "scripts/servers installs Debian's systemd")
    # verify checks that ExecStart's program exists: point it at this checkout's kvkeep.
    kvkeep = Path(sys.executable).parent / "kvkeep"
    unit = tmp_path / "kvkeep.service"
    unit.write_text(UNIT.read_text().replace("/opt/kvkeep/.venv/bin/kvkeep", str(kvkeep)))
    result = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stderr.strip() == ""


def containerfile() -> list[tuple[str, str]]:
    """The final stage's instructions: (INSTRUCTION, arguments)."""
    lines = [line.split(None, 1) for line in logical_lines(CONTAINERFILE)]
    stages = [i for i, (op, _) in enumerate(lines) if op == "FROM"]
    return [(op, rest) for op, rest in lines[stages[-1] :]]


def test_the_container_runs_kvkeep_serve_as_a_user_with_valid_settings(tmp_path: Path) -> None:
    final = containerfile()
    by_op: dict[str, list[str]] = {}
    for op, rest in final:
        by_op.setdefault(op, []).append(rest)
    (user,) = by_op["USER"]
    assert user.split(":")[0] not in ("root", "0")
    (entrypoint,) = by_op["ENTRYPOINT"]
    argv = json.loads(entrypoint)
    assert argv[0].endswith("/bin/kvkeep") and argv[1] == "serve"
    env = dict(a.split("=", 1) for v in by_op["ENV"] for a in shlex.split(v))
    assert set(env) <= {o.env for o in config.options()}
    (volume,) = by_op["VOLUME"]
    assert env["KVKEEP_STATE_DIR"] in json.loads(volume)
    # The image's settings, with the mounted files replaced by real ones, are accepted.
    auth = tmp_path / "auth.toml"
    auth.write_text('[tenants.a]\ntokens = ["a-token-of-32-characters-or-more-000"]\n')
    here = {**env, "KVKEEP_MODEL": str(model_path()), "KVKEEP_AUTH_FILE": str(auth)}
    here["KVKEEP_STATE_DIR"] = str(tmp_path / "state")
    settings = resolution.resolve(serve_flags(argv[2:]), here).settings
    assert not urls.is_local(settings.grpc_listen) and settings.auth_file == auth
    # Both doors listen beyond loopback, on the ports the image exposes.
    assert settings.http_listen is not None and not urls.is_local(settings.http_listen)
    (exposed,) = by_op["EXPOSE"]
    ports = {settings.grpc_listen.rpartition(":")[2], settings.http_listen.rpartition(":")[2]}
    assert set(exposed.split()) == ports
    # The build uses scripts/setup (and so its llama.cpp flags).
    assert any("scripts/setup --daemon" in line for line in logical_lines(CONTAINERFILE))


def test_the_containers_health_check_asks_a_real_daemon(daemon: InProcessDaemon) -> None:
    (check,) = [rest for op, rest in containerfile() if op == "HEALTHCHECK"]
    argv = json.loads(check.split("CMD", 1)[1])
    code = argv[-1].replace("127.0.0.1:50051", daemon.address)
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
    stopped = argv[-1].replace("50051", "1")  # nothing listens there
    assert subprocess.run([sys.executable, "-c", stopped], capture_output=True, timeout=60).returncode != 0


def test_an_unknown_flag_in_a_unit_would_be_refused() -> None:
    with pytest.raises(click.UsageError):
        serve_flags(["--slotz", "4"])


def test_the_auth_file_the_deploy_files_name_has_an_example_that_loads() -> None:
    example = DEPLOY / "auth.example.toml"
    for path in (UNIT, CONTAINERFILE):
        assert "deploy/auth.example.toml" in path.read_text()
    tenants = Tenants.load(example, Quota())
    assert sorted(tenants.names) == ["alice", "ci"]

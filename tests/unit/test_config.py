"""`kvkeep serve`'s settings: flag > environment > file > default, `--print-config`, and a
bad value from any source is one line naming the setting and a non-zero exit.

These run `python -m kvkeepd` as a subprocess with `--print-config` (which reads and checks
every setting, then exits before anything starts), so they need no model loaded.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from daemons import model_path

from kvkeepd import cli
from kvkeepd.config import resolution
from kvkeepd.config import settings as config

ORIGIN = re.compile(r"^#?\s*([a-z0-9-]+)\b.*#\s*(.+)$")


def kvkeep_serve(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """`kvkeep serve ARGS` with only `env` of KVKEEP_* set."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVKEEP_")}
    return subprocess.run(
        [sys.executable, "-m", "kvkeepd", *args],
        env={**clean, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
    )


def printed(*args: str, env: dict[str, str] | None = None) -> tuple[dict[str, object], dict[str, str]]:
    """The settings `--print-config` prints (as TOML) and each one's origin."""
    result = kvkeep_serve("--print-config", *args, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    values = tomllib.loads(result.stdout)
    origins = {}
    for line in result.stdout.splitlines()[1:]:
        m = ORIGIN.match(line)
        assert m, line
        origins[m[1]] = m[2].strip()
    return values, origins


def test_flag_over_environment_over_file_over_default(tmp_path: Path) -> None:
    file = tmp_path / "kvkeep.toml"
    file.write_text('slots = 2\nthreads = 3\ncodec = "zstd"\nidle_ttl = 5\nprefix-cache = false\n')
    values, origins = printed(
        "--config", str(file), "--slots", "7", env={"KVKEEP_SLOTS": "5", "KVKEEP_THREADS": "6"}
    )
    assert values["slots"] == 7 and origins["slots"] == "flag --slots"
    assert values["threads"] == 6 and origins["threads"] == "environment KVKEEP_THREADS"
    assert values["codec"] == "zstd" and origins["codec"] == f"file {file}"
    assert values["idle-ttl"] == 5.0 and origins["idle-ttl"] == f"file {file}"
    assert values["prefix-cache"] is False and origins["prefix-cache"] == f"file {file}"
    assert values["batch-size"] == 512 and origins["batch-size"] == "default"
    # KVKEEP_CONFIG names the file as --config does; a boolean flag beats the file.
    values, origins = printed("--prefix-cache", env={"KVKEEP_CONFIG": str(file)})
    assert values["slots"] == 2 and origins["slots"] == f"file {file}"
    assert values["prefix-cache"] is True and origins["prefix-cache"] == "flag --prefix-cache"


def test_print_config_lists_every_setting_and_reads_back(tmp_path: Path) -> None:
    values, origins = printed("--disk-budget", "5GiB", env={"KVKEEP_RAM_CACHE": "512MiB"})
    assert set(origins) == {o.key for o in config.options()}
    assert values["disk-budget"] == 5 << 30 and values["ram-cache"] == 512 << 20
    assert values["model"] == str(model_path())
    assert "auth-file" not in values and origins["auth-file"] == "default"  # unset: a comment
    # The output is a config file: fed back, every value is the same and comes from it.
    file = tmp_path / "printed.toml"
    file.write_text(kvkeep_serve("--print-config", "--slots", "3").stdout)
    again, from_file = printed("--config", str(file))
    assert again == {**printed("--slots", "3")[0]}
    assert {from_file[k] for k in again} == {f"file {file}"}


def test_every_setting_has_a_flag_a_variable_and_help() -> None:
    result = kvkeep_serve("--help")
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    for option in config.options():
        assert option.flag in text
        assert option.env in text
        assert option.spec.help.split()[0] in text


@pytest.mark.parametrize(
    ("args", "env", "toml", "line"),
    [
        (["--slots", "0"], {}, None, "slots (flag --slots): must be in [1, 256], got 0"),
        (["--disk-budget", "10XB"], {}, None, "disk-budget (flag --disk-budget): not an integer"),
        (["--kv-type", "q9"], {}, None, "kv-type (flag --kv-type): must be one of f16, q8_0, q4_0, got 'q9'"),
        (["--address", "0.0.0.0:50051"], {}, None, "address (flag --address): without auth-file"),
        (
            ["--address", "58052"],
            {},
            None,
            "address (flag --address): must be host:port, got '58052' (for a port alone: --port 58052)",
        ),
        (
            ["--http", "8081"],
            {},
            None,
            "http (flag --http): must be host:port, got '8081' (for a port alone: --http-port 8081)",
        ),
        (["--host", "0.0.0.0"], {}, None, "host (flag --host): without auth-file the HTTP API listens"),
        (["--port", "65536"], {}, None, "port (flag --port): must be in [0, 65535], got 65536"),
        (
            ["--tls-cert", "/nonexistent.pem"],
            {},
            None,
            "tls-cert (flag --tls-cert): no file /nonexistent.pem",
        ),
        ([], {"KVKEEP_SLOTS": "many"}, None, "slots (environment KVKEEP_SLOTS): not an integer: 'many'"),
        (
            [],
            {"KVKEEP_CTX_PER_SESSION": "300"},
            None,
            "ctx-per-session (environment KVKEEP_CTX_PER_SESSION): must be in [256, 1048576], "
            "a multiple of 256, got 300",
        ),
        (
            [],
            {"KVKEEP_PREFIX_CACHE": "maybe"},
            None,
            "prefix-cache (environment KVKEEP_PREFIX_CACHE): not a",
        ),
        ([], {"KVKEEP_IDLE_TTL": "nan"}, None, "idle-ttl (environment KVKEEP_IDLE_TTL): not a number"),
        (
            ["--batch-size", "40"],
            {"KVKEEP_SLOTS": "64"},
            None,
            "batch-size (flag --batch-size): must be at least slots (64), got 40",
        ),
        (
            [],
            {"KVKEEP_MAX_PROMPT_TOKENS": "4096"},
            None,
            "max-prompt-tokens (environment KVKEEP_MAX_PROMPT_TOKENS): must be at most "
            "ctx-per-session (2048)",
        ),
        ([], {}, "batch_size = 16", "batch-size (file {file}): must be in [32, 8192], got 16"),
        ([], {}, "slots = 4.5", "slots (file {file}): not an integer: 4.5"),
        ([], {}, 'log-level = "loud"', "log-level (file {file}): must be one of debug, info, warning, error"),
        ([], {}, "slotz = 4", "slotz (file {file}): no such setting"),
        ([], {}, "[tenants]\nslots = 4", "tenants (file {file}): no such setting"),
        ([], {}, "slots = ", "config: {file} is not valid TOML"),
        (["--slotz", "4"], {}, None, "No such option '--slotz'"),
        (["--store", "ftp://host/x"], {}, None, "store (flag --store): must be local, s3://BUCKET/PREFIX"),
        ([], {"KVKEEP_STORE": "s3://No_Such/x"}, None, "store (environment KVKEEP_STORE): the bucket of"),
    ],
)
def test_a_bad_setting_is_one_line_and_a_non_zero_exit(
    tmp_path: Path, args: list[str], env: dict[str, str], toml: str | None, line: str
) -> None:
    file = tmp_path / "kvkeep.toml"
    if toml is not None:
        file.write_text(toml + "\n")
        args = ["--config", str(file), *args]
    for run in (("--print-config", *args), args):  # checked before anything starts, either way
        result = kvkeep_serve(*run, "--state-dir", str(tmp_path / "state"), env=env)
        assert result.returncode == 2
        assert result.stdout == ""
        lines = result.stderr.splitlines()
        assert len(lines) == 1, result.stderr
        assert lines[0].startswith("error: " + line.format(file=file))
    assert not (tmp_path / "state").exists()


def test_print_config_hides_a_remote_stores_password() -> None:
    values, origins = printed(
        "--store", "redis://kv:hunter2@127.0.0.1:6379/0", "--s3-endpoint", "http://127.0.0.1:8333"
    )
    assert values["store"] == "redis://kv:***@127.0.0.1:6379/0"
    assert values["s3-endpoint"] == "http://127.0.0.1:8333"
    assert origins["store"] == "flag --store"


def test_a_missing_config_file_is_one_line(tmp_path: Path) -> None:
    result = kvkeep_serve("--config", str(tmp_path / "absent.toml"), "--print-config")
    assert result.returncode == 2
    assert (
        result.stderr == f"error: config: cannot read {tmp_path / 'absent.toml'}: No such file or directory\n"
    )


def test_settings_built_in_code_are_checked_as_the_command_line_is(tmp_path: Path) -> None:
    ok = config.Settings(model_path=model_path(), state_dir=tmp_path, threads=1)
    assert ok.validate() is ok
    for field, value, words in [
        ("slots", 0, "slots: must be in [1, 256]"),
        ("codec", "brotli", "codec: must be one of lz4, zstd, none"),
        ("sweep_interval", 0.0, "sweep-interval: must be in [0.05, 3600]"),
        ("tenant_quota", "sessions=x", "tenant-quota: takes"),
    ]:
        bad = config.Settings(model_path=model_path(), state_dir=tmp_path, **{field: value})  # type: ignore[arg-type]
        with pytest.raises(config.ConfigError) as e:
            bad.validate()
        assert str(e.value).startswith(words)


def test_the_store_key_is_a_secret_from_the_environment_or_a_file(tmp_path: Path) -> None:
    from kvkeepd.storage.storekey import store_key

    key = "ab" * 32
    values, origins = printed(env={"KVKEEP_STORE_KEY": key})
    assert values["store-key"] == "***" and origins["store-key"] == "environment KVKEEP_STORE_KEY"
    short = kvkeep_serve("--print-config", env={"KVKEEP_STORE_KEY": "ab" * 31})
    assert short.returncode == 2 and "64 hexadecimal digits" in short.stderr and "ab" * 31 not in short.stderr
    file = tmp_path / "key"
    file.write_bytes(os.urandom(32))
    both = kvkeep_serve("--print-config", "--store-key-file", str(file), env={"KVKEEP_STORE_KEY": key})
    assert both.returncode == 2 and "exclude each other" in both.stderr

    # Given by the settings, the key is never written to the state directory; one there
    # that differs is refused, since the directory's manifests are signed with it.
    state = tmp_path / "state"
    state.mkdir()
    given = store_key(state, text=key)
    assert given.key == bytes.fromhex(key) and not (state / "store.key").exists()
    assert key not in repr(given) and given.fingerprint in repr(given)
    assert store_key(state, file=file).key == file.read_bytes()
    other = tmp_path / "other"
    other.mkdir()
    own = store_key(other)  # none given: the state directory's, made now
    assert own.origin.endswith("store.key") and store_key(other).key == own.key
    with pytest.raises(OSError, match="holds another store key"):
        store_key(tmp_path / "other", text=key)
    (tmp_path / "bad").write_text("not a key")
    with pytest.raises(OSError, match="is not a store key"):
        store_key(state, file=tmp_path / "bad")


def test_host_and_ports_or_whole_addresses_say_where_the_doors_listen(tmp_path: Path) -> None:
    def listening(*args: str) -> tuple[str, str | None]:
        settings = resolution.resolve(_flags(*args), {}).settings
        return settings.grpc_listen, settings.http_listen

    assert listening() == ("127.0.0.1:50051", "127.0.0.1:8080")  # the HTTP door is on by default
    assert listening("--host", "localhost", "--port", "6000", "--http-port", "0") == (
        "localhost:6000",
        "localhost:0",
    )
    assert listening("--host", "::1") == ("[::1]:50051", "[::1]:8080")
    assert listening("--address", "unix:/run/kvkeep.sock", "--http", "off") == ("unix:/run/kvkeep.sock", None)
    assert listening("--address", "127.0.0.2:1", "--http", "127.0.0.3:2", "--port", "9") == (
        "127.0.0.2:1",
        "127.0.0.3:2",
    )


def _flags(*args: str) -> dict[str, object]:
    """The flags of `kvkeep serve ARGS` by field, as click gives them to resolution.resolve."""
    ctx = cli.serve.make_context("kvkeep serve", list(args))
    return {k: v for k, v in ctx.params.items() if k not in ("config_file", "print_config", "ready_file")}


def test_serve_help_shows_the_settings_in_sections_the_common_ones_first() -> None:
    text = kvkeep_serve("--help").stdout
    titles = [line.rstrip(":") for line in text.splitlines() if line and not line.startswith(" ")]
    assert titles[titles.index("Model and engine") :] == [
        "Model and engine",
        "Sessions and memory",
        "Storage",
        "Network and security",
        "Several daemons",
        "Logging, shutdown and debugging",
        "Other options",
    ]
    flags = [line.split()[0] for line in text.splitlines() if line.startswith("  --")]
    assert flags[:2] == ["--model", "--chat-template-file"]
    assert flags.index("--slots") < flags.index("--ram-cache") < flags.index("--state-dir")
    assert (
        flags.index("--host")
        < flags.index("--port")
        < flags.index("--http-port")
        < flags.index("--auth-file")
    )
    assert flags[-1] == "--help"

"""The README runs as printed: its quick start's commands and snippets, read from README.md
itself, against a daemon that `scripts/serve` starts on the embedded model.

Every `$ ` line of a `console` block runs, in order, in one bash shell (so `SESSION=...` is
there for the lines after it), in a directory whose `.venv` is this checkout's; `scripts/serve`
is the daemon they talk to (started with flags after it, as the README says flags go: free
ports, a state directory of the test's), and `scripts/test` runs a collection of this file.
Every `python` block runs with the venv's Python. The daemon's addresses reach them as a
reader's would: `$KVKEEP_ADDRESS` for gRPC, and the HTTP door's port in place of 8080.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from daemons import PROBE_CACHE, wait_until

import kvkeep

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
#: Each command's output is told apart by this line before it.
MARK = "::: command"


def blocks(language: str) -> list[str]:
    """The README's fenced blocks in `language`, in order."""
    return re.findall(rf"^```{language}\n(.*?)^```$", README.read_text(), flags=re.DOTALL | re.MULTILINE)


def commands() -> list[str]:
    """Every command of the README's console blocks, without its trailing comment."""
    found = []
    for block in blocks("console"):
        for line in block.splitlines():
            if line.startswith("$ "):
                found.append(re.sub(r"\s+# [^'\"]*$", "", line[2:]).strip())
    return found


@dataclass
class Served:
    grpc: str
    http: str
    log: Path


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """`scripts/serve`, as the README starts it, with the flags a test needs after it."""
    assert commands()[0] == "scripts/serve"
    tmp = tmp_path_factory.mktemp("readme-daemon")
    log = tmp / "daemon.log"
    flags = ["--port", "0", "--http-port", "0", "--state-dir", str(tmp / "state"), "--threads", "1"]
    flags += ["--probe-cache", str(PROBE_CACHE)]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(ROOT / "scripts" / "serve"), *flags], stdout=out, stderr=subprocess.STDOUT
        )
    try:

        def addresses() -> tuple[str, str] | None:
            if proc.poll() is not None:
                raise RuntimeError(f"scripts/serve exited with {proc.returncode}:\n{log.read_text()}")
            text = log.read_text()
            grpc = re.search(r"gRPC \(kvkeep CLI and SDK\) on (\S+)", text)
            http = re.search(r"OpenAI-compatible HTTP on http://(\S+)/v1", text)
            return (grpc[1], http[1]) if grpc and http else None

        grpc, http = wait_until(addresses, 120, "scripts/serve to listen")
        yield Served(grpc, http, log)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def workdir(tmp_path: Path) -> Path:
    """A directory of the reader's, with this checkout's .venv in it."""
    (tmp_path / ".venv").symlink_to(ROOT / ".venv")
    return tmp_path


def persistent_sessions(served: Served) -> set[str]:
    """The served daemon's persistent sessions: what an example leaves in the state directory
    that every clone's daemon shares by default."""
    with kvkeep.Client(served.grpc) as client:
        return {s.session_id for s in client.list_sessions() if s.persistent}


def reader_env(served: Served) -> dict[str, str]:
    return {**os.environ, "KVKEEP_ADDRESS": served.grpc}


def as_served(text: str, served: Served) -> str:
    """A README text with the HTTP door's address in place of its default."""
    return text.replace("127.0.0.1:8080", served.http)


def test_the_console_commands_run_as_printed(served: Served, tmp_path: Path) -> None:
    runnable = [c for c in commands() if not c.startswith(("scripts/serve", "scripts/test"))]
    assert len(runnable) >= 10
    kept_before = persistent_sessions(served)
    script = "set -euo pipefail\n" + "".join(
        # A newline first: an output need not end with one (curl's does not).
        f"printf '\\n{MARK} {i}\\n'; printf '\\n{MARK} {i}\\n' >&2\n{as_served(c, served)}\n"
        for i, c in enumerate(runnable)
    )
    started = time.monotonic()
    done = subprocess.run(
        ["bash", "-c", script],
        cwd=workdir(tmp_path),
        env=reader_env(served),
        capture_output=True,
        text=True,
        timeout=300,
    )
    took = time.monotonic() - started
    outputs = dict(
        zip(runnable, re.split(rf"^{MARK} \d+\n", done.stdout, flags=re.MULTILINE)[1:], strict=False)
    )
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    assert len(outputs) == len(runnable)
    assert "Traceback" not in done.stderr and "error:" not in done.stderr
    by_start = {
        c.split()[0] if not c.startswith(".venv") else " ".join(c.split()[:2]): out
        for c, out in outputs.items()
    }
    reply = json.loads(by_start["curl"])
    assert reply["object"] == "chat.completion" and reply["choices"][0]["message"]["content"]
    assert reply["usage"]["completion_tokens"] <= 16
    person = next(out for c, out in outputs.items() if "--json-schema" in c)
    assert isinstance(json.loads(person)["name"], str)
    shown = json.loads(
        next(out for c, out in outputs.items() if c.startswith(".venv/bin/kvkeep session show"))
    )
    assert shown["persistent"] and shown["n_checkpoints"] == 1
    # One conversation, restored to its first answer.
    assert [m["role"] for m in shown["messages"]] == ["system", "user", "assistant"]
    assert shown["messages"][1]["content"] == "Name three primes."
    restored = next(out for c, out in outputs.items() if "checkpoint restore" in c)
    assert restored.startswith(f"restored {shown['session_id']} to ")
    listed = next(out for c, out in outputs.items() if c.startswith(".venv/bin/kvkeep session list"))
    assert shown["session_id"] in listed and "AGE" in listed
    assert "--persistent-ttl" in done.stderr
    assert "engine: 4 slots x 2048 tokens" in by_start[".venv/bin/kvkeep info"]
    # Seconds, not minutes: every reply is capped.
    assert took < 120, f"the console commands took {took:.0f} s"
    assert persistent_sessions(served) == kept_before  # what they kept, they closed


@pytest.mark.parametrize("index", range(len(blocks("python"))))
def test_the_python_snippets_run_as_printed(served: Served, tmp_path: Path, index: int) -> None:
    code = as_served(blocks("python")[index], served)
    kept_before = persistent_sessions(served)
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=workdir(tmp_path),
        env=reader_env(served),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()
    assert time.monotonic() - started < 60
    assert persistent_sessions(served) == kept_before


def test_the_test_command_installs_the_servers_first(tmp_path: Path) -> None:
    assert "scripts/test" in commands()
    text = (ROOT / "scripts" / "test").read_text()
    assert "\nscripts/servers\n" in text  # which sets up, and installs what the tests start
    done = subprocess.run(
        [str(ROOT / "scripts" / "test"), "-n", "0", "--collect-only", "-q", str(Path(__file__))],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "test_the_console_commands_run_as_printed" in done.stdout


def test_the_test_command_says_why_each_skipped_test_was_skipped(tmp_path: Path) -> None:
    skipping = tmp_path / "test_skipping.py"
    skipping.write_text(
        "import pytest\n\n\n"
        "@pytest.mark.skip(reason='needs a GPU: none here')\n"
        "def test_on_a_gpu() -> None:\n    pass\n"
    )
    done = subprocess.run(
        [str(ROOT / "scripts" / "test"), "-n", "0", "-p", "no:cacheprovider", str(skipping)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"^SKIPPED \[1\] .*test_skipping\.py:\d+: needs a GPU: none here$", done.stdout, re.M), (
        done.stdout
    )


def test_the_readme_is_a_front_door() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 300
    first_screen = "\n".join(lines[:40])
    assert "scripts/serve" in first_screen and "curl" in first_screen and "8080" in first_screen
    # What the embedded model is for, and what to serve for tools and agents.
    assert "trying the plumbing" in first_screen
    assert re.search(
        r"^\$ scripts/serve --model hf:\S+/\S+-Instruct-GGUF:Q4_K_M --slots 2 --ctx-per-session ",
        first_screen,
        re.M,
    )


def test_the_start_log_names_the_model_by_its_file(served: Served) -> None:
    log = served.log.read_text()
    loading = re.search(r"loading the model (\S+) \(", log)
    assert loading, log
    model = Path(loading[1])
    assert model.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    line = next(line for line in log.splitlines() if " serving " in line)
    size = round(model.stat().st_size / (1 << 20))
    assert re.search(
        rf"serving {re.escape(model.name)} \({size} MiB, llama, fingerprint [0-9a-f]{{12}}\): ", line
    ), line

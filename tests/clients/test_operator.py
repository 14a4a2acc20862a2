"""What an operator sees of a daemon: every address it listens on, a line per request in the
access log (never a prompt), `kvkeep info` for people and `--json` for machines, and a chat
template given in a file."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import testmodels
from checkpoint_helpers import own_daemon
from click.testing import CliRunner
from daemons import GREEDY, DaemonProcess

import kvkeep
from kvkeep.cli import main

SECRET = "the walrus keeps its secrets"


def test_the_log_names_every_address_and_a_line_per_request_without_prompts(spawn_daemon: Any) -> None:
    d: DaemonProcess = spawn_daemon("--http", "127.0.0.1:0", "--metrics-address", "127.0.0.1:0")
    with kvkeep.Client(d.address, timeout=60) as client:
        info = client.info()
        assert re.fullmatch(r"127\.0\.0\.1:\d+", info.http_address)
        assert re.fullmatch(r"127\.0\.0\.1:\d+", info.metrics_address)
        session = client.create_session(sampling=GREEDY)
        session.chat(f"Say: {SECRET}.", max_tokens=3)
        session.close()
    reply = httpx.post(
        f"http://{info.http_address}/v1/chat/completions",
        json={"model": "any", "messages": [{"role": "user", "content": SECRET}], "max_tokens": 2},
        timeout=60,
    )
    assert reply.status_code == 200
    missing = httpx.post(f"http://{info.http_address}/v1/chat/completions", json={}, timeout=60)
    assert missing.status_code == 400
    sid = session.session_id
    expected = [
        r"grpc GetInfo tenant=- session=- tokens=- \d+\.\d{3}s OK",
        rf"grpc CreateSession tenant=- session={sid} tokens=- \d+\.\d{{3}}s OK",
        rf"grpc Chat tenant=- session={sid} tokens=\d+\+3 \d+\.\d{{3}}s OK",
        rf"grpc CloseSession tenant=- session={sid} tokens=- \d+\.\d{{3}}s OK",
        r"http POST /v1/chat/completions tenant=- session=s_\w+ tokens=\d+\+2 \d+\.\d{3}s 200",
        r"http POST /v1/chat/completions tenant=- session=- tokens=- \d+\.\d{3}s"
        r" 400 missing_required_parameter",  # a refusal ends with its reason code
    ]
    marker = "kvkeepd.access: "
    # A request's line is written once its reply has gone, so the client may read the log first.
    deadline = time.monotonic() + 10
    while True:
        log = d.log()
        access = [line.split(marker, 1)[1] for line in log.splitlines() if marker in line]
        if len(access) >= len(expected) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert f"gRPC (kvkeep CLI and SDK) on {d.address}" in log
    assert f"OpenAI-compatible HTTP on http://{info.http_address}/v1 (health: /health)" in log
    assert f"Prometheus metrics on http://{info.metrics_address}/metrics" in log
    assert len(access) == len(expected), access
    for line, pattern in zip(access, expected, strict=True):
        assert re.fullmatch(pattern, line), line
    assert "walrus" not in log


def test_info_reads_as_lines_about_one_thing_each_and_json_has_every_field(daemon_address: str) -> None:
    text = CliRunner().invoke(main, ["info", "--address", daemon_address])
    assert text.exit_code == 0, text.output
    fields = dict(line.split(": ", 1) for line in text.stdout.splitlines())
    assert list(fields) == [
        "daemon",
        "model",
        "memory",
        "chat template",
        "mode",
        "engine",
        "HTTP (OpenAI)",
        "metrics",
        "sessions",
        "tokens",
        "limits",
    ]
    assert fields["daemon"].endswith(f" at {daemon_address}")
    assert fields["mode"] == "exact"
    engine = "4 slots x 1024 tokens, KV f16, flash attention (batch-invariant), on "
    assert fields["engine"].startswith(engine)
    assert fields["HTTP (OpenAI)"] == "off"  # the tests' shared daemon has no HTTP door
    as_json = json.loads(CliRunner().invoke(main, ["info", "--json", "--address", daemon_address]).stdout)
    assert as_json["slots"] == 4 and as_json["http_address"] == "" and "tokens_generated" in as_json


def test_a_chat_template_file_gives_a_model_without_one_its_chat(tmp_path: Path) -> None:
    template = tmp_path / "chat.jinja"
    template.write_text(
        "{% for m in messages %}<start_of_turn>{{ 'model' if m.role == 'assistant' else 'user' }}\n"
        "{{ m.content }}<end_of_turn>\n{% endfor %}"
        "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
    )
    gemma = testmodels.gemma3_270m()
    with (
        own_daemon(
            tmp_path / "s", model=gemma, slots=1, ctx_per_session=512, chat_template_file=template
        ) as d,
        kvkeep.Client(d.address, timeout=60) as client,
    ):
        assert client.info().has_chat_template  # Gemma 3 270M (a base model) ships none
        chatting = client.create_session(sampling=GREEDY)
        reply = chatting.chat("Hello", max_tokens=4)
        # The same as completing the text the file's template renders.
        completing = client.create_session(sampling=GREEDY)
        rendered = "<start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\n"
        same = completing.complete(rendered, max_tokens=4, parse_special=True)
        assert reply.token_ids == same.token_ids
        assert reply.usage.prompt_tokens == same.usage.prompt_tokens
        chatting.close()
        completing.close()


def test_a_chat_template_file_that_is_not_jinja_is_one_line(tmp_path: Path, spawn_daemon: Any) -> None:
    template = tmp_path / "broken.jinja"
    template.write_text("{% for m in messages %}no end")
    d: DaemonProcess = spawn_daemon("--chat-template-file", str(template), start=False)
    with pytest.raises(RuntimeError, match="exited with status 2"):
        d.start()
    last = d.log().splitlines()[-1]
    assert last.startswith("error: chat-template-file: not a Jinja template: ")


def test_a_reply_without_max_tokens_stops_at_the_daemons_default(tmp_path: Path) -> None:
    with (
        own_daemon(tmp_path / "s", default_max_tokens=8) as d,
        kvkeep.Client(d.address, timeout=60) as client,
    ):
        session = client.create_session(sampling=GREEDY)
        counting = "Count from 1 to 2000: 1, 2, 3,"
        capped = session.chat(counting)
        assert (capped.finish_reason, len(capped.token_ids)) == ("length", 8)
        session.close()
        # A request's own max_tokens wins (the same prompt, in a session of its own).
        session = client.create_session(sampling=GREEDY)
        asked = session.chat(counting, max_tokens=12)
        assert asked.token_ids[:8] == capped.token_ids
        assert len(asked.token_ids) > 8
        session.close()

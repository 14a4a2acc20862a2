"""docs/http.md's OpenAI examples run as printed: each ```python block that imports openai
runs, with this checkout's Python, against the daemon `scripts/serve` starts (test_readme's
fixture), the HTTP door's address in place of 127.0.0.1:8080. Every reply in them is capped,
so each runs in seconds."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_readme import Served, as_served, reader_env, served, workdir  # noqa: F401  (fixture)

HTTP_MD = Path(__file__).resolve().parent.parent / "docs" / "http.md"


def openai_blocks() -> list[str]:
    found = re.findall(r"^```python\n(.*?)^```$", HTTP_MD.read_text(), flags=re.DOTALL | re.MULTILINE)
    return [b for b in found if "from openai import OpenAI" in b]


def test_the_chat_tools_and_responses_examples_are_there() -> None:
    blocks = openai_blocks()
    assert len(blocks) >= 3
    assert any("tool_calls" in b for b in blocks) and any("client.responses" in b for b in blocks)
    for block in blocks:
        calls = re.findall(r"\.(?:create|stream)\((.*?)\)(?:\s|$|\.| as)", block, flags=re.DOTALL)
        assert calls and all("max_tokens" in c or "max_output_tokens" in c for c in calls), block


@pytest.mark.parametrize("index", range(len(openai_blocks())))
def test_the_openai_examples_run_as_printed(served: Served, tmp_path: Path, index: int) -> None:  # noqa: F811
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", as_served(openai_blocks()[index], served)],
        cwd=workdir(tmp_path),
        env=reader_env(served),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - started < 90

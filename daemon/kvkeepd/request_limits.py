"""Bounds on what a request, or a checkpoint from elsewhere, may hold: one place for both,
so an import is checked as strictly as the RPCs that could have made it."""

from __future__ import annotations

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
MAX_LABEL = 256
# A message's content, in characters (a gRPC message is at most 256 MiB anyway).
MAX_MESSAGE_CHARS = 1 << 24
MAX_MESSAGES = 1 << 16
# CPU seconds a chat template may take to render one conversation (a template runs in a
# worker thread; past this it is stopped, and the request refused).
RENDER_SECONDS = 5.0
MIN_BLOCK_TOKENS = 16
MAX_BLOCK_TOKENS = 128
# Imports received at once (each spooled to a temporary file), and checked at once (each
# holding one state in memory while it is parsed).
MAX_IMPORTS = 4
IMPORTS_CHECKED = 1
# RPCs served at once, and streams on one connection; beyond, RESOURCE_EXHAUSTED.
MAX_CONCURRENT_RPCS = 1024
MAX_STREAMS_PER_CONNECTION = 128
# A request's grammar or JSON schema, in characters (its compile time is bounded by the
# grammar engine's own limits).
MAX_GRAMMAR_CHARS = 1 << 16
# Tools a request may give, and calls one message may hold (OpenAI's API takes 128 tools).
MAX_TOOLS = 128
MAX_TOOL_CALLS = 64
# The grammar of a turn's tool calls: every tool's parameters and a few lines per tool.
MAX_TOOL_GRAMMAR_CHARS = 2 * MAX_GRAMMAR_CHARS

"""Logging, configured in one place: text or JSON lines on stderr.

A message is one line whatever it quotes: what a client sent (a request's path, a session id,
a model's name, an error's text) may hold line breaks and terminal escapes, which are written
as escapes instead (`escaped`: a line feed as the four characters `\\x0a`), so that no request
can forge a line of the log.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time

# C0 and C1 controls (line breaks, ESC...), Unicode's line and paragraph separators, and its
# bidirectional overrides and isolates (which reorder what a terminal shows).
_CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def escaped(text: str) -> str:
    """`text` with its control characters written as escapes (a line feed as `\\x0a`, U+2028
    as `\\u2028`): one printable line."""
    return _CONTROLS.sub(_escape, text)


def _escape(m: re.Match[str]) -> str:
    code = ord(m[0])
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


class TextFormatter(logging.Formatter):
    """`time LEVEL logger: message`, the message escaped (a traceback follows on lines of its own)."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = escaped(record.message)
        return super().formatMessage(record)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            # Escaped as the text format's is, for whoever prints the field of a line.
            "message": escaped(record.getMessage()),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


class LateAnswerFilter(logging.Filter):
    """gRPC logs an ERROR with a traceback when a handler answers a call whose client has
    just gone (its deadline passed as the answer was sent). The work was done; nobody was
    there to hear. That is routine under client deadlines: it goes to DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and "ExecuteBatchError" in record.getMessage():
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            record.exc_info = None
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


class UvicornFilter(logging.Filter):
    """uvicorn's own lines under the HTTP door's name: its start-up chatter (which the door's
    own line says better) only at debug, its warnings and errors as the door's."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.name = "kvkeepd.api.http.uvicorn"
        return record.levelno >= logging.WARNING or logging.getLogger().isEnabledFor(logging.DEBUG)


def configure(level: str, as_json: bool) -> None:
    """Send all logs to stderr at `level`; llama.cpp's own chatter only shows at debug."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if as_json else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("kvkeepd.llama_cpp").setLevel(logging.DEBUG if level == "debug" else logging.WARNING)
    logging.getLogger("grpc._cython.cygrpc").addFilter(LateAnswerFilter())
    logging.getLogger("uvicorn.error").addFilter(UvicornFilter())
    # huggingface_hub's HTTP client logs every request at INFO (a model's download is named
    # by kvkeepd.model.hub's own lines).
    for name in ("httpx", "httpx2"):
        logging.getLogger(name).setLevel(logging.DEBUG if level == "debug" else logging.WARNING)

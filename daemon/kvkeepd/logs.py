"""Logging, configured in one place: text or JSON lines on stderr."""

from __future__ import annotations

import json
import logging
import sys
import time


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
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
    handler.setFormatter(
        JsonFormatter() if as_json else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("kvkeepd.llama_cpp").setLevel(logging.DEBUG if level == "debug" else logging.WARNING)
    logging.getLogger("grpc._cython.cygrpc").addFilter(LateAnswerFilter())
    logging.getLogger("uvicorn.error").addFilter(UvicornFilter())
    # huggingface_hub's HTTP client logs every request at INFO (a model's download is named
    # by kvkeepd.hub's own lines).
    for name in ("httpx", "httpx2"):
        logging.getLogger(name).setLevel(logging.DEBUG if level == "debug" else logging.WARNING)

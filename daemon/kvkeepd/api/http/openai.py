"""What OpenAI's APIs on the HTTP door write alike: the error envelope and each error's
status, and the engine's finish reasons as OpenAI names them."""

from __future__ import annotations

from typing import Any

from kvkeepd.errors import InvalidRequest, KvkeepError

# The engine's finish reasons as OpenAI names them.
FINISH = {
    "eos": "stop",
    "stop": "stop",
    "length": "length",
    "context_full": "length",
    "cancelled": "stop",
    "tool_calls": "tool_calls",
}

# Each error class's HTTP status, OpenAI error type and code (docs/errors.md).
STATUS = {
    "INVALID_ARGUMENT": (400, "invalid_request_error", "invalid_value"),
    "OUT_OF_RANGE": (400, "invalid_request_error", "context_length_exceeded"),
    "UNAUTHENTICATED": (401, "authentication_error", "invalid_api_key"),
    "NOT_FOUND": (404, "not_found_error", "not_found"),
    "ALREADY_EXISTS": (409, "conflict_error", "conflict"),
    "FAILED_PRECONDITION": (409, "conflict_error", "conflict"),
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error", "rate_limit_exceeded"),
    "DATA_LOSS": (500, "server_error", "server_error"),
    "INTERNAL": (500, "server_error", "server_error"),
    "UNAVAILABLE": (503, "service_unavailable", "service_unavailable"),
}
INTERNAL_MESSAGE = "internal error (see the daemon's log)"


def error(kind: str, message: str, code: str = "", param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code or kind}}


def domain_error(e: KvkeepError, prompt: str = "messages") -> tuple[int, dict[str, Any]]:
    """The status and body of a domain error; a bare KvkeepError says nothing of itself.
    `code` is specific (`context_length_exceeded`...); errors that share a status name their
    cause in it (`no-chat-template`...), as gRPC's `kvkeep-error` metadata does. `param` is
    the request's field at fault where the error knows it (`prompt`: the field a full
    context blames, `messages` or `prompt`)."""
    status, kind, code = STATUS.get(e.code, STATUS["INTERNAL"])
    message = INTERNAL_MESSAGE if type(e) is KvkeepError else str(e)
    param = e.field or None if isinstance(e, InvalidRequest) else prompt if e.code == "OUT_OF_RANGE" else None
    return status, error(kind, message, e.cause or code, param)

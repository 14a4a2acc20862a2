"""The errors kvstash raises, one class per gRPC status the daemon uses.

::

    KvstashError                      .code: the gRPC status name
    ├── InvalidRequestError           INVALID_ARGUMENT
    ├── NotFoundError                 NOT_FOUND
    ├── AlreadyExistsError            ALREADY_EXISTS
    ├── ContextFullError              OUT_OF_RANGE
    ├── BusyError                     RESOURCE_EXHAUSTED
    ├── IncompatibleCheckpointError   FAILED_PRECONDITION
    ├── CorruptCheckpointError        DATA_LOSS
    ├── AuthError                     UNAUTHENTICATED
    ├── UnavailableError              UNAVAILABLE, DEADLINE_EXCEEDED
    └── InternalError                 INTERNAL, and any other status
"""

from __future__ import annotations

import grpc


class KvstashError(Exception):
    """Base of every error kvstash raises; ``code`` names the gRPC status behind it."""

    code: str = "UNKNOWN"

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code


class InvalidRequestError(KvstashError):
    """The request was malformed or its arguments are out of bounds."""

    code = "INVALID_ARGUMENT"


class NotFoundError(KvstashError):
    """No session or checkpoint has that id."""

    code = "NOT_FOUND"


class AlreadyExistsError(KvstashError):
    """The object being created exists already."""

    code = "ALREADY_EXISTS"


class ContextFullError(KvstashError):
    """The prompt does not fit in the session's context."""

    code = "OUT_OF_RANGE"


class BusyError(KvstashError):
    """The daemon is out of a resource (slots, memory, a session busy generating)."""

    code = "RESOURCE_EXHAUSTED"


class IncompatibleCheckpointError(KvstashError):
    """The state cannot be used as asked, e.g. a checkpoint made with another model."""

    code = "FAILED_PRECONDITION"


class CorruptCheckpointError(KvstashError):
    """Checkpoint data failed its integrity checks."""

    code = "DATA_LOSS"


class AuthError(KvstashError):
    """The daemon refused the caller's credentials."""

    code = "UNAUTHENTICATED"


class UnavailableError(KvstashError):
    """The daemon could not be reached, or did not answer in time."""

    code = "UNAVAILABLE"


class InternalError(KvstashError):
    """The daemon failed, or answered with a status kvstash does not expect."""

    code = "INTERNAL"


_BY_STATUS: dict[grpc.StatusCode, type[KvstashError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequestError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExistsError,
    grpc.StatusCode.OUT_OF_RANGE: ContextFullError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: BusyError,
    grpc.StatusCode.FAILED_PRECONDITION: IncompatibleCheckpointError,
    grpc.StatusCode.DATA_LOSS: CorruptCheckpointError,
    grpc.StatusCode.UNAUTHENTICATED: AuthError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: UnavailableError,
}


def from_rpc_error(e: grpc.RpcError) -> KvstashError:
    """The KvstashError for a failed call; raise it with ``from None``."""
    # Not every RpcError is a grpc.Call (e.g. one raised by an interceptor), so code() may be
    # missing at run time whatever the stubs say.
    status = e.code() if callable(getattr(e, "code", None)) else grpc.StatusCode.UNKNOWN
    details = e.details() if callable(getattr(e, "details", None)) else None
    cls = _BY_STATUS.get(status, InternalError)
    return cls(details or status.name, code=status.name)

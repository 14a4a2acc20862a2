"""The errors kvkeep raises: one class per gRPC status the daemon uses, and a subclass per
cause where causes share a status (the daemon names the cause in the trailing metadata
``kvkeep-error``).

::

    KvkeepError                      .code: the gRPC status name; .cause: the daemon's cause
    ├── InvalidRequestError           INVALID_ARGUMENT
    ├── NotFoundError                 NOT_FOUND
    ├── AlreadyExistsError            ALREADY_EXISTS
    ├── ContextFullError              OUT_OF_RANGE
    ├── BusyError                     RESOURCE_EXHAUSTED
    │   └── StoreWriteError               store-write-failed
    ├── FailedPreconditionError       FAILED_PRECONDITION
    │   ├── IncompatibleCheckpointError   incompatible-checkpoint
    │   ├── NoChatTemplateError           no-chat-template
    │   └── CheckpointInUseError          checkpoint-in-use
    ├── CorruptCheckpointError        DATA_LOSS
    ├── AuthError                     UNAUTHENTICATED
    ├── UnavailableError              UNAVAILABLE, DEADLINE_EXCEEDED
    │   ├── StoreReadError                store-read-failed
    │   ├── StoreUnreachableError         store-unreachable
    │   ├── CatalogUnavailableError       catalog-unavailable
    │   └── SessionElsewhereError         session-elsewhere (.retry_after: seconds)
    └── InternalError                 INTERNAL (cause internal: the daemon's own), and any other status
"""

from __future__ import annotations

import grpc

#: The trailing-metadata key under which the daemon names an error's cause.
CAUSE_KEY = "kvkeep-error"
#: The trailing-metadata key of the daemon's retry hint, in milliseconds.
RETRY_KEY = "kvkeep-retry-after-ms"
#: The cause the daemon names for an internal error of its own.
INTERNAL_CAUSE = "internal"


class KvkeepError(Exception):
    """Base of every error kvkeep raises; ``code`` names the gRPC status behind it, ``cause``
    what the daemon said went wrong where several causes share that status ("" if none)."""

    code: str = "UNKNOWN"
    cause: str = ""
    #: Seconds after which the daemon says trying again may work (None: no hint).
    retry_after: float | None = None

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code


class InvalidRequestError(KvkeepError):
    """The request was malformed or its arguments are out of bounds."""

    code = "INVALID_ARGUMENT"


class NotFoundError(KvkeepError):
    """No session or checkpoint has that id."""

    code = "NOT_FOUND"


class AlreadyExistsError(KvkeepError):
    """The object being created exists already."""

    code = "ALREADY_EXISTS"


class ContextFullError(KvkeepError):
    """The prompt does not fit in the session's context."""

    code = "OUT_OF_RANGE"


class BusyError(KvkeepError):
    """The daemon is out of a resource (slots, memory, a quota, disk); try again later."""

    code = "RESOURCE_EXHAUSTED"


class StoreWriteError(BusyError):
    """The daemon's state store refused a write (disk full?): nothing was saved."""

    cause = "store-write-failed"


class FailedPreconditionError(KvkeepError):
    """The daemon cannot do this in its present state; a subclass says why."""

    code = "FAILED_PRECONDITION"


class IncompatibleCheckpointError(FailedPreconditionError):
    """A checkpoint made with another model or manifest format."""

    cause = "incompatible-checkpoint"


class NoChatTemplateError(FailedPreconditionError):
    """The daemon's model has no chat template: use completions, not chat."""

    cause = "no-chat-template"


class CheckpointInUseError(FailedPreconditionError):
    """The checkpoint is a live session's head; close the session to delete it."""

    cause = "checkpoint-in-use"


class CorruptCheckpointError(KvkeepError):
    """Checkpoint data failed its integrity checks."""

    code = "DATA_LOSS"


class AuthError(KvkeepError):
    """The daemon refused the caller's credentials."""

    code = "UNAUTHENTICATED"


class UnavailableError(KvkeepError):
    """The daemon could not be reached, or did not answer in time."""

    code = "UNAVAILABLE"


class StoreReadError(UnavailableError):
    """The daemon's state store could not be read (an I/O error); try again later."""

    cause = "store-read-failed"


class StoreUnreachableError(UnavailableError):
    """The daemon's remote block store (S3, Redis) did not take a write: nothing was
    saved; try again once it is back."""

    cause = "store-unreachable"


class CatalogUnavailableError(UnavailableError):
    """The daemons' shared catalog server could not be reached; nothing was changed. Try
    again: the daemon reconnects by itself."""

    cause = "catalog-unavailable"


class SessionElsewhereError(UnavailableError):
    """Another daemon holds the session (it is advancing it, or took it over); try again
    after ``retry_after`` seconds, here or where the session's requests are routed."""

    cause = "session-elsewhere"


class InternalError(KvkeepError):
    """The daemon failed (``cause`` ``"internal"``), or answered with a status kvkeep does
    not expect; without a cause, gRPC itself reported a broken connection so (a proxy that
    cut a stream short)."""

    code = "INTERNAL"


_BY_STATUS: dict[grpc.StatusCode, type[KvkeepError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequestError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExistsError,
    grpc.StatusCode.OUT_OF_RANGE: ContextFullError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: BusyError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    grpc.StatusCode.DATA_LOSS: CorruptCheckpointError,
    grpc.StatusCode.UNAUTHENTICATED: AuthError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: UnavailableError,
}
_BY_CAUSE: dict[str, type[KvkeepError]] = {
    cls.cause: cls
    for cls in (
        StoreWriteError,
        IncompatibleCheckpointError,
        NoChatTemplateError,
        CheckpointInUseError,
        StoreReadError,
        StoreUnreachableError,
        CatalogUnavailableError,
        SessionElsewhereError,
    )
}


def _trailing(e: grpc.RpcError, wanted: str) -> str:
    """A value of the call's trailing metadata ("" if absent)."""
    trailing = getattr(e, "trailing_metadata", None)
    metadata = trailing() if callable(trailing) else None
    for key, value in metadata or ():
        if key == wanted:
            return value if isinstance(value, str) else value.decode(errors="replace")
    return ""


def _cause(e: grpc.RpcError) -> str:
    """The cause the daemon named in the call's trailing metadata ("" if none)."""
    return _trailing(e, CAUSE_KEY)


def from_rpc_error(e: grpc.RpcError) -> KvkeepError:
    """The KvkeepError for a failed call; raise it with ``from None``."""
    # Not every RpcError is a grpc.Call (e.g. one raised by an interceptor), so code() may be
    # missing at run time whatever the stubs say.
    status = e.code() if callable(getattr(e, "code", None)) else grpc.StatusCode.UNKNOWN
    details = e.details() if callable(getattr(e, "details", None)) else None
    cls = _BY_STATUS.get(status, InternalError)
    by_cause = _BY_CAUSE.get(_cause(e))
    # A cause counts only with its own status: a class never stands for another status.
    if by_cause is not None and issubclass(by_cause, cls):
        cls = by_cause
    error = cls(details or status.name, code=status.name)
    if not error.cause:
        error.cause = _cause(e)
    hint = _trailing(e, RETRY_KEY)
    if hint.isdigit():
        error.retry_after = int(hint) / 1000
    return error

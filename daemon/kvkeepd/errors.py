"""The daemon's exception tree; each class names the gRPC status it maps to, and the classes
that share a status with others name their cause, sent as trailing metadata (CAUSE_KEY), so
that each error means one thing to a client.

    KvkeepError                      INTERNAL, cause internal (generic message; details in the log)
    ├── InvalidRequest                INVALID_ARGUMENT
    ├── NotFound                      NOT_FOUND
    ├── AlreadyExists                 ALREADY_EXISTS
    ├── ContextFull                   OUT_OF_RANGE
    ├── Busy                          RESOURCE_EXHAUSTED
    │   └── StoreWriteFailed              cause store-write-failed
    ├── FailedPrecondition            FAILED_PRECONDITION
    │   ├── IncompatibleCheckpoint        cause incompatible-checkpoint
    │   ├── NoChatTemplate                cause no-chat-template
    │   └── CheckpointInUse               cause checkpoint-in-use
    ├── CorruptCheckpoint             DATA_LOSS
    ├── Unauthenticated               UNAUTHENTICATED
    └── Unavailable                   UNAVAILABLE
        ├── StoreReadFailed               cause store-read-failed
        ├── StoreUnreachable              cause store-unreachable
        │   └── StaleClaim                    (the same cause)
        ├── CatalogUnavailable            cause catalog-unavailable
        └── SessionElsewhere              cause session-elsewhere (+ a retry hint)

Only service.py turns these into gRPC statuses (by the `code` name), so this module
does not import grpc.
"""

#: The trailing-metadata key that carries an error's `cause`.
CAUSE_KEY = "kvkeep-error"
#: The cause of an INTERNAL error the daemon raised itself (gRPC reports some broken
#: connections as INTERNAL: those carry no cause).
INTERNAL_CAUSE = "internal"
#: The trailing-metadata key of a retry hint: milliseconds after which trying again may work.
RETRY_KEY = "kvkeep-retry-after-ms"


class KvkeepError(Exception):
    """Base class. Its message is shown to clients, so it must not leak internals."""

    code = "INTERNAL"
    #: What went wrong, for errors whose status other errors share ("" for none).
    cause = ""
    #: When trying again may work, in milliseconds (0: no hint).
    retry_after_ms = 0


class InvalidRequest(KvkeepError):
    code = "INVALID_ARGUMENT"

    def __init__(self, message: str = "", field: str = "") -> None:
        super().__init__(message)
        #: The request's field at fault, where one is (the HTTP door's `param`).
        self.field = field


class NotFound(KvkeepError):
    code = "NOT_FOUND"


class AlreadyExists(KvkeepError):
    code = "ALREADY_EXISTS"


class ContextFull(KvkeepError):
    code = "OUT_OF_RANGE"


class Busy(KvkeepError):
    code = "RESOURCE_EXHAUSTED"


class StoreWriteFailed(Busy):
    """The state store refused a write (disk full, I/O error): nothing was saved."""

    cause = "store-write-failed"


class FailedPrecondition(KvkeepError):
    code = "FAILED_PRECONDITION"


class IncompatibleCheckpoint(FailedPrecondition):
    """A checkpoint from another model, KV layout or format version."""

    cause = "incompatible-checkpoint"


class NoChatTemplate(FailedPrecondition):
    """Chat asked of a model whose GGUF carries no chat template."""

    cause = "no-chat-template"


class CheckpointInUse(FailedPrecondition):
    """Deleting a checkpoint that a live session's state depends on (its head)."""

    cause = "checkpoint-in-use"


class CorruptCheckpoint(KvkeepError):
    code = "DATA_LOSS"


class Unauthenticated(KvkeepError):
    code = "UNAUTHENTICATED"


class Unavailable(KvkeepError):
    code = "UNAVAILABLE"


class StoreReadFailed(Unavailable):
    """The state store could not be read (an I/O error, a file that cannot be opened); the
    data may be intact, so this is not corruption."""

    cause = "store-read-failed"


class StoreUnreachable(Unavailable):
    """A remote block store (S3, Redis) refused a write or did not answer in time (the
    server down, a timeout, an error of its own) after the bounded retries: nothing was
    saved. It may well answer again soon, so this is not RESOURCE_EXHAUSTED."""

    cause = "store-unreachable"


class StaleClaim(StoreUnreachable):
    """A save took longer than the orphan collector's grace period, so its blocks may have
    been taken for a crashed save's and collected: nothing was saved; try again."""


class CatalogUnavailable(Unavailable):
    """The shared catalog's server cannot be reached (or did not answer in time): nothing
    that needed it was done; it is tried again on the next request."""

    cause = "catalog-unavailable"


class SessionElsewhere(Unavailable):
    """Another daemon holds the session's lease (it is advancing the session), or took it
    from this one; retry after `retry_after_ms`, when the lease may have lapsed."""

    cause = "session-elsewhere"

    def __init__(self, message: str, retry_after_ms: int = 0) -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


def noted(error: KvkeepError, note: str) -> KvkeepError:
    """`error` with `note` after its message, its class and what it carries (a retry hint,
    a field) kept."""
    error.args = (f"{error}; {note}",)
    return error

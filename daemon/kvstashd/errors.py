"""The daemon's exception tree; each class names the gRPC status it maps to.

    KvstashError                      INTERNAL (generic message; details in the log)
    ├── InvalidRequest                INVALID_ARGUMENT
    ├── NotFound                      NOT_FOUND
    ├── AlreadyExists                 ALREADY_EXISTS
    ├── ContextFull                   OUT_OF_RANGE
    ├── Busy                          RESOURCE_EXHAUSTED
    ├── FailedPrecondition            FAILED_PRECONDITION
    │   └── IncompatibleCheckpoint
    ├── CorruptCheckpoint             DATA_LOSS
    ├── Unauthenticated               UNAUTHENTICATED
    └── Unavailable                   UNAVAILABLE

Only service.py turns these into gRPC statuses (by the `code` name), so this module
does not import grpc.
"""


class KvstashError(Exception):
    """Base class. Its message is shown to clients, so it must not leak internals."""

    code = "INTERNAL"


class InvalidRequest(KvstashError):
    code = "INVALID_ARGUMENT"


class NotFound(KvstashError):
    code = "NOT_FOUND"


class AlreadyExists(KvstashError):
    code = "ALREADY_EXISTS"


class ContextFull(KvstashError):
    code = "OUT_OF_RANGE"


class Busy(KvstashError):
    code = "RESOURCE_EXHAUSTED"


class FailedPrecondition(KvstashError):
    code = "FAILED_PRECONDITION"


class IncompatibleCheckpoint(FailedPrecondition):
    """A checkpoint from another model, KV layout or format version."""


class CorruptCheckpoint(KvstashError):
    code = "DATA_LOSS"


class Unauthenticated(KvstashError):
    code = "UNAUTHENTICATED"


class Unavailable(KvstashError):
    code = "UNAVAILABLE"

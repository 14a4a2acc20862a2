"""kvstash: one llama.cpp model, many chat sessions over gRPC, with session checkpoints.

Client and Session talk to the daemon synchronously, AsyncClient and AsyncSession with
asyncio. Every failed call raises a KvstashError subclass.
"""

from importlib.metadata import PackageNotFoundError, version

from kvstash._async_client import AsyncClient, AsyncSession
from kvstash._client import Client, Session
from kvstash._connection import Tls
from kvstash._errors import (
    AlreadyExistsError,
    AuthError,
    BusyError,
    CatalogUnavailableError,
    CheckpointInUseError,
    ContextFullError,
    CorruptCheckpointError,
    FailedPreconditionError,
    IncompatibleCheckpointError,
    InternalError,
    InvalidRequestError,
    KvstashError,
    NoChatTemplateError,
    NotFoundError,
    SessionElsewhereError,
    StoreReadError,
    StoreUnreachableError,
    StoreWriteError,
    UnavailableError,
)
from kvstash._types import (
    CheckpointInfo,
    Chunk,
    Completion,
    GeneratedToken,
    Info,
    Message,
    SamplingParams,
    SessionInfo,
    TokenLogprob,
    Usage,
)

try:
    __version__ = version("kvstash")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0+unknown"

__all__ = [
    "AlreadyExistsError",
    "AsyncClient",
    "AsyncSession",
    "AuthError",
    "BusyError",
    "CatalogUnavailableError",
    "CheckpointInUseError",
    "CheckpointInfo",
    "Chunk",
    "Client",
    "Completion",
    "ContextFullError",
    "CorruptCheckpointError",
    "FailedPreconditionError",
    "GeneratedToken",
    "IncompatibleCheckpointError",
    "Info",
    "InternalError",
    "InvalidRequestError",
    "KvstashError",
    "Message",
    "NoChatTemplateError",
    "NotFoundError",
    "SamplingParams",
    "Session",
    "SessionElsewhereError",
    "SessionInfo",
    "StoreReadError",
    "StoreUnreachableError",
    "StoreWriteError",
    "Tls",
    "TokenLogprob",
    "UnavailableError",
    "Usage",
    "__version__",
]

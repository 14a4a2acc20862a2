"""kvkeep: one llama.cpp model, many chat sessions over gRPC, with session checkpoints.

Client and Session talk to the daemon synchronously, AsyncClient and AsyncSession with
asyncio. Every failed call raises a KvkeepError subclass.
"""

from importlib.metadata import PackageNotFoundError, version

from kvkeep._async_client import AsyncClient, AsyncSession
from kvkeep._client import Client, Session
from kvkeep._connection import Tls
from kvkeep._errors import (
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
    KvkeepError,
    NoChatTemplateError,
    NotFoundError,
    SessionElsewhereError,
    StoreReadError,
    StoreUnreachableError,
    StoreWriteError,
    UnavailableError,
)
from kvkeep._retry import Retry
from kvkeep._types import (
    CheckpointInfo,
    Chunk,
    Completion,
    GeneratedToken,
    Info,
    Message,
    PromptProgress,
    ResponseInfo,
    ResponsePage,
    SamplingParams,
    SessionInfo,
    TokenLogprob,
    Tool,
    ToolCall,
    ToolCallDelta,
    Usage,
)

try:
    __version__ = version("kvkeep")
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
    "KvkeepError",
    "Message",
    "NoChatTemplateError",
    "NotFoundError",
    "PromptProgress",
    "ResponseInfo",
    "ResponsePage",
    "Retry",
    "SamplingParams",
    "Session",
    "SessionElsewhereError",
    "SessionInfo",
    "StoreReadError",
    "StoreUnreachableError",
    "StoreWriteError",
    "Tls",
    "TokenLogprob",
    "Tool",
    "ToolCall",
    "ToolCallDelta",
    "UnavailableError",
    "Usage",
    "__version__",
]

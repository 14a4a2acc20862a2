"""How a client reaches the daemon: the channel (plain or TLS) and the bearer token."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc import aio

DEFAULT_ADDRESS = "127.0.0.1:50051"
_MAX_MESSAGE_BYTES = 64 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
]

Metadata = tuple[tuple[str, str], ...]

#: The metadata key naming the session a call is about; a proxy routes by it.
SESSION_HEADER = "x-kvkeep-session"
_ROUTABLE_ID = re.compile(r"[!-~]{1,128}")


@dataclass(frozen=True)
class Tls:
    """TLS to the daemon. ``ca_file``: the CA that signed the daemon's certificate (None:
    the system's roots); ``cert_file`` and ``key_file``: this client's certificate and key,
    for a daemon that requires them (mutual TLS); ``server_name``: the name to check the
    daemon's certificate against, when it is not the address's host. Files are PEM."""

    ca_file: str | Path | None = None
    cert_file: str | Path | None = None
    key_file: str | Path | None = None
    server_name: str | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        def read(path: str | Path | None) -> bytes | None:
            return Path(path).read_bytes() if path is not None else None

        return grpc.ssl_channel_credentials(
            root_certificates=read(self.ca_file),
            private_key=read(self.key_file),
            certificate_chain=read(self.cert_file),
        )

    def options(self) -> list[tuple[str, str | int]]:
        extra: list[tuple[str, str | int]] = []
        if self.server_name:
            extra.append(("grpc.ssl_target_name_override", self.server_name))
        return [*CHANNEL_OPTIONS, *extra]


def resolve_address(address: str | None) -> str:
    """``address``, else ``$KVKEEP_ADDRESS``, else the daemon's default address."""
    return address or os.environ.get("KVKEEP_ADDRESS") or DEFAULT_ADDRESS


def auth_metadata(token: str | None) -> Metadata:
    """The metadata every call carries: ``authorization: Bearer TOKEN`` (``token``, else
    ``$KVKEEP_TOKEN``), or nothing."""
    token = token or os.environ.get("KVKEEP_TOKEN")
    return (("authorization", f"Bearer {token}"),) if token else ()


def call_metadata(metadata: Metadata, session_id: str | None) -> Metadata:
    """``metadata``, plus ``x-kvkeep-session: SESSION_ID`` for a call about a session.

    An id that cannot be a header value as it is (anything but visible ASCII, spaces
    included, or far longer than the daemon's ids) goes without it, so the call still
    reaches a daemon, which refuses the malformed id with InvalidRequestError, where gRPC
    or a proxy would refuse the metadata.
    """
    if session_id and _ROUTABLE_ID.fullmatch(session_id):
        return (*metadata, (SESSION_HEADER, session_id))
    return metadata


def channel(address: str, tls: Tls | None) -> grpc.Channel:
    if tls is None:
        return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    return grpc.secure_channel(address, tls.credentials(), options=tls.options())


def aio_channel(address: str, tls: Tls | None) -> aio.Channel:
    if tls is None:
        return aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    return aio.secure_channel(address, tls.credentials(), options=tls.options())

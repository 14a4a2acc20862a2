"""The test servers themselves: Redis keeps what it acknowledged across a kill -9, the S3
endpoint takes the fixture's credentials and refuses others."""

from __future__ import annotations

import socket
from collections.abc import Callable

import pytest
from servers import RedisServer, S3Server


def _redis(port: int, *command: str) -> bytes:
    """One command in Redis's protocol; the raw reply."""
    parts = [f"*{len(command)}\r\n".encode()]
    for arg in command:
        parts.append(f"${len(arg.encode())}\r\n{arg}\r\n".encode())
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"".join(parts))
        return s.recv(4096)


def test_redis_keeps_acknowledged_writes_across_kill(start_redis: Callable[[], RedisServer]) -> None:
    server = start_redis()
    assert server.url == f"redis://127.0.0.1:{server.port}/0"
    assert _redis(server.port, "SET", "kvkeep-test:key", "value") == b"+OK\r\n"
    server.kill()
    assert not server.ping()
    server.start()
    assert _redis(server.port, "GET", "kvkeep-test:key") == b"$5\r\nvalue\r\n"


def test_s3_takes_the_fixture_credentials(s3_server: S3Server) -> None:
    boto3 = pytest.importorskip("boto3")
    from botocore.exceptions import ClientError

    def client(access_key: str, secret_key: str) -> object:
        return boto3.client(
            "s3",
            endpoint_url=s3_server.endpoint_url,
            region_name=s3_server.region,
            aws_access_key_id=access_key,
            aws_secret_access_key=secret_key,
        )

    s3 = client(s3_server.access_key, s3_server.secret_key)
    s3.put_object(Bucket=s3_server.bucket, Key="kvkeep-test/object", Body=b"bytes")  # type: ignore[attr-defined]
    body = s3.get_object(Bucket=s3_server.bucket, Key="kvkeep-test/object")["Body"].read()  # type: ignore[attr-defined]
    assert body == b"bytes"
    with pytest.raises(ClientError, match="InvalidAccessKeyId"):
        client("nobody", "wrong").list_objects_v2(Bucket=s3_server.bucket)  # type: ignore[attr-defined]

"""Blocks in an S3-compatible object store: one object per block, `PREFIX/KEY` in a bucket.

boto3 signs the requests with the standard credentials (`AWS_ACCESS_KEY_ID`,
`AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, a profile or an instance role: boto3's own
chain) and region (`AWS_REGION`, default us-east-1); `--s3-endpoint` names a server other than
AWS's. A put is a `PutObject` with `If-None-Match: *`, so a block that is present is never
replaced (blocks are immutable); S3 answers a PUT only once the object is stored. Bulk reads
run in parallel on a small pool of connections: a restore is dozens of GETs of ~1.5 MB.

Every request has connect and read timeouts and a bounded number of retries (boto3's
standard mode: exponential backoff with jitter); a write that still fails is
StoreUnreachable (UNAVAILABLE), a read StoreReadFailed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import boto3
import botocore.exceptions
from botocore.config import Config

from kvkeepd.storage.blocks.base import KEY, check_key, read_failed, write_failed

log = logging.getLogger(__name__)

# Requests in flight at once: enough to hide a loopback or LAN round trip behind the others.
PARALLEL = 8
_ABSENT = ("404", "NoSuchKey", "NotFound")


class S3BlockStore:
    remote = True
    in_process = False

    def __init__(
        self,
        url: str,
        *,
        endpoint: str,
        timeout: float,
        retries: int,
        known_bytes: Callable[[], int],
    ) -> None:
        """`url`: s3://BUCKET/PREFIX; `known_bytes()`: the bytes of blocks the catalog
        records, which is what `total_bytes` reports."""
        self.url = url
        self.bucket, _, prefix = url.removeprefix("s3://").partition("/")
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self._known_bytes = known_bytes
        session = boto3.session.Session()
        self._s3: Any = session.client(
            "s3",
            endpoint_url=endpoint or None,
            region_name=session.region_name or "us-east-1",
            config=Config(
                connect_timeout=timeout,
                read_timeout=timeout,
                retries={"total_max_attempts": retries + 1, "mode": "standard"},
                max_pool_connections=PARALLEL * 2,
            ),
        )
        self._pool = ThreadPoolExecutor(max_workers=PARALLEL, thread_name_prefix="kvkeep-s3")

    def __str__(self) -> str:
        return self.url

    def probe(self) -> None:
        """Check the bucket now. Missing credentials or a bucket that does not exist stop
        the daemon (OSError); a server that does not answer is only logged."""
        try:
            self._s3.head_bucket(Bucket=self.bucket)
        except botocore.exceptions.NoCredentialsError:
            raise OSError(
                "the S3 block store has no credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
            ) from None
        except botocore.exceptions.ClientError as e:
            code = e.response.get("Error", {}).get("Code", "")
            if code in _ABSENT or code == "NoSuchBucket":
                raise OSError(f"the S3 block store's bucket {self.bucket!r} does not exist") from None
            log.warning("the block store %s refuses access now (%s): saves fail until it does not", self, e)
        except botocore.exceptions.BotoCoreError as e:
            log.warning("the block store %s does not answer now (%s): saves fail until it does", self, e)

    def _name(self, key: str) -> str:
        return self.prefix + check_key(key)

    def has(self, key: str) -> bool:
        try:
            self._s3.head_object(Bucket=self.bucket, Key=self._name(key))
        except botocore.exceptions.ClientError as e:
            if e.response.get("Error", {}).get("Code", "") in _ABSENT:
                return False
            raise read_failed(self, e) from None
        except botocore.exceptions.BotoCoreError as e:
            raise read_failed(self, e) from None
        return True

    def present(self, keys: Sequence[str]) -> set[str]:
        return {k for k, found in zip(keys, self._pool.map(self.has, keys), strict=True) if found}

    def get(self, key: str) -> bytes:
        try:
            response = self._s3.get_object(Bucket=self.bucket, Key=self._name(key))
            return bytes(response["Body"].read())
        except botocore.exceptions.ClientError as e:
            if e.response.get("Error", {}).get("Code", "") in _ABSENT:
                raise KeyError(key) from None
            raise read_failed(self, e) from None
        except botocore.exceptions.BotoCoreError as e:
            raise read_failed(self, e) from None

    def read_into(self, key: str, parts: Sequence[memoryview]) -> bool:
        """A server's reply arrives as bytes: there is no read in place."""
        return False

    def get_many(self, keys: Sequence[str]) -> dict[str, bytes]:
        def fetch(key: str) -> bytes | None:
            try:
                return self.get(key)
            except KeyError:
                return None

        found = zip(keys, self._pool.map(fetch, keys), strict=True)
        return {k: data for k, data in found if data is not None}

    def put(self, key: str, data: bytes) -> int:
        try:
            self._s3.put_object(Bucket=self.bucket, Key=self._name(key), Body=data, IfNoneMatch="*")
        except botocore.exceptions.ClientError as e:
            code = e.response.get("Error", {}).get("Code", "")
            if code in ("PreconditionFailed", "412", "ConditionalRequestConflict"):
                return 0  # present already (or being written by another daemon: same bytes)
            raise write_failed(self, e) from None
        except botocore.exceptions.BotoCoreError as e:
            raise write_failed(self, e) from None
        return len(data)

    def delete(self, key: str) -> None:
        try:
            self._s3.delete_object(Bucket=self.bucket, Key=self._name(key))
        except (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError) as e:
            raise write_failed(self, e) from None

    def block_keys(self) -> Iterator[str]:
        try:
            pages = self._s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix)
            for page in pages:
                for item in page.get("Contents", ()):
                    key = str(item["Key"])[len(self.prefix) :]
                    if KEY.match(key):
                        yield key
        except (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError) as e:
            raise read_failed(self, e) from None

    def total_bytes(self) -> int:
        return self._known_bytes()

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        self._s3.close()

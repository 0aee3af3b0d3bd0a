"""The S3 backend (AWS S3, R2, GCS's S3 API, SeaweedFS locally).

Besides the checksum recorded in the object's metadata, it sends the SHA-256 with
the upload (`x-amz-checksum-sha256`), so the server refuses a body that was
corrupted in flight. Every botocore failure leaves as a typed BlobStoreError:
absent key or bucket, refused credentials, or, for an endpoint that did not
answer, timed out or throttled, `BlobStoreUnavailable`, which is transient. Writes
wait out such an outage for `outage_patience_s` before they raise it (`outage.py`).
"""

from __future__ import annotations

import base64
import io
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO
from urllib.parse import urlparse

from pipeline.blobstore import (
    META_KEY,
    READ_CHUNK,
    BlobRef,
    ChecksumAlgorithm,
    Hasher,
    capped,
    checksum_of,
    expected_checksum,
    hash_file,
    register_blob_backend,
    stream_to_file,
    verify_checksum,
)
from pipeline.blobstore.outage import ride_out_outage
from pipeline.config import S3BlobSettings
from pipeline.errors import (
    BlobAccessDenied,
    BlobNotFound,
    BlobStoreError,
    BlobStoreUnavailable,
    BlobStoreUntrusted,
    BucketNotFound,
)

_NOT_FOUND = {"NoSuchKey", "404", "NotFound"}
_UNKNOWN_KEY = {"InvalidAccessKeyId", "SignatureDoesNotMatch"}
"""The key is not one the server knows (wrong, or revoked) or the secret does not match it."""
_REFUSED = {"AccessDenied", "403", "Forbidden"}
"""A known key whose grants do not cover this operation on this key (infra/s3_identities.py)."""
_TRY_LATER = {"SlowDown", "ServiceUnavailable", "RequestTimeout", "InternalError", "500", "503"}
"""Codes that say "not now" (throttled, overloaded, timed out), not "no": transient."""


class BlobPermissionRefused(BlobAccessDenied):
    """S3 said no to this identity for this operation: which key, doing what, where. Fatal for the
    operation, neither transient (retrying gets the same answer) nor a missing blob."""

    def __init__(self, uri: str, code: str, endpoint: str | None, access_key_id: str, operation: str):
        self.access_key_id, self.operation, self.code = access_key_id, operation, code
        BlobStoreError.__init__(
            self,
            f"S3 refused {operation} on {uri} to access key {access_key_id} ({code}) "
            f"at {endpoint or 'the default S3 endpoint'}",
            hint=(
                "the key is unknown (wrong, or its token was revoked) or the secret does not match: "
                "check SPRAWL_BLOBS__ACCESS_KEY_ID / SPRAWL_BLOBS__SECRET_ACCESS_KEY, or join again"
                if code in _UNKNOWN_KEY
                else "this identity's role may not do that there: is the worker running with its own role's "
                "credentials for this run? (the grants per role: infra/s3_identities.py)"
            ),
        )
        self.uri = uri


class S3BlobStore:
    def __init__(self, settings: S3BlobSettings):
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        self.settings = settings
        self.bucket = settings.bucket
        self._client = boto3.client(
            "s3",
            endpoint_url=settings.endpoint_url,
            region_name=settings.region,
            verify=str(settings.ca_file) if settings.ca_file else None,  # None: the system's trust store
            aws_access_key_id=settings.access_key_id,
            aws_secret_access_key=settings.secret_access_key.get_secret_value(),
            config=Config(
                retries={"max_attempts": settings.max_attempts, "mode": "standard"},
                connect_timeout=settings.connect_timeout_s,
                read_timeout=settings.read_timeout_s,
                s3={"addressing_style": "path"},
                max_pool_connections=32,
            ),
        )
        self._transfer = TransferConfig(
            multipart_threshold=settings.multipart_threshold_bytes,
            multipart_chunksize=settings.multipart_chunk_bytes,
        )

    @property
    def client(self):
        return self._client

    def uri(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def _split(self, uri: str) -> tuple[str, str]:
        if uri.startswith("s3://"):
            parsed = urlparse(uri)
            return parsed.netloc, parsed.path.lstrip("/")
        return self.bucket, uri

    def _translate(self, exc: Exception, uri: str, bucket: str) -> BlobStoreError:
        from botocore.exceptions import ClientError, ConnectionError, HTTPClientError, IncompleteReadError, SSLError

        endpoint = self.settings.endpoint_url
        if isinstance(exc, SSLError) and "CERTIFICATE_VERIFY_FAILED" in str(exc):
            # Before the outage branch (botocore's SSLError is a ConnectionError): the wrong CA is no outage.
            return BlobStoreUntrusted(endpoint, str(exc), self.settings.ca_file)
        if isinstance(exc, ClientError):
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if code in _NOT_FOUND:
                return BlobNotFound(uri)
            if code == "NoSuchBucket":
                return BucketNotFound(bucket, endpoint)
            if code in _UNKNOWN_KEY | _REFUSED:
                # Never retried (botocore does not retry a 403 either, and it is no TransientError): the same
                # key gets the same answer until someone changes the grants, and it is no missing blob.
                return BlobPermissionRefused(uri, code, endpoint, self.settings.access_key_id, exc.operation_name)
            if code in _TRY_LATER:
                return BlobStoreUnavailable(endpoint, f"{code} on {uri} after {self.settings.max_attempts} attempts")
            return BlobStoreError(f"S3 error on {uri}: {code}: {exc}")
        if isinstance(exc, ConnectionError | HTTPClientError | IncompleteReadError):
            # Refused, reset, timed out (connect or read), or a body cut short: the endpoint, not the blob.
            return BlobStoreUnavailable(endpoint, f"{type(exc).__name__} on {uri}: {exc}")
        return BlobStoreError(f"S3 error on {uri}: {type(exc).__name__}: {exc}")

    def _call(self, uri: str, bucket: str, fn, *args, **kwargs):
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn(*args, **kwargs)
        except (ClientError, BotoCoreError) as exc:
            raise self._translate(exc, uri, bucket) from exc

    def put_bytes(
        self,
        data: bytes,
        key: str | None = None,
        *,
        prefix: str = "cas",
        algorithm: ChecksumAlgorithm = "sha256",
    ) -> BlobRef:
        checksum = checksum_of(data, algorithm)
        if key is None:
            digest = checksum if algorithm == "sha256" else checksum_of(data, "sha256")
            key = f"{prefix.rstrip('/')}/{digest[:2]}/{digest}"
        return self._ride_out_outage(
            lambda: self._put_stream(io.BytesIO(data), len(data), key, algorithm, checksum), key
        )

    def put_file(self, path: Path, key: str, *, algorithm: ChecksumAlgorithm = "sha256") -> BlobRef:
        hasher = hash_file(path, algorithm)

        def put() -> BlobRef:
            with open(path, "rb") as fh:  # each attempt from the first byte again
                return self._put_stream(fh, hasher.size, key, algorithm, hasher.hexdigest())

        return self._ride_out_outage(put, key)

    def _ride_out_outage(self, put: Callable[[], BlobRef], key: str) -> BlobRef:
        """Every write waits out an unavailable store for `outage_patience_s` (pipeline/blobstore/outage.py):
        whoever writes (a publish, a checkpoint, a claim check) rides out a store restart, and the event
        naming the blob is still appended only after the blob is stored."""
        return ride_out_outage(put, what=self.uri(key), patience_s=self.settings.outage_patience_s)

    def _put_stream(
        self, stream: BinaryIO, size: int, key: str, algorithm: ChecksumAlgorithm, checksum: str
    ) -> BlobRef:
        uri = self.uri(key)
        metadata = {META_KEY[algorithm]: checksum}
        if size <= self.settings.multipart_threshold_bytes:
            extra = {}
            if algorithm == "sha256":
                # The server recomputes this and refuses a body that changed in flight.
                extra["ChecksumSHA256"] = base64.b64encode(bytes.fromhex(checksum)).decode()
            self._call(
                uri,
                self.bucket,
                self._client.put_object,
                Bucket=self.bucket,
                Key=key,
                Body=stream,
                Metadata=metadata,
                **extra,
            )
        else:
            # Multipart: boto3 checksums every part and the server verifies each one.
            self._call(
                uri,
                self.bucket,
                self._client.upload_fileobj,
                stream,
                self.bucket,
                key,
                ExtraArgs={"Metadata": metadata, "ChecksumAlgorithm": "SHA256"},
                Config=self._transfer,
            )
        return BlobRef(uri=uri, bytes=size, algorithm=algorithm, checksum=checksum)

    def _open(self, uri: str) -> tuple[Iterator[bytes], dict[str, str]]:
        bucket, key = self._split(uri)
        response = self._call(uri, bucket, self._client.get_object, Bucket=bucket, Key=key)
        chunks = self._translated(response["Body"].iter_chunks(READ_CHUNK), uri, bucket)
        if self.settings.max_download_mbps:
            chunks = _rate_limited(chunks, self.settings.max_download_mbps * 1e6 / 8)
        return chunks, response.get("Metadata", {})

    def _translated(self, chunks: Iterator[bytes], uri: str, bucket: str) -> Iterator[bytes]:
        """The body's chunks, with a connection lost mid-stream typed like any other S3 failure."""
        from botocore.exceptions import BotoCoreError

        try:
            yield from chunks
        except BotoCoreError as exc:
            raise self._translate(exc, uri, bucket) from exc

    def get_bytes(self, uri: str, *, expected: str | None = None, max_bytes: int | None = None) -> bytes:
        chunks, metadata = self._open(uri)
        chunks = capped(uri, chunks, max_bytes)
        algorithm, want = expected_checksum(uri, metadata, expected)
        hasher = Hasher(algorithm)
        buffer = bytearray()
        for chunk in chunks:
            hasher.update(chunk)
            buffer += chunk
        verify_checksum(uri, hasher, want)
        return bytes(buffer)

    def get_to_file(
        self, uri: str, path: Path, *, expected: str | None = None, max_bytes: int | None = None
    ) -> BlobRef:
        chunks, metadata = self._open(uri)
        chunks = capped(uri, chunks, max_bytes)
        algorithm, want = expected_checksum(uri, metadata, expected)
        return stream_to_file(uri, chunks, path, algorithm, want)

    def exists(self, uri: str) -> bool:
        """True or False only on the server's answer; an unreachable store raises, it is never "absent"."""
        bucket, key = self._split(uri)
        try:
            self._call(uri, bucket, self._client.head_object, Bucket=bucket, Key=key)
        except BlobNotFound:
            return False
        return True

    def list_keys(self, prefix: str) -> list[str]:
        paginator = self._client.get_paginator("list_objects_v2")
        keys: list[str] = []
        pages = self._call(prefix, self.bucket, lambda: list(paginator.paginate(Bucket=self.bucket, Prefix=prefix)))
        for page in pages:
            keys.extend(obj["Key"] for obj in page.get("Contents", []))
        return keys

    def ensure_bucket(self) -> None:
        """Create the bucket if missing (used by the local stack; production buckets are provisioned)."""
        try:
            self._call(self.uri(""), self.bucket, self._client.head_bucket, Bucket=self.bucket)
            return
        except (BlobNotFound, BucketNotFound):
            pass  # only the server saying "no such bucket" means create it: a refusal or an outage raises
        self._call(self.uri(""), self.bucket, self._client.create_bucket, Bucket=self.bucket)


def _rate_limited(chunks: Iterator[bytes], bytes_per_s: float) -> Iterator[bytes]:
    """Yield chunks no faster than `bytes_per_s` on average (a token bucket without burst)."""
    start = time.monotonic()
    sent = 0
    for chunk in chunks:
        sent += len(chunk)
        ahead = sent / bytes_per_s - (time.monotonic() - start)
        if ahead > 0:
            time.sleep(ahead)
        yield chunk


register_blob_backend("s3", S3BlobStore)

"""The blob store: immutable, verified objects in S3 (or a local folder standing in for one).

Every object records its checksum in its metadata when it is written, and
every read verifies it while streaming, so a truncated or altered object is a
typed error rather than silently wrong weights. The S3 backend also sends the
SHA-256 with the upload (`x-amz-checksum-sha256`), so the server refuses a
body that was corrupted in flight.
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Literal, Protocol
from urllib.parse import urlparse

import xxhash

from pipeline.config import BlobSettings, LocalBlobSettings, S3BlobSettings
from pipeline.errors import (
    BlobAccessDenied,
    BlobIntegrityError,
    BlobNotFound,
    BlobStoreError,
    BlobStoreUnavailable,
    BucketNotFound,
)

ChecksumAlgorithm = Literal["sha256", "xxh3_128"]
_READ_CHUNK = 1 << 20
_META_KEY = {"sha256": "sprawl-sha256", "xxh3_128": "sprawl-xxh3-128"}


@dataclass(frozen=True)
class BlobRef:
    """Where a blob is and how to check it."""

    uri: str
    bytes: int
    algorithm: ChecksumAlgorithm
    checksum: str


class _Hasher:
    def __init__(self, algorithm: ChecksumAlgorithm):
        self.algorithm = algorithm
        self._h = hashlib.sha256() if algorithm == "sha256" else xxhash.xxh3_128()
        self.size = 0

    def update(self, chunk: bytes) -> None:
        self._h.update(chunk)
        self.size += len(chunk)

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def checksum_of(data: bytes, algorithm: ChecksumAlgorithm = "sha256") -> str:
    hasher = _Hasher(algorithm)
    hasher.update(data)
    return hasher.hexdigest()


def content_key(data: bytes, prefix: str = "cas") -> str:
    digest = checksum_of(data, "sha256")
    return f"{prefix.rstrip('/')}/{digest[:2]}/{digest}"


class BlobStore(Protocol):
    def uri(self, key: str) -> str: ...
    def put_bytes(
        self,
        data: bytes,
        key: str | None = None,
        *,
        prefix: str = "cas",
        algorithm: ChecksumAlgorithm = "sha256",
    ) -> BlobRef: ...
    def put_file(self, path: Path, key: str, *, algorithm: ChecksumAlgorithm = "sha256") -> BlobRef: ...
    def get_bytes(self, uri: str, *, expected: str | None = None) -> bytes: ...
    def get_to_file(self, uri: str, path: Path, *, expected: str | None = None) -> BlobRef: ...
    def exists(self, uri: str) -> bool: ...
    def list_keys(self, prefix: str) -> list[str]: ...


def open_blob_store(settings: BlobSettings) -> BlobStore:
    if isinstance(settings, S3BlobSettings):
        return S3BlobStore(settings)
    return LocalBlobStore(settings)


def _verify(uri: str, hasher: _Hasher, expected: str) -> None:
    actual = hasher.hexdigest()
    if actual != expected:
        raise BlobIntegrityError(uri, hasher.algorithm, expected, actual)


def _expected_from(uri: str, metadata: dict[str, str], expected: str | None) -> tuple[ChecksumAlgorithm, str]:
    """Pick what to verify against: the caller's checksum if given, else the one recorded at write."""
    if expected is not None:
        algorithm: ChecksumAlgorithm = "sha256" if len(expected) == 64 else "xxh3_128"
        return algorithm, expected
    for algorithm, meta_key in _META_KEY.items():
        if meta_key in metadata:
            return algorithm, metadata[meta_key]  # type: ignore[return-value]
    raise BlobIntegrityError(uri, "sha256", "(a recorded checksum)", "none recorded: not written by sprawl")


# ------------------------------------------------------------------ S3


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
        from botocore.exceptions import ClientError, ConnectionError, EndpointConnectionError

        if isinstance(exc, ClientError):
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if code in {"NoSuchKey", "404", "NotFound"}:
                return BlobNotFound(uri)
            if code == "NoSuchBucket":
                return BucketNotFound(bucket, self.settings.endpoint_url)
            if code in {"InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403"}:
                return BlobAccessDenied(uri, code, self.settings.endpoint_url)
            return BlobStoreError(f"S3 error on {uri}: {code}: {exc}")
        if isinstance(exc, EndpointConnectionError | ConnectionError):
            return BlobStoreUnavailable(self.settings.endpoint_url, str(exc))
        return BlobStoreError(f"S3 error on {uri}: {exc}")

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
        return self._put_stream(io.BytesIO(data), len(data), key, algorithm, checksum)

    def put_file(self, path: Path, key: str, *, algorithm: ChecksumAlgorithm = "sha256") -> BlobRef:
        hasher = _Hasher(algorithm)
        with open(path, "rb") as fh:
            for chunk in iter(lambda: fh.read(_READ_CHUNK), b""):
                hasher.update(chunk)
        with open(path, "rb") as fh:
            return self._put_stream(fh, hasher.size, key, algorithm, hasher.hexdigest())

    def _put_stream(
        self, stream: BinaryIO, size: int, key: str, algorithm: ChecksumAlgorithm, checksum: str
    ) -> BlobRef:
        uri = self.uri(key)
        metadata = {_META_KEY[algorithm]: checksum}
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
        chunks = response["Body"].iter_chunks(_READ_CHUNK)
        if self.settings.max_download_mbps:
            chunks = _rate_limited(chunks, self.settings.max_download_mbps * 1e6 / 8)
        return chunks, response.get("Metadata", {})

    def get_bytes(self, uri: str, *, expected: str | None = None) -> bytes:
        chunks, metadata = self._open(uri)
        algorithm, want = _expected_from(uri, metadata, expected)
        hasher = _Hasher(algorithm)
        buffer = bytearray()
        for chunk in chunks:
            hasher.update(chunk)
            buffer += chunk
        _verify(uri, hasher, want)
        return bytes(buffer)

    def get_to_file(self, uri: str, path: Path, *, expected: str | None = None) -> BlobRef:
        chunks, metadata = self._open(uri)
        algorithm, want = _expected_from(uri, metadata, expected)
        return _stream_to_file(uri, chunks, path, algorithm, want)

    def exists(self, uri: str) -> bool:
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
        from botocore.exceptions import ClientError

        try:
            self._client.head_bucket(Bucket=self.bucket)
        except ClientError:
            self._call(self.uri(""), self.bucket, self._client.create_bucket, Bucket=self.bucket)


def _rate_limited(chunks: Iterator[bytes], bytes_per_s: float) -> Iterator[bytes]:
    """Yield chunks no faster than `bytes_per_s` on average (a token bucket without burst)."""
    import time

    start = time.monotonic()
    sent = 0
    for chunk in chunks:
        sent += len(chunk)
        ahead = sent / bytes_per_s - (time.monotonic() - start)
        if ahead > 0:
            time.sleep(ahead)
        yield chunk


def _stream_to_file(uri: str, chunks: Iterator[bytes], path: Path, algorithm: ChecksumAlgorithm, want: str) -> BlobRef:
    """Write to a temp file beside `path`, verify, then rename: a reader never sees a partial blob."""
    path.parent.mkdir(parents=True, exist_ok=True)
    hasher = _Hasher(algorithm)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as out:
            for chunk in chunks:
                hasher.update(chunk)
                out.write(chunk)
        _verify(uri, hasher, want)
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return BlobRef(uri=uri, bytes=hasher.size, algorithm=algorithm, checksum=want)


# ------------------------------------------------------------------ local folder


class LocalBlobStore:
    """A folder standing in for a bucket; checksums live in `<object>.meta` sidecars."""

    def __init__(self, settings: LocalBlobSettings):
        self.root = settings.root.resolve()
        self.root.mkdir(parents=True, exist_ok=True)

    def uri(self, key: str) -> str:
        return f"file://{self.root / key}"

    def _path(self, uri: str) -> Path:
        path = Path(urlparse(uri).path) if uri.startswith("file://") else self.root / uri
        if not path.resolve().is_relative_to(self.root):
            raise BlobStoreError(f"{uri} is outside the blob root {self.root}")
        return path

    def put_bytes(
        self,
        data: bytes,
        key: str | None = None,
        *,
        prefix: str = "cas",
        algorithm: ChecksumAlgorithm = "sha256",
    ) -> BlobRef:
        key = key or content_key(data, prefix)
        ref = _stream_to_file(self.uri(key), iter([data]), self.root / key, algorithm, checksum_of(data, algorithm))
        self._write_meta(self.root / key, ref)
        return ref

    def put_file(self, path: Path, key: str, *, algorithm: ChecksumAlgorithm = "sha256") -> BlobRef:
        target = self.root / key
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
        hasher = _Hasher(algorithm)
        with open(target, "rb") as fh:
            for chunk in iter(lambda: fh.read(_READ_CHUNK), b""):
                hasher.update(chunk)
        ref = BlobRef(uri=self.uri(key), bytes=hasher.size, algorithm=algorithm, checksum=hasher.hexdigest())
        self._write_meta(target, ref)
        return ref

    @staticmethod
    def _write_meta(path: Path, ref: BlobRef) -> None:
        Path(f"{path}.meta").write_text(f"{_META_KEY[ref.algorithm]}={ref.checksum}\n")

    def _open(self, uri: str) -> tuple[Iterator[bytes], dict[str, str]]:
        path = self._path(uri)
        if not path.is_file():
            raise BlobNotFound(uri)
        meta_path = Path(f"{path}.meta")
        metadata = dict(line.split("=", 1) for line in meta_path.read_text().split()) if meta_path.exists() else {}

        def chunks() -> Iterator[bytes]:
            with open(path, "rb") as fh:
                yield from iter(lambda: fh.read(_READ_CHUNK), b"")

        return chunks(), metadata

    def get_bytes(self, uri: str, *, expected: str | None = None) -> bytes:
        chunks, metadata = self._open(uri)
        algorithm, want = _expected_from(uri, metadata, expected)
        hasher = _Hasher(algorithm)
        data = b"".join(chunks)
        hasher.update(data)
        _verify(uri, hasher, want)
        return data

    def get_to_file(self, uri: str, path: Path, *, expected: str | None = None) -> BlobRef:
        chunks, metadata = self._open(uri)
        algorithm, want = _expected_from(uri, metadata, expected)
        return _stream_to_file(uri, chunks, path, algorithm, want)

    def exists(self, uri: str) -> bool:
        return self._path(uri).is_file()

    def list_keys(self, prefix: str) -> list[str]:
        base = self.root / prefix
        candidates = base.rglob("*") if base.is_dir() else self.root.rglob(f"{prefix}*")
        return sorted(str(p.relative_to(self.root)) for p in candidates if p.is_file() and not p.name.endswith(".meta"))

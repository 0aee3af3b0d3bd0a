"""The blob store: immutable, verified objects in S3 (or a local folder standing in for one).

Every object records its checksum in its metadata when it is written, and
every read verifies it while streaming, so a truncated or altered object is a
typed error rather than silently wrong weights.

Backends are one module each (`s3.py`, `local.py`) plus one `register_blob_backend`
call keyed by the settings' `type`; `open_blob_store` picks from that registry.
This module holds what every backend shares: `BlobRef`, the `BlobStore`
protocol and the checksum helpers.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import xxhash

from pipeline.config import BlobSettings
from pipeline.errors import BlobIntegrityError, BlobTooLarge, SprawlError, UnknownBlobBackend

ChecksumAlgorithm = Literal["sha256", "xxh3_128"]
READ_CHUNK = 1 << 20
META_KEY = {"sha256": "sprawl-sha256", "xxh3_128": "sprawl-xxh3-128"}
"""Object metadata key that records each algorithm's checksum at write time."""


@dataclass(frozen=True)
class BlobRef:
    """Where a blob is and how to check it."""

    uri: str
    bytes: int
    algorithm: ChecksumAlgorithm
    checksum: str


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
    def get_bytes(self, uri: str, *, expected: str | None = None, max_bytes: int | None = None) -> bytes: ...
    def get_to_file(
        self, uri: str, path: Path, *, expected: str | None = None, max_bytes: int | None = None
    ) -> BlobRef: ...
    def exists(self, uri: str) -> bool: ...
    def list_keys(self, prefix: str) -> list[str]: ...


# ------------------------------------------------------------------ the backend registry

BlobBackend = Callable[[Any], BlobStore]
"""Opens a store from its settings section (an `S3BlobSettings`, a `LocalBlobSettings`, ...)."""

BLOB_BACKENDS: dict[str, BlobBackend] = {}
"""The registry: settings `type` -> opener. Filled by the backend modules imported at the bottom."""


def register_blob_backend(backend_type: str, opener: BlobBackend) -> BlobBackend:
    """Make `open_blob_store` open settings whose `type` is `backend_type` with `opener`."""
    if backend_type in BLOB_BACKENDS:
        raise SprawlError(
            f"blob backend type {backend_type!r} is already registered", hint="give the new backend its own type"
        )
    BLOB_BACKENDS[backend_type] = opener
    return opener


def open_blob_store(settings: BlobSettings) -> BlobStore:
    """The store the settings describe, chosen by their `type`; UnknownBlobBackend names the registered ones."""
    backend_type = getattr(settings, "type", None)
    opener = BLOB_BACKENDS.get(backend_type) if isinstance(backend_type, str) else None
    if opener is None:
        raise UnknownBlobBackend(str(backend_type), sorted(BLOB_BACKENDS))
    return opener(settings)


# ------------------------------------------------------------------ checksums


class Hasher:
    """A running checksum of one algorithm that also counts bytes."""

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
    hasher = Hasher(algorithm)
    hasher.update(data)
    return hasher.hexdigest()


def content_key(data: bytes, prefix: str = "cas") -> str:
    digest = checksum_of(data, "sha256")
    return f"{prefix.rstrip('/')}/{digest[:2]}/{digest}"


def verify_checksum(uri: str, hasher: Hasher, expected: str) -> None:
    actual = hasher.hexdigest()
    if actual != expected:
        raise BlobIntegrityError(uri, hasher.algorithm, expected, actual)


def expected_checksum(uri: str, metadata: dict[str, str], expected: str | None) -> tuple[ChecksumAlgorithm, str]:
    """Pick what to verify against: the caller's checksum if given, else the one recorded at write."""
    if expected is not None:
        algorithm: ChecksumAlgorithm = "sha256" if len(expected) == 64 else "xxh3_128"
        return algorithm, expected
    for algorithm, meta_key in META_KEY.items():
        if meta_key in metadata:
            return algorithm, metadata[meta_key]  # type: ignore[return-value]
    raise BlobIntegrityError(uri, "sha256", "(a recorded checksum)", "none recorded: not written by sprawl")


def hash_file(path: Path, algorithm: ChecksumAlgorithm) -> Hasher:
    """The checksum (and size) of a file, read in chunks."""
    hasher = Hasher(algorithm)
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(READ_CHUNK), b""):
            hasher.update(chunk)
    return hasher


def capped(uri: str, chunks: Iterator[bytes], max_bytes: int | None) -> Iterator[bytes]:
    """`chunks`, failing with BlobTooLarge as soon as more than `max_bytes` have come (None: no cap).
    Readers pass the size their pointer names: a longer blob is not it, so nothing past that is read."""
    if max_bytes is None:
        yield from chunks
        return
    seen = 0
    for chunk in chunks:
        seen += len(chunk)
        if seen > max_bytes:
            raise BlobTooLarge(uri, max_bytes)
        yield chunk


def stream_to_file(uri: str, chunks: Iterator[bytes], path: Path, algorithm: ChecksumAlgorithm, want: str) -> BlobRef:
    """Write to a temp file beside `path`, verify, then rename: a reader never sees a partial blob."""
    path.parent.mkdir(parents=True, exist_ok=True)
    hasher = Hasher(algorithm)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as out:
            for chunk in chunks:
                hasher.update(chunk)
                out.write(chunk)
        verify_checksum(uri, hasher, want)
        os.replace(tmp_name, path)
    except BaseException:
        # Cleanup, then re-raise whatever it was (a failed check, a dropped stream, a cancellation):
        # the temp file must not outlive any failure.
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return BlobRef(uri=uri, bytes=hasher.size, algorithm=algorithm, checksum=want)


# The backends: each module registers itself on import. The re-exports keep
# `from pipeline.blobstore import S3BlobStore` (and the rest) working.
from pipeline.blobstore.local import LocalBlobStore  # noqa: E402
from pipeline.blobstore.s3 import S3BlobStore  # noqa: E402

__all__ = [
    "BLOB_BACKENDS",
    "BlobBackend",
    "BlobRef",
    "BlobStore",
    "ChecksumAlgorithm",
    "LocalBlobStore",
    "S3BlobStore",
    "checksum_of",
    "content_key",
    "open_blob_store",
    "register_blob_backend",
]

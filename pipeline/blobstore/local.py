"""The local backend: a folder standing in for a bucket, for single-machine runs without S3.

Checksums live in `<object>.meta` sidecars; writes go through a temp file and a rename.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

from pipeline.blobstore import (
    META_KEY,
    READ_CHUNK,
    BlobRef,
    ChecksumAlgorithm,
    Hasher,
    capped,
    checksum_of,
    content_key,
    expected_checksum,
    hash_file,
    register_blob_backend,
    stream_to_file,
    verify_checksum,
)
from pipeline.config import LocalBlobSettings
from pipeline.errors import BlobNotFound, BlobStoreError


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
            raise BlobStoreError(
                f"{uri} is outside the blob root {self.root}",
                hint="a local store reads only under its own `blobs.root`",
            )
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
        ref = stream_to_file(self.uri(key), iter([data]), self.root / key, algorithm, checksum_of(data, algorithm))
        self._write_meta(self.root / key, ref)
        return ref

    def put_file(self, path: Path, key: str, *, algorithm: ChecksumAlgorithm = "sha256") -> BlobRef:
        target = self.root / key
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
        hasher = hash_file(target, algorithm)
        ref = BlobRef(uri=self.uri(key), bytes=hasher.size, algorithm=algorithm, checksum=hasher.hexdigest())
        self._write_meta(target, ref)
        return ref

    @staticmethod
    def _write_meta(path: Path, ref: BlobRef) -> None:
        Path(f"{path}.meta").write_text(f"{META_KEY[ref.algorithm]}={ref.checksum}\n")

    def _open(self, uri: str) -> tuple[Iterator[bytes], dict[str, str]]:
        path = self._path(uri)
        if not path.is_file():
            raise BlobNotFound(uri)
        meta_path = Path(f"{path}.meta")
        metadata = dict(line.split("=", 1) for line in meta_path.read_text().split()) if meta_path.exists() else {}

        def chunks() -> Iterator[bytes]:
            with open(path, "rb") as fh:
                yield from iter(lambda: fh.read(READ_CHUNK), b"")

        return chunks(), metadata

    def get_bytes(self, uri: str, *, expected: str | None = None, max_bytes: int | None = None) -> bytes:
        chunks, metadata = self._open(uri)
        chunks = capped(uri, chunks, max_bytes)
        algorithm, want = expected_checksum(uri, metadata, expected)
        hasher = Hasher(algorithm)
        data = b"".join(chunks)
        hasher.update(data)
        verify_checksum(uri, hasher, want)
        return data

    def get_to_file(
        self, uri: str, path: Path, *, expected: str | None = None, max_bytes: int | None = None
    ) -> BlobRef:
        chunks, metadata = self._open(uri)
        chunks = capped(uri, chunks, max_bytes)
        algorithm, want = expected_checksum(uri, metadata, expected)
        return stream_to_file(uri, chunks, path, algorithm, want)

    def exists(self, uri: str) -> bool:
        return self._path(uri).is_file()

    def list_keys(self, prefix: str) -> list[str]:
        base = self.root / prefix
        candidates = base.rglob("*") if base.is_dir() else self.root.rglob(f"{prefix}*")
        return sorted(str(p.relative_to(self.root)) for p in candidates if p.is_file() and not p.name.endswith(".meta"))


register_blob_backend("local", LocalBlobStore)

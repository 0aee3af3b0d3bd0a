"""Patch blobs an island downloaded, kept on local disk by sha256 (`<cache>/.patches/<sha256>`).

With two version slots the standby one catches up two versions at a time (v-2 -> v-1 -> v): the patch
to v-1 was downloaded for the other slot a version ago, and is read from here instead of twice over
the network. A blob is checked against its sha256 before it is used (once per process and file: a
file this process wrote or checked is not hashed again while its inode, size, mtime and ctime are
unchanged; ctime, unlike mtime, cannot be set back from user space, so a rewrite is always seen), and
the store is pruned to the blobs that can still be applied to a kept version. A stored blob that
fails while applied is forgotten (deleted): the next try downloads it again instead of reusing it.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from pipeline.logs import get_logger
from schemas import BlobPointer

log = get_logger(__name__)

PATCH_STORE_DIR = ".patches"


class PatchStore:
    def __init__(self, root: Path):
        self.directory = root / PATCH_STORE_DIR
        self.directory.mkdir(parents=True, exist_ok=True)
        self._checked: dict[str, tuple[int, int, int, int]] = {}
        """sha256 -> (inode, size, mtime_ns, ctime_ns) of a file known to hold exactly those bytes."""

    def path(self, blob: BlobPointer) -> Path:
        return self.directory / blob.sha256

    def has(self, blob: BlobPointer) -> bool:
        """Is the blob here (planning: a blob on disk costs no download)? Not yet checked: see `usable`."""
        return self.path(blob).is_file()

    def usable(self, blob: BlobPointer) -> bool:
        """Is the blob here with exactly its bytes? One that is not is deleted (it is downloaded again)."""
        path = self.path(blob)
        try:
            stat = path.stat()
        except FileNotFoundError:
            return False
        signature = _signature(stat)
        if self._checked.get(blob.sha256) == signature:
            return True
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(8 * 1024 * 1024):
                digest.update(chunk)
        if digest.hexdigest() != blob.sha256:
            log.error("a stored patch blob is damaged: deleted, downloaded again", uri=blob.uri, path=str(path))
            path.unlink(missing_ok=True)
            return False
        self._checked[blob.sha256] = signature
        return True

    def downloaded(self, blob: BlobPointer) -> None:
        """The blob store just wrote and verified this file: no need to hash it again."""
        self._checked[blob.sha256] = _signature(self.path(blob).stat())

    def forget(self, blob: BlobPointer) -> None:
        """The stored copy failed while applied: delete it (downloaded again when next needed)."""
        self._checked.pop(blob.sha256, None)
        self.path(blob).unlink(missing_ok=True)

    def read(self, blob: BlobPointer) -> bytes:
        return self.path(blob).read_bytes()

    def keep_only(self, wanted: set[str]) -> None:
        """Delete every blob whose sha256 is not in `wanted` (and any partial download)."""
        for path in self.directory.iterdir():
            if path.name not in wanted:
                path.unlink(missing_ok=True)
                self._checked.pop(path.name, None)

    def __len__(self) -> int:
        return sum(1 for _ in os.scandir(self.directory))


def _signature(stat: os.stat_result) -> tuple[int, int, int, int]:
    return (stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)

"""Version directories as recyclable slots: who may reuse one, and the files that say what one holds.

A cached version is a directory `v%08d` in HF layout with a manifest (`MANIFEST_FILE`: which event's
bits it holds, their digests, and a random `generation` that changes whenever the directory is
rebuilt). A version is built by taking an older directory out of the cache (an atomic rename to a
staging name `.tmp-v<N>-...`: from then on it is no cached version at all, and a process killed while
writing into it leaves a `.tmp-*` that garbage collection removes), patching it in place, and
renaming it back under the new version's name. Two directories (A/B) are then enough: the one being
served, and the standby that catches up to the next version.

A directory an engine is loading or serving from must not be recycled underneath it. The engine's
island holds a shared `flock` on the directory's `IN_USE_FILE` (`VersionPin`) from before it loads
the version until it has loaded a newer one; a materializer recycles only directories on which it can
take the exclusive lock without waiting (`claim`), in whatever process the pin was taken. Pins and
claims are both made under the cache's `.lock`, so neither races the other.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import uuid
from pathlib import Path

from pipeline.logs import get_logger

log = get_logger(__name__)

MANIFEST_FILE = "sprawl-version.json"
IN_USE_FILE = ".in-use"
LEFTOVER_PREFIXES = (".tmp-", ".trash-", ".foreign-", ".damaged-")
"""Directories only a materializer holding the cache lock makes; any found while holding it are orphans."""


class VersionPin:
    """A shared lock on a version directory: while held, no materializer on this host recycles or removes
    it. Released explicitly, or when the process ends (the kernel drops flocks with their descriptors)."""

    def __init__(self, directory: Path, fd: int):
        self.directory = directory
        self._fd: int | None = fd

    @classmethod
    def take(cls, directory: Path) -> VersionPin:
        fd = os.open(directory / IN_USE_FILE, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
        except BaseException:
            os.close(fd)
            raise
        return cls(directory, fd)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the lock
            self._fd = None

    def __del__(self) -> None:
        # A pin nobody holds any more (say, a materialize whose caller was cancelled) must not keep the
        # directory from being recycled for the rest of the process's life.
        self.release()

    def __repr__(self) -> str:
        return f"VersionPin({self.directory.name}, held={self.held})"


def in_use(directory: Path) -> bool:
    """Is the directory pinned (by this process or another)? Probes with a non-blocking exclusive lock."""
    fd = claim(directory)
    if fd is None:
        return True
    os.close(fd)
    return False


def claim(directory: Path) -> int | None:
    """The exclusive lock on an unpinned directory (a descriptor to close once it is renamed away),
    or None when someone holds a pin on it."""
    try:
        fd = os.open(directory / IN_USE_FILE, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except FileNotFoundError:
        return None  # gone meanwhile: nothing to claim
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def read_manifest(directory: Path) -> dict | None:
    """The manifest, or None when it is missing or unreadable (a torn write reads as no version)."""
    try:
        manifest = json.loads((directory / MANIFEST_FILE).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def write_manifest(directory: Path, fields: dict) -> str:
    """Write the manifest with a fresh `generation`; returns it. Written beside and renamed: a reader sees
    the old manifest or the new one, never half of one. Not fsynced (see `pipeline/materialize.py`)."""
    generation = uuid.uuid4().hex
    tmp = directory / f".{MANIFEST_FILE}.{generation[:8]}"
    tmp.write_text(json.dumps({**fields, "generation": generation}, indent=1, sort_keys=True))
    os.replace(tmp, directory / MANIFEST_FILE)
    return generation


def directory_fingerprint(directory: Path) -> tuple:
    """What the directory's files are now, by their inodes' metadata (not their bytes): name, inode,
    size, mtime and ctime of each (not followed through symlinks). A write into a file (by write() or
    through a mapping), a file replaced or linked, all change it; ctime cannot be set back from user
    space. A process trusts a directory it hashed only while this, and the manifest's generation, stay
    the same. Cheap: a stat per file."""
    entries = []
    for entry in os.scandir(directory):
        if entry.name == MANIFEST_FILE or entry.name.startswith("."):
            continue  # the manifest has its generation; dot files are pins and temporaries
        info = entry.stat(follow_symlinks=False)
        entries.append((entry.name, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns))
    return tuple(sorted(entries))


def directory_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.iterdir() if p.is_file())


def copy_file(source: Path, target: Path) -> None:
    """Copy in the kernel: `copy_file_range` shares extents where the filesystem can (a reflink on
    XFS or Btrfs costs no data write), and falls back to a plain copy where it cannot."""
    with open(source, "rb") as src, open(target, "wb") as dst:
        remaining = os.fstat(src.fileno()).st_size
        try:
            while remaining > 0:
                copied = os.copy_file_range(src.fileno(), dst.fileno(), remaining)
                if copied == 0:
                    break
                remaining -= copied
            if remaining == 0:
                return
        except OSError:
            pass  # not supported across these files: copy through user space below
        src.seek(0)
        dst.seek(0)
        dst.truncate()
        shutil.copyfileobj(src, dst, length=16 * 1024 * 1024)


def copy_version_files(source: Path, target: Path) -> None:
    """A version directory's files (not its manifest or pin file) into `target`."""
    for path in source.iterdir():
        if path.is_file() and path.name not in (MANIFEST_FILE, IN_USE_FILE) and not path.name.startswith("."):
            copy_file(path, target / path.name)


def remove_directory(root: Path, directory: Path, label: str) -> None:
    """Out of the way at once (a rename is atomic), then deleted."""
    aside = root / f".{label}-{directory.name}-{uuid.uuid4().hex[:8]}"
    try:
        os.rename(directory, aside)
    except FileNotFoundError:
        return
    shutil.rmtree(aside, ignore_errors=True)


def remove_leftovers(root: Path) -> None:
    """Staging and trash directories of a process that died mid-build (call with the cache lock held)."""
    for path in root.iterdir():
        if path.name.startswith(LEFTOVER_PREFIXES) and path.is_dir():
            log.warning("removing a half-built version directory left by a stopped process", path=str(path))
            shutil.rmtree(path, ignore_errors=True)


def process_written_bytes() -> int | None:
    """Bytes this process has caused to be written to storage so far (`write_bytes` of /proc/self/io:
    page-cache pages dirtied, by write() or through a shared mapping, counted when they become dirty).
    None where the kernel does not say (not Linux, or no task I/O accounting)."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("write_bytes:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None

"""Leases on sandbox uids, so two pools on one host (two reward workers, two test suites) never share one.

A sandbox's uid is what its process limit counts against and what "no process of its uid survives"
is checked by; two pools running programs as the same uid would exhaust each other's RLIMIT_NPROC
and see each other's processes as leftovers. Each uid in use is held by an exclusive `flock` on
`<lock_dir>/<uid>.lock`. The kernel drops the lock when the holder closes it or dies (SIGKILL
included), so a crashed worker never leaks its uids, and nothing has to be cleaned up.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from pipeline.sandbox import SandboxUnavailable


class UidLease:
    """`count` consecutive uids from `first`, held until `release()` (or the process exits)."""

    def __init__(self, first: int, fds: list[int]):
        self.first = first
        self.count = len(fds)
        self._fds = fds

    @property
    def uids(self) -> range:
        return range(self.first, self.first + self.count)

    def uid(self, slot: int) -> int:
        assert 0 <= slot < self.count, (slot, self.count)
        return self.first + slot

    def release(self) -> None:
        fds, self._fds = self._fds, []
        for fd in fds:
            os.close(fd)  # closing the descriptor drops its flock

    def __repr__(self) -> str:
        return f"UidLease({self.first}..{self.first + self.count - 1})"


def _lock(lock_dir: Path, uid: int) -> int | None:
    # O_CLOEXEC: a sandbox (or any program we exec) must not inherit, and so keep alive, our lock.
    fd = os.open(lock_dir / f"{uid}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def lease_uids(count: int, *, uid_base: int, uid_span: int, lock_dir: Path) -> UidLease:
    """Lease `count` consecutive free uids in [uid_base, uid_base + uid_span); the first block whose
    uids are all unlocked wins. Each uid is locked on its own, so pools of different sizes (or with
    different bases) still never overlap."""
    if count < 1 or count > uid_span:
        raise SandboxUnavailable(
            f"a sandbox pool needs {count} uids but sandbox.uid_span is {uid_span}",
            hint="raise SPRAWL_SANDBOX__UID_SPAN or lower SPRAWL_SANDBOX__POOL_SIZE",
        )
    try:
        lock_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SandboxUnavailable(
            f"cannot create the sandbox uid lock folder {lock_dir}: {exc.strerror}",
            hint="set SPRAWL_SANDBOX__UID_LOCK_DIR to a folder this user can write",
        ) from exc
    for first in range(uid_base, uid_base + uid_span - count + 1, count):
        fds: list[int] = []
        for uid in range(first, first + count):
            fd = _lock(lock_dir, uid)
            if fd is None:
                break
            fds.append(fd)
        if len(fds) == count:
            return UidLease(first, fds)
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
    raise SandboxUnavailable(
        f"every sandbox uid in {uid_base}..{uid_base + uid_span - 1} is leased by another pool on this host",
        hint="stop a reward worker, or raise SPRAWL_SANDBOX__UID_SPAN",
    )

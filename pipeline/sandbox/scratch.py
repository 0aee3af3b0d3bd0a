"""A sandbox's writable space: one fresh tmpfs per sandbox, capped in bytes and in inodes.

bubblewrap sizes the tmpfs mounts it makes (`--size`) but cannot cap their inodes, and the root and
`/dev` it builds are tmpfs mounts with neither cap. So the pool makes every writable place itself:
a tmpfs mounted on the host for the sandbox's uid (`size=`, `nr_inodes=`, nosuid, nodev, noexec),
whose `work`, `tmp` and `shm` folders are bound to `/work`, `/tmp` and `/dev/shm`, while `/` and
`/dev` are remounted read-only inside. One cap covers all three, and the pages written there are
charged to the sandbox's memory cgroup (tmpfs pages count against the writer's cgroup).

Each scratch is mounted at `<root>/<uid>` when its sandbox is started and detached when it is
thrown away; the sandbox's uid is leased (`uids.py`), so a mount found there at lease time is a
leftover of a crashed pool and is detached before use.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import stat
from pathlib import Path

from pipeline.sandbox import SandboxUnavailable

_MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 2, 4, 8
_MNT_DETACH = 2

FOLDERS = {"work": "/work", "tmp": "/tmp", "shm": "/dev/shm"}
"""Scratch folder -> where it is bound inside the sandbox."""

_libc = ctypes.CDLL(None, use_errno=True)


def _mount_tmpfs(target: Path, options: str) -> None:
    flags = _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
    if _libc.mount(b"sprawl-sandbox", str(target).encode(), b"tmpfs", flags, options.encode()) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"mounting the sandbox scratch at {target}: {os.strerror(code)}")


def _detach(target: Path) -> bool:
    """Lazily unmount `target` (its last user is gone, or going); False if nothing was mounted."""
    if _libc.umount2(str(target).encode(), _MNT_DETACH) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOENT):  # not a mount point (any more)
        return False
    raise OSError(code, f"unmounting the sandbox scratch at {target}: {os.strerror(code)}")


def _refuse_foreign(root: Path) -> None:
    """The folder we mount under must be ours alone: a symlink or a folder someone else may write
    (it lives under /tmp by default) could point our mounts anywhere."""
    for folder in (root.parent, root):
        info = os.lstat(folder)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o022:
            raise OSError(errno.EPERM, f"{folder} is not a folder that only this user owns and may write")


class ScratchSpace:
    """Fresh, capped tmpfs mounts for sandboxes, one per uid at a time, under `root`."""

    def __init__(self, root: Path, *, size_mb: int, max_inodes: int):
        self.root, self.size_mb, self.max_inodes = root, size_mb, max_inodes

    def check(self) -> None:
        """Mount and unmount one scratch, or SandboxUnavailable saying why (mounting needs root)."""
        probe = self.root / "probe"
        try:
            self.root.mkdir(mode=0o755, parents=True, exist_ok=True)
            _refuse_foreign(self.root)
            probe.mkdir(exist_ok=True)
            _mount_tmpfs(probe, "size=1m,nr_inodes=16,mode=0700")
            _detach(probe)
            probe.rmdir()
        except OSError as exc:
            raise SandboxUnavailable(
                f"cannot mount a tmpfs for sandbox scratch space under {self.root}: {exc.strerror}",
                hint="run the reward worker as root (it already switches sandboxes to their own uids), "
                "or set SPRAWL_SANDBOX__SCRATCH_DIR to a folder on a filesystem where root may mount",
            ) from exc

    def path(self, uid: int) -> Path:
        return self.root / str(uid)

    def binds(self, uid: int) -> list[str]:
        """bubblewrap arguments binding the scratch of `uid` into the sandbox."""
        args: list[str] = []
        for folder, inside in FOLDERS.items():
            args += ["--bind", str(self.path(uid) / folder), inside]
        return args

    def prepare(self, uid: int) -> None:
        """A fresh, empty scratch for `uid` (whatever was mounted there before is detached first)."""
        target = self.path(uid)
        target.mkdir(mode=0o755, exist_ok=True)
        while _detach(target):  # a leftover (a crashed pool, or mounts stacked by a crash mid-prepare)
            pass
        _mount_tmpfs(target, f"size={self.size_mb}m,nr_inodes={self.max_inodes},mode=0755")
        try:
            for folder in FOLDERS:
                os.mkdir(target / folder, 0o700)
                os.chown(target / folder, uid, uid)
        except OSError:
            _detach(target)
            raise

    def leftovers(self) -> list[int]:
        """uids that have a scratch folder here (mounted or not): a crashed pool leaves its mounts."""
        if not self.root.is_dir():
            return []
        return sorted(int(entry.name) for entry in os.scandir(self.root) if entry.name.isdigit())

    def forget(self, uid: int) -> None:
        """Detach and remove the folder of `uid` (the pool is done with it), and the root once empty."""
        self.release(uid)
        for folder in (self.path(uid), self.root):
            with contextlib.suppress(OSError):  # another pool's scratch is still there, or nothing was
                folder.rmdir()

    def release(self, uid: int) -> None:
        """Detach the scratch of `uid`: its pages are freed once the sandbox's mount namespace is gone."""
        with contextlib.suppress(OSError):
            while _detach(self.path(uid)):
                pass

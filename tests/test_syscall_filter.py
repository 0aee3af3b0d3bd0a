"""The sandbox's seccomp filter, installed by real bubblewrap around a real `python3 -I -S`: what it
lists is refused (EPERM; ENOSYS for clone3), and what verifier programs do (threads, fork, subprocess,
multiprocessing, memfds, temporary files, loopback sockets) still works.

Each sandbox runs many checks, so the whole file starts about twenty. Where the kernel alone would
refuse a call too (no capabilities), the same checks run once without the filter, to show that the
refusal is the filter's.
"""

from __future__ import annotations

import errno
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import termios
from pathlib import Path

import pytest

from pipeline.sandbox.syscall_filter import (
    DENIED_SYSCALLS,
    _binding,
    filter_fd,
    filter_program,
    skipped_syscalls,
)
from pipeline.sandbox.uids import lease_uids

PYTHON = "/usr/bin/python3"
REPO = Path(__file__).resolve().parents[1]

NEWER_THAN_LIBSECCOMP_2_5_4 = {"open_tree_attr"}  # Linux 6.15
"""Listed names this libseccomp may not know yet: the filter reports them instead of refusing them. Any
other unknown name is a typo."""

CLONE_NEWUSER = 0x10000000
NAMESPACE_FLAGS = {
    "CLONE_NEWNS": 0x00020000,
    "CLONE_NEWCGROUP": 0x02000000,
    "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000,
    "CLONE_NEWUSER": CLONE_NEWUSER,
    "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
}
PTRACE_ATTACH, PTRACE_SEIZE = 16, 0x4206
KEYCTL_GET_KEYRING_ID, KEY_SPEC_SESSION_KEYRING = 0, -3
X32_SYSCALL_BIT = 0x40000000
AF_VSOCK, AF_PACKET, AF_ALG = 40, 17, 38

# Runs each call in a child of its own, so one that works (unshare, raw clone) changes nothing for the
# next, and prints {label: errno}: 0 where it worked, minus the signal where one killed it.
ERRNO_PROBE = """
import ctypes, json, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long

def errno_of(number, args):
    pid = os.fork()
    if pid == 0:
        padded = [*args, 0, 0, 0, 0, 0, 0][:6]  # unused argument registers must not hold leftovers
        result = libc.syscall(ctypes.c_long(number), *(ctypes.c_ulong(a) for a in padded))
        os._exit(ctypes.get_errno() if result == -1 else 0)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

print(json.dumps({label: errno_of(number, args) for label, (number, args) in json.loads(sys.argv[1]).items()}))
"""


@pytest.fixture(scope="module")
def uid():
    """A sandbox uid of this module's own, leased like a pool's, so no other test's sandbox shares it."""
    lease = lease_uids(1, uid_base=61990, uid_span=10, lock_dir=Path("/tmp/sprawl-sandbox-uids"))
    yield lease.first
    lease.release()


def sandboxed(uid: int, code: str, *args: str, seccomp: bool = True) -> subprocess.CompletedProcess[str]:
    """`code` run by `python3 -I -S` as `uid` in a bare bubblewrap sandbox, under the filter unless told not."""
    fd = filter_fd()
    try:
        argv = [
            *("setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all"),
            *("bwrap", "--unshare-all", "--die-with-parent", "--new-session"),
            *("--ro-bind", "/usr", "/usr", "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64"),
            *("--symlink", "usr/bin", "/bin", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/dev/shm"),
            *("--tmpfs", "/work", "--chdir", "/work", "--clearenv", "--setenv", "PATH", "/usr/bin"),
            *(("--seccomp", str(fd)) if seccomp else ()),
            *("--", PYTHON, "-I", "-S", "-c", code, *args),
        ]
        return subprocess.run(argv, pass_fds=(fd,), capture_output=True, text=True, timeout=60)
    finally:
        os.close(fd)


def printed(result: subprocess.CompletedProcess[str]) -> dict:
    """The JSON object a sandboxed program printed last (failing with its stderr if it printed none)."""
    lines = result.stdout.strip().splitlines()
    assert result.returncode == 0 and lines, f"exit {result.returncode}:\n{result.stderr}"
    return json.loads(lines[-1])


def number(name: str) -> int:
    resolved = _binding().resolve_syscall(_binding().Arch.NATIVE, name)
    assert resolved >= 0, f"{name} is not a system call here"
    return resolved


def errnos(uid: int, calls: dict[str, tuple[int, list[int]]], seccomp: bool = True) -> dict[str, int]:
    """Each labelled raw system call's errno in a sandbox: {label: (number, [arguments])}."""
    return printed(sandboxed(uid, ERRNO_PROBE, json.dumps(calls), seccomp=seccomp))


# --- what is listed is refused ---


def listed_calls() -> dict[str, tuple[int, list[int]]]:
    """Every listed syscall that exists here, with arguments that are harmless should it run (zeros,
    but for ptrace, which PTRACE_SEIZEs pid 1 without stopping it, and keyctl, which reads an id)."""
    arguments = {"ptrace": [PTRACE_SEIZE, 1], "keyctl": [KEYCTL_GET_KEYRING_ID, KEY_SPEC_SESSION_KEYRING]}
    return {name: (number(name), arguments.get(name, [])) for name in DENIED_SYSCALLS if name not in skipped_syscalls()}


@pytest.fixture(scope="module")
def listed_errnos(uid: int) -> dict[str, dict[str, int]]:
    calls = listed_calls()
    return {"filtered": errnos(uid, calls), "unfiltered": errnos(uid, calls, seccomp=False)}


@pytest.mark.parametrize("name", DENIED_SYSCALLS)
def test_every_listed_syscall_is_refused_with_eperm(name: str, listed_errnos: dict[str, dict[str, int]]):
    if name in skipped_syscalls():  # reported (and logged), never dropped silently; see the test below
        assert skipped_syscalls()[name] in {"unknown to this libseccomp", "not a system call on this architecture"}
    else:
        assert listed_errnos["filtered"][name] == errno.EPERM


def test_the_refusal_is_the_filters_not_the_kernels(listed_errnos: dict[str, dict[str, int]]):
    # Calls an unprivileged sandboxed program is otherwise allowed to make.
    unfiltered = listed_errnos["unfiltered"]
    assert unfiltered["unshare"] != errno.EPERM  # unshare(0): nothing to do, so it succeeds
    assert unfiltered["keyctl"] != errno.EPERM
    assert unfiltered["inotify_init1"] != errno.EPERM
    assert unfiltered["flock"] != errno.EPERM  # EINVAL for operation 0


def test_names_the_filter_cannot_refuse_are_reported_not_dropped():
    binding = _binding()
    assert len(set(DENIED_SYSCALLS)) == len(DENIED_SYSCALLS)
    for name, why in skipped_syscalls().items():
        resolved = binding.resolve_syscall(binding.Arch.NATIVE, name)
        if why == "unknown to this libseccomp":
            assert resolved == -1 and name in NEWER_THAN_LIBSECCOMP_2_5_4, f"{name}: a typo in DENIED_SYSCALLS?"
        else:
            assert why == "not a system call on this architecture" and resolved < -1, name
    assert set(skipped_syscalls()) <= set(DENIED_SYSCALLS)


def test_no_new_namespaces_and_no_clone3(uid: int):
    clone = number("clone")
    calls = {flag: (clone, [value | signal.SIGCHLD]) for flag, value in NAMESPACE_FLAGS.items()}
    calls["unshare(CLONE_NEWUSER)"] = (number("unshare"), [CLONE_NEWUSER])
    calls["clone3"] = (number("clone3"), [])
    calls["plain clone"] = (clone, [signal.SIGCHLD])  # a fork: still allowed
    filtered, unfiltered = errnos(uid, calls), errnos(uid, calls, seccomp=False)
    assert {flag: filtered[flag] for flag in NAMESPACE_FLAGS} == dict.fromkeys(NAMESPACE_FLAGS, errno.EPERM)
    assert filtered["unshare(CLONE_NEWUSER)"] == errno.EPERM
    assert filtered["clone3"] == errno.ENOSYS  # glibc then falls back to clone, whose flags the filter reads
    assert filtered["plain clone"] == 0
    # Without the filter, a nested user namespace (every capability inside it) is one call away.
    assert unfiltered["CLONE_NEWUSER"] == 0 and unfiltered["unshare(CLONE_NEWUSER)"] == 0


def test_other_processes_keyrings_io_uring_and_terminals_are_out_of_reach(uid: int):
    ioctl = number("ioctl")
    calls = {
        "ptrace(PTRACE_ATTACH, 1)": (number("ptrace"), [PTRACE_ATTACH, 1]),
        "keyctl(KEYCTL_GET_KEYRING_ID, session)": (number("keyctl"), [KEYCTL_GET_KEYRING_ID, KEY_SPEC_SESSION_KEYRING]),
        "io_uring_setup": (number("io_uring_setup"), [1, 0]),
        "TIOCSTI": (ioctl, [0, termios.TIOCSTI, 0]),
        "TIOCSTI, high bits set": (ioctl, [0, (1 << 32) | termios.TIOCSTI, 0]),
        "TIOCLINUX": (ioctl, [0, termios.TIOCLINUX, 0]),
        "FIONREAD": (ioctl, [1, termios.FIONREAD, 0]),  # any other request still reaches the kernel (EFAULT here)
    }
    assert errnos(uid, calls) == {
        "ptrace(PTRACE_ATTACH, 1)": errno.EPERM,
        "keyctl(KEYCTL_GET_KEYRING_ID, session)": errno.EPERM,
        "io_uring_setup": errno.EPERM,
        "TIOCSTI": errno.EPERM,
        "TIOCSTI, high bits set": errno.EPERM,
        "TIOCLINUX": errno.EPERM,
        "FIONREAD": errno.EFAULT,
    }


def test_personality_only_as_linux_or_as_the_query(uid: int):
    personality = number("personality")
    values = {
        "PER_LINUX": 0,
        "query": 0xFFFFFFFF,
        "PER_LINUX32": 0x0008,
        "ADDR_NO_RANDOMIZE": 0x0040000,
        "READ_IMPLIES_EXEC": 0x0400000,
        "all but the top bit": 0x7FFFFFFF,
        "all but the lowest bit": 0xFFFFFFFE,
        "PER_LINUX above 32 bits": 1 << 32,
    }
    got = errnos(uid, {label: (personality, [value]) for label, value in values.items()})
    assert got == {label: 0 if label in ("PER_LINUX", "query") else errno.EPERM for label in values}


def test_only_local_ip_and_netlink_sockets(uid: int):
    sock = number("socket")
    families = {
        "AF_UNIX": socket.AF_UNIX,
        "AF_INET": socket.AF_INET,
        "AF_INET6": socket.AF_INET6,
        "AF_NETLINK": socket.AF_NETLINK,
        "AF_VSOCK": AF_VSOCK,  # reaches the hypervisor from any network namespace
        "AF_PACKET": AF_PACKET,
        "AF_ALG": AF_ALG,
        "AF_INET with high bits set": (1 << 32) | socket.AF_INET,  # refused rather than truncated past the check
    }
    got = errnos(uid, {label: (sock, [family, socket.SOCK_DGRAM, 0]) for label, family in families.items()})
    allowed = ("AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK")
    assert got == {label: 0 if label in allowed else errno.EAFNOSUPPORT for label in families}


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x32 and int 0x80 are x86_64's other ABIs")
def test_another_abis_syscalls_kill_the_process(uid: int):
    # x32 numbers have bit 30 set; i386's come through `int 0x80`. Neither gets past the list: SIGSYS.
    getpid = number("getpid")
    assert errnos(uid, {"x32 getpid": (X32_SYSCALL_BIT | getpid, [])}) == {"x32 getpid": -signal.SIGSYS}
    i386_getpid = """
import ctypes, mmap
code = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
code.write(bytes([0xB8, 20, 0, 0, 0, 0xCD, 0x80, 0xC3]))  # mov eax, 20 (i386 getpid); int 0x80; ret
print(ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(code)))())
"""
    unfiltered = sandboxed(uid, i386_getpid, seccomp=False)
    filtered = sandboxed(uid, i386_getpid)
    # bwrap exits 128 + the signal that killed the program.
    if unfiltered.returncode == 128 + signal.SIGSEGV:  # a kernel without ia32 emulation: no ABI to bypass with
        assert filtered.returncode == 128 + signal.SIGSEGV
    else:
        assert unfiltered.stdout.strip() == "2"  # the program is pid 2, under bwrap's init
        assert filtered.returncode == 128 + signal.SIGSYS


# --- locks on shared files ---

LOCKS = """
import fcntl, json, os, struct
usr_file = os.open("/usr/bin/python3", os.O_RDONLY)
usr_dir = os.open("/usr", os.O_RDONLY | os.O_DIRECTORY)
read_lock = struct.pack("hhqqi", fcntl.F_RDLCK, os.SEEK_SET, 0, 0, 0)  # struct flock, whole file
attempts = {
    "flock": lambda: fcntl.flock(usr_file, fcntl.LOCK_SH | fcntl.LOCK_NB),
    "lockf": lambda: fcntl.lockf(usr_file, fcntl.LOCK_SH | fcntl.LOCK_NB),
    "F_SETLK": lambda: fcntl.fcntl(usr_file, fcntl.F_SETLK, read_lock),
    "F_SETLKW": lambda: fcntl.fcntl(usr_file, fcntl.F_SETLKW, read_lock),
    "F_GETLK": lambda: fcntl.fcntl(usr_file, fcntl.F_GETLK, read_lock),
    "F_OFD_SETLK": lambda: fcntl.fcntl(usr_file, fcntl.F_OFD_SETLK, read_lock),
    "F_OFD_SETLKW": lambda: fcntl.fcntl(usr_file, fcntl.F_OFD_SETLKW, read_lock),
    "F_OFD_GETLK": lambda: fcntl.fcntl(usr_file, fcntl.F_OFD_GETLK, read_lock),
    "F_GETLEASE": lambda: fcntl.fcntl(usr_file, fcntl.F_GETLEASE),
    "F_SETLEASE": lambda: fcntl.fcntl(usr_file, fcntl.F_SETLEASE, fcntl.F_RDLCK),
    "F_NOTIFY": lambda: fcntl.fcntl(usr_dir, fcntl.F_NOTIFY, fcntl.DN_ACCESS),
    "F_GETFL": lambda: fcntl.fcntl(usr_file, fcntl.F_GETFL),  # not a lock: allowed
}
got = {}
for name, attempt in attempts.items():
    try:
        attempt()
        got[name] = 0
    except OSError as exc:
        got[name] = exc.errno
print(json.dumps(got))
"""


def test_no_locks_leases_or_notifications_on_shared_files(uid: int):
    filtered, unfiltered = printed(sandboxed(uid, LOCKS)), printed(sandboxed(uid, LOCKS, seccomp=False))
    assert filtered == {name: 0 if name == "F_GETFL" else errno.EPERM for name in filtered}
    # Without the filter a sandbox can hold and see locks on the /usr every sandbox shares.
    assert unfiltered["flock"] == unfiltered["F_OFD_SETLK"] == unfiltered["F_NOTIFY"] == 0


# --- what verifier programs do still works ---


def test_threads_fork_and_subprocesses_still_work(uid: int):
    code = """
import json, os, subprocess, threading
results = []
threads = [threading.Thread(target=results.append, args=(n,)) for n in range(4)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
pid = os.fork()
if pid == 0:
    os._exit(7)
forked = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
child = subprocess.run(["/usr/bin/python3", "-c", "print(1)"], capture_output=True, text=True).stdout
print(json.dumps({"threads": sorted(results), "fork": forked, "subprocess": child}))
"""
    assert printed(sandboxed(uid, code)) == {"threads": [0, 1, 2, 3], "fork": 7, "subprocess": "1\n"}


def test_a_multiprocessing_pool_still_works(uid: int):
    code = """
import json, multiprocessing
with multiprocessing.Pool(2) as pool:
    print(json.dumps(pool.map(abs, [-1, -2, -3])))
"""
    assert printed(sandboxed(uid, code)) == [1, 2, 3]


def test_memfds_temporary_files_and_loopback_sockets_still_work(uid: int):
    code = """
import json, os, socket, tempfile
memfd = os.memfd_create("scratch")
os.write(memfd, b"abc")
with tempfile.NamedTemporaryFile(dir="/work") as scratch:
    scratch.write(b"x")
    scratch.flush()
    in_work = os.path.dirname(scratch.name)
server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
server.bind(("127.0.0.1", 0))
server.listen()
client = socket.create_connection(server.getsockname())
peer, _ = server.accept()
client.sendall(b"ping")
echoed = peer.recv(4)
try:
    socket.create_connection(("127.0.0.1", 1))  # nobody listens: refused, as before the filter
    refused = False
except ConnectionRefusedError:
    refused = True
memfd_size = os.fstat(memfd).st_size
print(json.dumps({"memfd": memfd_size, "tempfile": in_work, "loopback": echoed.decode(), "refused": refused}))
"""
    assert printed(sandboxed(uid, code)) == {"memfd": 3, "tempfile": "/work", "loopback": "ping", "refused": True}


def test_the_stdlib_imports_and_sqlite_works_in_memory(uid: int):
    code = """
import json, logging, multiprocessing, sqlite3, subprocess, tempfile, threading
logging.getLogger("x").warning("logged")
db = sqlite3.connect(":memory:")
db.execute("create table t (x)")
db.execute("insert into t values (1)")
print(json.dumps(db.execute("select x from t").fetchall()))
"""
    assert printed(sandboxed(uid, code)) == [[1]]


def test_a_sqlite_file_needs_its_lockless_vfs(uid: int):
    # sqlite locks its database files with fcntl, which the filter refuses (it cannot tell a file in
    # /work from one in the shared /usr); its "unix-none" VFS, which takes no locks, works.
    code = """
import json, sqlite3
def use(target, **kwargs):
    try:
        db = sqlite3.connect(target, **kwargs)
        db.execute("create table t (x)")
        db.commit()
        return "ok"
    except sqlite3.Error as exc:
        return str(exc)
print(json.dumps({"default": use("/work/a.db"), "unix-none": use("file:/work/b.db?vfs=unix-none", uri=True)}))
"""
    got = printed(sandboxed(uid, code))
    assert got["unix-none"] == "ok" and got["default"] != "ok"


# --- the program and its descriptor ---


def test_the_program_is_built_once_and_each_fd_holds_it_from_offset_0():
    program = filter_program()
    assert program is filter_program()
    assert program and len(program) % 8 == 0  # whole `struct sock_filter` instructions
    first, second = filter_fd(), filter_fd()
    try:
        assert first != second
        for fd in (first, second):
            assert os.lseek(fd, 0, os.SEEK_CUR) == 0
            assert not os.get_inheritable(fd)  # pass_fds hands it to bwrap; nothing else inherits it
            assert os.pread(fd, len(program) + 1, 0) == program
    finally:
        os.close(first)
        os.close(second)


def test_without_a_binding_the_sandbox_is_unavailable_naming_what_to_install():
    code = """
import sys
sys.modules["seccomp"] = sys.modules["pyseccomp"] = None  # as if neither were installed
from pipeline.sandbox import SandboxUnavailable
from pipeline.sandbox.syscall_filter import filter_program
try:
    filter_program()
except SandboxUnavailable as exc:
    print(exc.hint)
"""
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert "pip install 'pyseccomp" in result.stdout and "python3-seccomp" in result.stdout, result.stderr

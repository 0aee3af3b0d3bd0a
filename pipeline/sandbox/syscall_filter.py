"""The seccomp filter bubblewrap sandboxes run under: the system calls listed here are refused, every
other one is allowed.

Namespaces, an unprivileged uid and rlimits already keep a program away from the host's files and
processes. This filter takes away the kernel interfaces that reach across those walls anyway, or
that are a large attack surface for nothing a verifier program needs: other processes' memory,
kernel keyrings, io_uring, BPF and perf, mounts and new namespaces (a nested user namespace would
hand the program every capability inside it), locks on the read-only `/usr` that every sandbox
shares (a covert channel between concurrent sandboxes), and administering the machine.

libseccomp compiles the rules, its architecture check included: a system call made through another
ABI (i386's `int 0x80` or x32 on an x86_64 host) kills the process, so the list cannot be bypassed
with the other ABI's numbers. bwrap reads the compiled program from `--seccomp FD` and installs it
right before it executes the sandboxed interpreter, after its own setup (which needs some of these
calls). The binding is libseccomp's own (`import seccomp`, Debian's python3-seccomp) or pyseccomp, a
ctypes binding with the same API; it is loaded when the filter is first built, so a host without
either fails with `SandboxUnavailable` when a pool starts, not when this module is imported.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import os
import socket
import tempfile
import termios
from types import ModuleType

from pipeline.logs import get_logger
from pipeline.sandbox import SandboxUnavailable

log = get_logger(__name__)

DENIED_SYSCALLS: tuple[str, ...] = (
    # Other processes: bwrap's init (the sandbox's pid 1) could be ptraced and its parent-death signal
    # cleared, and the sandbox would outlive its run.
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "process_madvise",
    "kcmp",
    "pidfd_getfd",
    # Kernel keyrings are not namespaced: they outlive a rollout and reach the worker's own keys.
    "keyctl",
    "add_key",
    "request_key",
    # Large kernel attack surface that no verifier program needs (secret memory also leaves holes in
    # the kernel's direct map of all memory).
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "userfaultfd",
    "perf_event_open",
    "bpf",
    "memfd_secret",
    # Mounts and namespaces: no nested user namespace, whose owner holds every capability inside it.
    # (clone with a namespace flag and clone3 are refused by the rules in `_deny_new_namespaces`.)
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "move_mount",
    "open_tree",
    "open_tree_attr",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "mount_setattr",
    "setns",
    "unshare",
    # Locks and change notification on files every sandbox shares (the read-only /usr): one sandbox
    # can see another's lock or read, a covert channel between concurrent rollouts. (fcntl's lock
    # and lease commands are refused by `_deny_file_locks`.)
    "flock",
    "inotify_init",
    "inotify_init1",
    "fanotify_init",
    # Opening a file by its handle bypasses the mount namespace: any file on a mounted filesystem.
    "open_by_handle_at",
    "name_to_handle_at",
    # Administering the machine: kernels, modules, power, swap, accounting, clocks, I/O ports, quotas.
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "reboot",
    "swapon",
    "swapoff",
    "acct",
    "settimeofday",
    "clock_settime",
    "clock_adjtime",
    "adjtimex",
    "iopl",
    "ioperm",
    "quotactl",
    "quotactl_fd",
    "lookup_dcookie",
    # The kernel log holds the host's messages and other sandboxes' crash lines.
    "syslog",
    # Legacy interfaces nothing current uses, with a history of exploitable bugs.
    "uselib",
    "_sysctl",
)
"""Refused with EPERM whatever their arguments. A name this libseccomp does not know, or that is not a
system call on this architecture, cannot be in the filter: `skipped_syscalls()` says which and why,
and building the filter logs them."""

# clone's flags that create a namespace. Flags are clone's first argument everywhere but s390,
# where the stack comes first.
_NAMESPACE_FLAGS = {
    "CLONE_NEWNS": 0x00020000,
    "CLONE_NEWCGROUP": 0x02000000,
    "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000,
    "CLONE_NEWUSER": 0x10000000,
    "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
}

# fcntl's commands that take or query a lock, a lease or a directory notification (the *64 names are
# the same numbers on 64-bit ABIs).
_LOCK_COMMANDS = sorted(
    {
        fcntl.F_GETLK,
        fcntl.F_SETLK,
        fcntl.F_SETLKW,
        fcntl.F_GETLK64,
        fcntl.F_SETLK64,
        fcntl.F_SETLKW64,
        fcntl.F_OFD_GETLK,
        fcntl.F_OFD_SETLK,
        fcntl.F_OFD_SETLKW,
        fcntl.F_SETLEASE,
        fcntl.F_GETLEASE,
        fcntl.F_NOTIFY,
    }
)

# Terminal ioctls that type into (TIOCSTI) or drive (TIOCLINUX) a terminal another process reads.
_TERMINAL_INJECTION = (termios.TIOCSTI, termios.TIOCLINUX)

# Socket families a program may open: local sockets, IP on the sandbox's own loopback, and netlink
# (how glibc lists interfaces). Every other family is refused as if the kernel lacked it: vsock
# reaches the hypervisor from any network namespace, and the rare families are attack surface.
_SOCKET_FAMILIES = (socket.AF_UNIX, socket.AF_INET, socket.AF_INET6, socket.AF_NETLINK)

_LOW_32_BITS = 0xFFFFFFFF
_UNKNOWN_TO_LIBSECCOMP = -1
"""What libseccomp resolves a name it does not know to (`__NR_SCMP_ERROR`); a name it knows that is not a
system call on the architecture resolves to some other negative pseudo-number."""


def _binding() -> ModuleType:
    """libseccomp's own Python binding, else pyseccomp (the same API over ctypes)."""
    try:
        import seccomp

        return seccomp
    except ImportError:
        pass
    try:
        import pyseccomp
    except (ImportError, RuntimeError, OSError) as exc:  # RuntimeError, OSError: pyseccomp found no libseccomp
        raise SandboxUnavailable(
            f"no libseccomp binding to build the sandbox's syscall filter with ({exc})",
            hint="pip install 'pyseccomp>=0.1.2' (it needs libseccomp: apt-get install libseccomp2), "
            "or use a Python that has Debian's python3-seccomp",
        ) from exc
    return pyseccomp


def _resolved(binding: ModuleType, name: str) -> int:
    """libseccomp's number for `name` on this machine's ABI; negative where there is nothing to filter."""
    try:
        return binding.resolve_syscall(binding.Arch.NATIVE, name)
    except ValueError:  # how a binding may say "unknown" instead of returning __NR_SCMP_ERROR
        return _UNKNOWN_TO_LIBSECCOMP


def _required_number(binding: ModuleType, name: str) -> int:
    number = _resolved(binding, name)
    if number < 0:  # a rule below would silently protect nothing: refuse to build a weaker filter
        raise SandboxUnavailable(
            f"the sandbox's syscall filter inspects {name}, which libseccomp does not know on this architecture",
            hint="run reward workers on x86_64 or aarch64",
        )
    return number


def _deny_listed(binding: ModuleType, syscalls, skipped: dict[str, str]) -> None:
    for name in DENIED_SYSCALLS:
        number = _resolved(binding, name)
        if number >= 0:
            syscalls.add_rule(binding.ERRNO(errno.EPERM), number)
        elif number == _UNKNOWN_TO_LIBSECCOMP:
            skipped[name] = "unknown to this libseccomp"
        else:
            skipped[name] = "not a system call on this architecture"


def _deny_new_namespaces(binding: ModuleType, syscalls) -> None:
    s390 = binding.system_arch() in (binding.Arch.S390, binding.Arch.S390X)
    flags_argument = 1 if s390 else 0
    clone = _required_number(binding, "clone")
    for flag in _NAMESPACE_FLAGS.values():  # one rule per flag: the rules of a syscall are OR'ed
        syscalls.add_rule(binding.ERRNO(errno.EPERM), clone, binding.Arg(flags_argument, binding.MASKED_EQ, flag, flag))
    # clone3 takes its flags in a struct seccomp cannot read. ENOSYS makes glibc fall back to clone,
    # whose flags the rules above inspect (what Flatpak and Docker do).
    syscalls.add_rule(binding.ERRNO(errno.ENOSYS), _required_number(binding, "clone3"))


def _deny_file_locks(binding: ModuleType, syscalls) -> None:
    # The kernel reads the command as 32 bits: compare only those, so set high bits are no way around.
    fcntl_number = _required_number(binding, "fcntl")
    for command in _LOCK_COMMANDS:
        syscalls.add_rule(
            binding.ERRNO(errno.EPERM), fcntl_number, binding.Arg(1, binding.MASKED_EQ, _LOW_32_BITS, command)
        )


def _deny_terminal_injection(binding: ModuleType, syscalls) -> None:
    ioctl = _required_number(binding, "ioctl")
    for request in _TERMINAL_INJECTION:  # 32 bits, as for fcntl (the high-bits bypass was CVE-2019-10063)
        syscalls.add_rule(binding.ERRNO(errno.EPERM), ioctl, binding.Arg(1, binding.MASKED_EQ, _LOW_32_BITS, request))


def _deny_personality_changes(binding: ModuleType, syscalls) -> None:
    """personality() only as PER_LINUX or the query: its flags turn off address-space randomization or
    make readable memory executable, for this process and everything it starts.

    libseccomp ANDs conditions only across different arguments, so "neither 0 nor 0xffffffff" is
    written as cases that cover it: a bit above the 32 the kernel reads, or two adjacent bits that
    differ (every 32-bit value but all zeros and all ones has such a pair)."""
    personality = _required_number(binding, "personality")
    deny = binding.ERRNO(errno.EPERM)
    syscalls.add_rule(deny, personality, binding.Arg(0, binding.GT, _LOW_32_BITS))
    for bit in range(31):
        pair = 0b11 << bit
        syscalls.add_rule(deny, personality, binding.Arg(0, binding.MASKED_EQ, pair, 0b01 << bit))
        syscalls.add_rule(deny, personality, binding.Arg(0, binding.MASKED_EQ, pair, 0b10 << bit))


def _deny_limits_of_others(binding: ModuleType, syscalls) -> None:
    """prlimit64 on another process: same-uid processes (the code_tests harness's parent, which never
    runs candidate code) would otherwise have their limits lowered under them by the candidate. Its
    own limits (pid 0, as glibc's setrlimit and getrlimit pass) stay its to read and lower."""
    prlimit64 = _resolved(binding, "prlimit64")
    if prlimit64 >= 0:
        syscalls.add_rule(binding.ERRNO(errno.EPERM), prlimit64, binding.Arg(0, binding.NE, 0))


def _deny_socket_families(binding: ModuleType, syscalls) -> None:
    socket_number = _required_number(binding, "socket")
    refused = binding.ERRNO(errno.EAFNOSUPPORT)
    highest = max(_SOCKET_FAMILIES)
    for family in range(highest):
        if family not in _SOCKET_FAMILIES:
            syscalls.add_rule(refused, socket_number, binding.Arg(0, binding.EQ, family))
    # Everything above, families added by later kernels and values with high bits set included.
    syscalls.add_rule(refused, socket_number, binding.Arg(0, binding.GE, highest + 1))


@functools.cache
def _compiled() -> tuple[bytes, dict[str, str]]:
    binding = _binding()
    syscalls = binding.SyscallFilter(binding.ALLOW)
    # A call through another ABI kills the whole process, not only the calling thread: a program
    # does not limp on with a thread gone, and its exit says SIGSYS.
    syscalls.set_attr(binding.Attr.ACT_BADARCH, binding.KILL_PROCESS)
    skipped: dict[str, str] = {}
    _deny_listed(binding, syscalls, skipped)
    _deny_new_namespaces(binding, syscalls)
    _deny_file_locks(binding, syscalls)
    _deny_terminal_injection(binding, syscalls)
    _deny_personality_changes(binding, syscalls)
    _deny_socket_families(binding, syscalls)
    _deny_limits_of_others(binding, syscalls)
    with tempfile.TemporaryFile() as program:
        syscalls.export_bpf(program)
        program.seek(0)
        compiled = program.read()
    if skipped:
        log.warning("system calls the sandbox's syscall filter cannot refuse here", skipped=skipped)
    return compiled, skipped


def filter_program() -> bytes:
    """The compiled BPF program (built once per process): what `bwrap --seccomp FD` reads."""
    return _compiled()[0]


def skipped_syscalls() -> dict[str, str]:
    """Names in `DENIED_SYSCALLS` left out of the filter here, each with why (unknown to this libseccomp,
    or not a system call on this architecture). Empty where every name is filtered."""
    return dict(_compiled()[1])


def filter_fd() -> int:
    """A new memfd holding `filter_program()`, at offset 0, for `bwrap --seccomp FD`.

    Close-on-exec: pass it with Popen's `pass_fds`, which makes it inheritable in the child only, and
    close it once bwrap has started (each sandbox reads its own copy to the end)."""
    program = filter_program()
    fd = os.memfd_create("sprawl-syscall-filter", os.MFD_CLOEXEC)
    try:
        written = 0
        while written < len(program):
            written += os.write(fd, program[written:])
        os.lseek(fd, 0, os.SEEK_SET)
    except OSError:
        os.close(fd)
        raise
    return fd


def syscall_number(name: str) -> int | None:
    """`name`'s number on this machine's ABI, as libseccomp knows it (None where it is no system call
    here): for the few calls the pool makes itself through libc's `syscall`, such as keyctl."""
    number = _resolved(_binding(), name)
    return number if number >= 0 else None

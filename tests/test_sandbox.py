"""Hostile programs are contained (reward 0, a precise error class), no process of theirs outlives its
run, and the sandbox stays healthy.

Limits are set so that each case ends the way it is meant to even on a loaded machine: CPU-bound
cases run with a wall timeout far above their CPU limit (a hang guard), and the wall-clock cases have
a pool of their own with a short timeout.
"""

import asyncio
import ctypes
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import structlog
from pydantic import ValidationError

from pipeline.sandbox import SandboxSettings, SandboxUnavailable, open_sandbox
from pipeline.sandbox import bubblewrap as bubblewrap_backend
from pipeline.sandbox.bubblewrap import BwrapSandboxPool, _become_subreaper, bwrap_argv, scratch_root
from pipeline.sandbox.cgroups import CgroupsUnavailable
from pipeline.sandbox.modal import modal_sandbox_request
from pipeline.sandbox.process import ProgramProcess, processes_of, reap_orphans, run_program
from pipeline.sandbox.uids import lease_uids
from workers.bench.hostile_programs import (
    CORRECT_ADD,
    SECRET_ENV,
    SECRET_FILE,
    add_group,
    catalogue,
    code_answer,
    open_listener,
)
from workers.rewards.verifiers import CodeTests

GROUP = add_group()
# Every case ends by itself well within the wall timeout, which is only a hang guard here.
LIMITS = SandboxSettings(pool_size=2, wall_timeout_s=120, cpu_seconds=1, max_processes=24)
# For the wall-clock cases: short, since their programs sleep until killed.
SHORT_WALL = LIMITS.model_copy(update={"pool_size": 1, "wall_timeout_s": 3})


@pytest.fixture
async def pool():
    p = BwrapSandboxPool(LIMITS)
    await p.start()
    yield p
    await p.close()


@pytest.fixture
async def short_pool():
    p = BwrapSandboxPool(SHORT_WALL)
    await p.start()
    yield p
    await p.close()


def _uid_of_sandbox(sandbox_id: str) -> int:
    return int(sandbox_id.split("-")[1])  # bwrap-<uid>-<hex>


async def _scores(pool: BwrapSandboxPool, code: str):
    return await CodeTests().verify(code_answer(code), GROUP, pool)


async def test_a_correct_answer_passes_and_a_wrong_one_names_the_case(pool):
    good = await _scores(pool, CORRECT_ADD)
    assert good.value == 1.0 and good.error_class is None and good.sandbox_id.startswith("bwrap-")
    bad = await _scores(pool, "def add(a, b):\n    return a - b")
    assert bad.value == 0.0 and bad.error_class == "test_failed" and bad.details["case"] == "0"


async def test_hostile_catalogue_is_contained(pool, short_pool, monkeypatch):
    secret_file = Path(f"{SECRET_FILE}-{uuid.uuid4().hex[:8]}")  # ours alone, whoever else runs this test
    secret_file.write_text("top secret")
    monkeypatch.setenv(SECRET_ENV, "also secret")
    listener = open_listener()
    try:
        for name, case in catalogue(listener.getsockname()[1], secret_file=str(secret_file)).items():
            chosen = short_pool if case.wall_clock else pool
            verdict = await _scores(chosen, case.code)
            assert verdict.value == 0.0, name
            assert verdict.error_class in case.classes, (name, verdict.error_class, verdict.details)
            shown = str(verdict.details)
            assert "top secret" not in shown and "also secret" not in shown, name
            assert not any(ch in "".join(verdict.details.values()) for ch in "\x1b\x07\x9b"), (name, shown)
            healthy = await _scores(chosen, CORRECT_ADD)
            assert healthy.value == 1.0, f"sandbox unhealthy after {name}: {healthy}"
    finally:
        listener.close()
        secret_file.unlink()
    assert os.path.exists("/usr/lib/sprawl-owned") is False
    for p in (pool, short_pool):
        await p.settled()
        assert p.retired == [], "every uid was cleaned after its run"
        await p.close()  # the warm sandboxes waiting for programs go too; nothing else may be left
        assert processes_of(p.uids) == [], "a sandboxed process outlived its run"


async def test_a_sandbox_that_ptraces_its_init_and_daemonizes_leaves_nothing_of_its_uid(short_pool):
    escape = catalogue(0)["ptrace_pid1_then_sleep"]
    verdict = await _scores(short_pool, escape.code)
    assert verdict.error_class == "timeout", verdict
    await short_pool.settled()
    assert processes_of((_uid_of_sandbox(verdict.sandbox_id),)) == []
    assert short_pool.retired == []


async def test_twenty_hostile_programs_at_once_then_eight_benign_ones_all_score_right(pool):
    cases = catalogue(0)
    hostile = [
        cases[name].code
        for name in (
            "fork_bomb",
            "memory_hog",
            "memfd_2gb",
            "inodes_100k",
            "cpu_spin",
            "daemon_outlives_run",
            "always_equal",
            "fake_verdict_then_exit",
            "kill_parent",
            "multi_gb_output",
        )
    ] * 2
    verdicts = await asyncio.gather(*(_scores(pool, code) for code in hostile))
    assert [v.value for v in verdicts] == [0.0] * 20, [(v.value, v.error_class) for v in verdicts]
    benign = await asyncio.gather(*(_scores(pool, CORRECT_ADD) for _ in range(8)))
    assert [v.value for v in benign] == [1.0] * 8, [(v.error_class, v.details) for v in benign]
    await pool.settled()
    assert pool.retired == []


_KEYCTL_READ = """
import ctypes, platform
nr = {"x86_64": (248, 250), "aarch64": (217, 219)}[platform.machine()]
libc = ctypes.CDLL(None, use_errno=True)
for spec in (-3, -4, -5):  # session, user, user-session keyrings
    print(libc.syscall(nr[1], 0, spec, 0), ctypes.get_errno())  # KEYCTL_GET_KEYRING_ID
print(libc.syscall(nr[0], b"user", b"planted-by-a-sandbox", b"x", 1, -4), ctypes.get_errno())
print(open("/proc/keys").read())
"""


async def test_no_keyring_is_shared_with_the_worker_or_another_sandbox(pool):
    libc = ctypes.CDLL(None, use_errno=True)
    planted = f"planted-by-the-worker-{uuid.uuid4().hex[:8]}".encode()
    add_key = {"x86_64": 248, "aarch64": 217}[os.uname().machine]
    serial = libc.syscall(add_key, b"user", planted, b"secret", 6, -3)  # into the worker's session keyring
    assert serial > 0, f"the test could not plant a key: errno {ctypes.get_errno()}"
    first = await pool.run(_KEYCTL_READ)
    second = await pool.run(_KEYCTL_READ)
    for result in (first, second):
        lines = result.stdout.splitlines()
        assert lines[:4] == [f"-1 {1}"] * 4, result  # every keyctl and add_key call: EPERM
        assert planted.decode() not in result.stdout and "planted-by-a-sandbox" not in result.stdout


_FROZEN_PROCESS_PER_UID = """
import os, signal, sys, time
from pathlib import Path

# A cgroup v1 freezer holds its tasks: a SIGKILL stays pending until they are thawed, as for a process
# stuck in the kernel. The test thaws and removes it.
frozen = Path(sys.argv[1])
frozen.mkdir()
for uid in map(int, sys.argv[2:]):
    if os.fork() == 0:
        os.setuid(uid)
        signal.pause()
        os._exit(0)
time.sleep(0.1)
for pid in Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read_text().split():
    (frozen / "cgroup.procs").write_text(pid)
(frozen / "freezer.state").write_text("FROZEN")
while "FROZEN" not in (frozen / "freezer.state").read_text():
    time.sleep(0.01)
print("ready", flush=True)
sys.stdin.read()
"""
_FREEZER = Path("/sys/fs/cgroup/freezer")


async def test_a_uid_that_cannot_be_cleaned_is_retired_and_replaced():
    pool = BwrapSandboxPool(LIMITS.model_copy(update={"pool_size": 1, "cleanup_patience_s": 0.5}))
    await pool.start()
    await pool.settled()  # its probe run's uid is clean again
    dirty = set(pool.uids)
    # A process of each of its uids that nothing can end: each uid fails its clean-up.
    assert _FREEZER.is_dir(), "this test needs the cgroup v1 freezer (CI and these machines mount it)"
    frozen = _FREEZER / f"sprawl-test-frozen-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    holder = subprocess.Popen(
        [sys.executable, "-c", _FROZEN_PROCESS_PER_UID, str(frozen), *map(str, pool.uids)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline() == "ready\n"
        for _ in range(5):
            retired_before = set(pool.retired)
            ran = await pool.run("print('ok')")
            assert ran.stdout == "ok\n", ran
            assert _uid_of_sandbox(ran.sandbox_id) not in retired_before, "a retired uid was used again"
            await pool.settled()
        assert pool.retired and set(pool.retired) <= dirty, pool.retired
        assert len(set(pool.uids) - dirty) == len(pool.retired), "a fresh uid was leased in place of each retired one"
    finally:
        holder.stdin.close()
        holder.wait(timeout=120)
        await pool.close()
        _kill_frozen(frozen)


def _kill_frozen(frozen: Path) -> None:
    if not frozen.is_dir():
        return
    for pid in (frozen / "cgroup.procs").read_text().split():
        os.kill(int(pid), signal.SIGKILL)  # pending until thawed
    (frozen / "freezer.state").write_text("THAWED")
    give_up = time.monotonic() + 300  # a hang guard: the kernel ends them as soon as they thaw
    while (frozen / "cgroup.procs").read_text().split():
        assert time.monotonic() < give_up
        time.sleep(0.01)
    frozen.rmdir()


async def _a_uid_a_sandbox_runs_as(pool: BwrapSandboxPool) -> int:
    """One of `pool`'s uids that a warm sandbox runs as: warm sandboxes are started in the background,
    and the uid the start probe used is cleaned and queued again, so no uid is busy at a fixed moment."""
    give_up = time.monotonic() + 300  # a hang guard only
    while not (busy := [uid for uid in pool.uids if processes_of((uid,))]):
        assert time.monotonic() < give_up, "no warm sandbox started"
        await asyncio.sleep(0.01)
    return min(busy)


async def test_uids_in_use_by_a_pool_that_leases_elsewhere_are_refused(pool, tmp_path):
    """Two workers with different lock folders (two containers on one host, say) must not share uids."""
    taken = await _a_uid_a_sandbox_runs_as(pool)
    other = BwrapSandboxPool(LIMITS.model_copy(update={"uid_base": taken, "uid_span": 8, "uid_lock_dir": tmp_path}))
    with pytest.raises(SandboxUnavailable, match="already in use on this host"):
        await other.start()
    await other.close()


async def test_reaping_orphans_while_a_program_runs_never_misreads_its_exit(pool):
    """`reap_orphans` runs after every sandbox; it must never take a process someone waits on."""
    stop = asyncio.Event()

    async def reaper() -> None:
        while not stop.is_set():
            reap_orphans(pool.uids)
            await asyncio.sleep(0)

    task = asyncio.create_task(reaper())
    try:
        spin = await pool.run("while True:\n    pass")
        exits = await pool.run("raise SystemExit(7)")
    finally:
        stop.set()
        await task
    # Taken from it, the program's CPU time would read about 0. (Not ">= cpu_seconds": rusage is sampled
    # at ticks and, on a loaded machine, trails the precise runtime the kernel checks the limit against.)
    assert spin.error_class == "cpu" and spin.cpu_seconds > LIMITS.cpu_seconds / 2, spin
    assert exits.exit_code == 7 and exits.error_class == "crash", exits


async def test_without_cgroups_the_pool_says_so_and_keeps_its_per_process_limits(monkeypatch):
    monkeypatch.setattr(bubblewrap_backend, "open_cgroups", lambda owner: CgroupsUnavailable("no cgroups in this test"))
    with structlog.testing.capture_logs() as logs:
        pool = BwrapSandboxPool(LIMITS)
        await pool.start()
    try:
        assert any("NO CGROUP" in entry["event"] and entry["log_level"] == "warning" for entry in logs), logs
        assert (await pool.run("x = bytearray(10 ** 10)")).error_class == "memory"
        assert (await _scores(pool, CORRECT_ADD)).value == 1.0
    finally:
        await pool.close()


async def test_environment_is_clean_and_root_is_absent(pool, monkeypatch):
    monkeypatch.setenv(SECRET_ENV, "also secret")
    result = await pool.run("import os\nprint(sorted(os.environ))\nprint(os.listdir('/'))\nprint(os.getcwd())")
    assert result.error_class is None
    assert SECRET_ENV not in result.stdout and "also secret" not in result.stdout
    assert "'root'" not in result.stdout.splitlines()[1] and "'etc'" not in result.stdout.splitlines()[1]
    assert result.stdout.splitlines()[2] == "/work"


async def test_a_cpu_limit_is_cpu_even_when_the_program_ignores_sigxcpu(pool):
    # Ignoring SIGXCPU only postpones it: the kernel SIGKILLs at the hard limit, a second later.
    stubborn = await pool.run("import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass")
    assert stubborn.signal == signal.SIGKILL and stubborn.error_class == "cpu", stubborn
    assert stubborn.cpu_seconds >= LIMITS.cpu_seconds
    # A SIGKILL it sends itself, long before its CPU limit, is not one.
    suicide = await pool.run("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)")
    assert suicide.signal == signal.SIGKILL and suicide.error_class == "killed", suicide


class _StallsTheLoopUntilExit(ProgramProcess):
    """Once the program is fed, blocks the event loop until the process has exited (without reaping
    it): the state a loaded machine leaves us in when a CPU-limited program ends near the deadline."""

    async def feed(self, data: bytes) -> None:
        await super().feed(data)
        asyncio.get_running_loop().call_soon(self._stall)

    def _stall(self) -> None:
        give_up = time.monotonic() + 300  # a hang guard
        while os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
            assert time.monotonic() < give_up, "the CPU-bound program never ended"
            time.sleep(0.02)


async def test_a_cpu_limit_kill_noticed_after_the_wall_deadline_is_cpu_not_timeout():
    settings = SandboxSettings(cpu_seconds=1, wall_timeout_s=0.5)  # 1 CPU second takes > 0.5 s of wall clock
    lease = lease_uids(1, uid_base=settings.uid_base, uid_span=settings.uid_span, lock_dir=settings.uid_lock_dir)
    helper_uid = lease.first if _become_subreaper() else None
    try:
        proc = _StallsTheLoopUntilExit.start(
            bwrap_argv(settings, lease.first), settings, env={"PATH": "/usr/bin"}, helper_uid=helper_uid
        )
        try:
            result = await run_program(proc, "stalled", "while True:\n    pass", settings)
        finally:
            await proc.finish()
    finally:
        lease.release()
    assert result.duration_s > settings.wall_timeout_s, "the exit was noticed after the deadline"
    assert not result.timed_out and result.error_class == "cpu", result


async def test_a_wall_clock_kill_is_a_timeout(short_pool):
    result = await short_pool.run("import time\ntime.sleep(600)")
    assert result.timed_out and result.error_class == "timeout", result


async def test_two_pools_at_once_run_as_disjoint_uids():
    first, second = BwrapSandboxPool(LIMITS), BwrapSandboxPool(LIMITS)
    await first.start()
    await second.start()
    try:
        assert set(first.uids).isdisjoint(second.uids)
        who = "import os\nprint(os.getuid())"
        ran_first, ran_second = await asyncio.gather(first.run(who), second.run(who))
        assert int(ran_first.stdout) in first.uids and int(ran_second.stdout) in second.uids
    finally:
        await first.close()
        await second.close()


def test_a_uid_lease_held_by_another_process_is_not_shared(tmp_path):
    """Two reward workers (or test suites) on one host: a private lock folder, so other suites don't count."""
    kwargs = {"uid_base": 61000, "uid_span": 64, "lock_dir": tmp_path}
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from pathlib import Path; from pipeline.sandbox.uids import lease_uids\n"
            f"lease = lease_uids(4, uid_base=61000, uid_span=64, lock_dir=Path({str(tmp_path)!r}))\n"
            "print(lease.first, flush=True); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        first_held = int(holder.stdout.readline())
        held = range(first_held, first_held + 4)
        mine = lease_uids(4, **kwargs)
        assert set(mine.uids).isdisjoint(held)
        mine.release()
    finally:
        holder.stdin.close()
        holder.wait(timeout=120)
    # The holder has exited, so its uids are free again (the kernel dropped its locks).
    everything = lease_uids(64, **kwargs)
    assert everything.uids == range(61000, 61064)
    everything.release()


def test_missing_bubblewrap_is_a_clear_error_never_a_fallback(monkeypatch, tmp_path):
    with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap"):
        open_sandbox(SandboxSettings(bwrap="/nonexistent/bwrap"))
    monkeypatch.setenv("PATH", str(tmp_path))  # a PATH without bwrap
    with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap"):
        BwrapSandboxPool(SandboxSettings())


def test_unknown_backend_names_the_known_ones():
    with pytest.raises(ValidationError, match="bwrap, modal, none"):
        open_sandbox(SandboxSettings(backend="docker"))


def test_modal_requests_carry_the_same_limits():
    request = modal_sandbox_request(SandboxSettings(wall_timeout_s=7, memory_mb=256), "print(1)")
    assert request["block_network"] is True and request["timeout"] == 7 and request["memory"] == 256
    assert request["args"][-1] == "print(1)"


_POOL_THAT_GETS_KILLED = """
import asyncio, sys
from pipeline.sandbox import SandboxSettings
from pipeline.sandbox.bubblewrap import BwrapSandboxPool

async def main():
    settings = SandboxSettings(pool_size=2, wall_timeout_s=600)
    pool = BwrapSandboxPool(settings)
    await pool.start()
    print("uids", *pool.uids, flush=True)
    daemon = "import os, time\\nif os.fork() == 0:\\n    os.setsid()\\nopen('/work/up', 'w').close()\\ntime.sleep(600)"
    running = asyncio.create_task(pool.run(daemon))
    while not any((pool.scratch.path(uid) / "work" / "up").exists() for uid in pool.uids):
        await asyncio.sleep(0.05)
    print("up", flush=True)  # the program runs, its daemon too
    await running

asyncio.run(main())
"""


def _mounted(paths: set[str]) -> set[str]:
    with open("/proc/self/mountinfo") as mountinfo:
        return {fields[4] for fields in map(str.split, mountinfo)} & paths


async def test_a_sigkilled_worker_leaves_nothing_the_next_pool_does_not_clean():
    worker = subprocess.Popen([sys.executable, "-c", _POOL_THAT_GETS_KILLED], stdout=subprocess.PIPE, text=True)
    for line in worker.stdout:  # its log lines come first
        if line.startswith("uids "):
            break
    uids = tuple(map(int, line.split()[1:]))
    assert uids, "the pool in the worker did not start"
    for line in worker.stdout:
        if line.startswith("up"):
            break
    worker.kill()  # SIGKILL: no finally, no close
    worker.wait(timeout=120)
    scratch = {str(scratch_root(LIMITS) / str(uid)) for uid in uids}
    cgroup_name = f"sprawl-sandbox-{worker.pid}-"
    cgroup_roots = [Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup/unified")]

    def leftover_cgroups() -> list[Path]:
        return [p for root in cgroup_roots if root.is_dir() for p in root.glob(f"**/{cgroup_name}*")]

    # Marked, since another suite's pool may lease these uids and mount its own scratch there meanwhile.
    marker = f"left-by-the-dead-pool-{uuid.uuid4().hex[:8]}"
    left = _mounted(scratch)
    assert left, "the killed worker left its scratch mounts (the state this test is about)"
    for path in left:
        (Path(path) / marker).touch()
    give_up = time.monotonic() + 300  # a hang guard: bwrap --die-with-parent ends them at once
    while processes_of(uids):  # a scratch something still runs in is never taken for a leftover
        assert time.monotonic() < give_up, processes_of(uids)
        await asyncio.sleep(0.05)
    # Above the dead pool's uids, so that what is mounted there afterwards can only be its leftovers.
    successor = BwrapSandboxPool(LIMITS.model_copy(update={"uid_base": max(uids) + 1}))
    await successor.start()
    try:
        assert not any((Path(path) / marker).exists() for path in scratch), "a dead pool's scratch was not detached"
        assert leftover_cgroups() == [], "a dead pool's cgroups were not swept"
    finally:
        await successor.close()

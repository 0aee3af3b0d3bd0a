"""Hostile programs are contained (reward 0, a precise error class) and the sandbox stays healthy.

Limits are set so that each case ends the way it is meant to even on a loaded machine: CPU-bound
cases run with a wall timeout far above their CPU limit (a hang guard), and the wall-clock case has
a pool of its own with a short timeout.
"""

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from pydantic import ValidationError

from pipeline.sandbox import SandboxSettings, SandboxUnavailable, open_sandbox
from pipeline.sandbox.bubblewrap import BwrapSandboxPool, _become_subreaper, bwrap_argv
from pipeline.sandbox.modal import modal_sandbox_request
from pipeline.sandbox.process import ProgramProcess, run_program
from pipeline.sandbox.uids import lease_uids
from schemas import PromptGroup
from workers.bench.hostile_programs import (
    SECRET_ENV,
    SECRET_FILE,
    WALL_CLOCK_CASES,
    catalogue,
    code_answer,
    open_listener,
)
from workers.rewards.verifiers import CodeTests

TESTS = "def test_adds():\n    assert add(2, 3) == 5\n\ndef test_negative():\n    assert add(-2, 1) == -1\n"
GROUP = PromptGroup(
    run_id="r",
    group_id="g",
    task="code",
    prompt="write add",
    prompt_token_ids=[1],
    n_samples=1,
    metadata={"tests": TESTS},
)
# Every case ends by itself well within the wall timeout, which is only a hang guard here.
LIMITS = SandboxSettings(pool_size=2, wall_timeout_s=120, cpu_seconds=1, max_processes=24)
# For the wall-clock case: short, since its program sleeps until killed.
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


def _processes_of(uids: range) -> list[str]:
    """Live (non-zombie) processes running as one of `uids`: only this pool's, whoever else runs sandboxes."""
    out = subprocess.run(["ps", "-eo", "uid=,stat=,args="], capture_output=True, text=True).stdout
    return [
        line
        for line in out.splitlines()
        if line.split()[0].isdigit() and int(line.split()[0]) in uids and not line.split()[1].startswith("Z")
    ]


async def test_a_correct_answer_passes_and_a_wrong_one_names_the_test(pool):
    good = await CodeTests().verify(code_answer("def add(a, b):\n    return a + b"), GROUP, pool)
    assert good.value == 1.0 and good.error_class is None and good.sandbox_id.startswith("bwrap-")
    bad = await CodeTests().verify(code_answer("def add(a, b):\n    return abs(a + b)"), GROUP, pool)
    assert bad.value == 0.0 and bad.error_class == "test_failed"
    assert bad.details["failed_test"] == "test_negative"
    missing = await CodeTests().verify(code_answer("print('no function here')"), GROUP, pool)
    assert missing.format_error and missing.value == 0.0


async def test_hostile_catalogue_is_contained(pool, short_pool, monkeypatch):
    secret_file = Path(f"{SECRET_FILE}-{uuid.uuid4().hex[:8]}")  # ours alone, whoever else runs this test
    secret_file.write_text("top secret")
    monkeypatch.setenv(SECRET_ENV, "also secret")
    listener = open_listener()
    try:
        cases = catalogue(listener.getsockname()[1], secret_file=str(secret_file))
        for name, (code, classes) in cases.items():
            chosen = short_pool if name in WALL_CLOCK_CASES else pool
            verdict = await CodeTests().verify(code_answer(code), GROUP, chosen)
            assert verdict.value == 0.0, name
            assert verdict.error_class in classes, (name, verdict.error_class, verdict.details)
            assert "top secret" not in str(verdict.details) and "also secret" not in str(verdict.details), name
            healthy = await CodeTests().verify(code_answer("def add(a, b):\n    return a + b"), GROUP, chosen)
            assert healthy.value == 1.0, f"sandbox unhealthy after {name}"
    finally:
        listener.close()
        secret_file.unlink()
    assert os.path.exists("/usr/lib/sprawl-owned") is False
    for p in (pool, short_pool):
        await p.close()  # the warm sandboxes waiting for programs go too; nothing else may be left
        assert _processes_of(p.uids) == [], "a sandboxed process outlived its run"


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

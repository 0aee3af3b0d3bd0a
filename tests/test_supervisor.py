"""The supervisor restarts crashed workers with backoff, leaves finished ones alone, and stops
everything it started, the workers' own children included."""

import os
import sys
import time

from workers.up.supervisor import Supervisor, WorkerSpec

HANG_GUARD_S = 300.0
"""How long a condition that must come true may take before the test calls it broken (never a measure:
python start-ups on a loaded machine take what they take)."""


def _spec(name: str, code: str) -> WorkerSpec:
    return WorkerSpec(name, [sys.executable, "-c", code], dict(os.environ))


def _wait_for(condition, step=None) -> None:
    """Until `condition()` holds (calling `step()` between looks), within the hang guard."""
    deadline = time.monotonic() + HANG_GUARD_S
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        if step is not None:
            step()
        time.sleep(0.05)


def test_a_crashing_worker_is_restarted_with_growing_backoff(tmp_path):
    supervisor = Supervisor(tmp_path, backoff_initial_s=0.1, backoff_max_s=0.4, healthy_after_s=60)
    worker = supervisor.add(_spec("crasher", "import sys; print('boom'); sys.exit(3)"))
    _wait_for(lambda: worker.restarts >= 3, supervisor.poll)
    supervisor.stop()
    assert worker.last_exit == 3
    assert worker.backoff_s == 0.4  # 0.1, 0.2, 0.4: doubled, then capped
    assert worker.crash_streak >= 3  # what makes `sprawl up` give up on a worker that cannot start
    assert any("crasher exited 3" in event for event in supervisor.events)
    assert worker.log_file.read_text().count("boom") >= 3
    assert supervisor.alive_pids() == []


def test_a_worker_that_exits_zero_has_finished_and_is_not_restarted(tmp_path):
    supervisor = Supervisor(tmp_path, backoff_initial_s=0.05)
    worker = supervisor.add(_spec("done", "pass"))
    _wait_for(lambda: worker.finished, supervisor.poll)
    # Past its backoff, a crashed worker would be started again at the next poll: a finished one is not.
    time.sleep(supervisor.backoff_initial_s * 2)
    supervisor.poll()
    assert worker.restarts == 0 and worker.state == "finished" and worker.process is None


def test_stop_leaves_no_process_behind_even_a_grandchild_or_one_ignoring_sigterm(tmp_path):
    supervisor = Supervisor(tmp_path)
    code = (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    worker = supervisor.add(_spec("stubborn", code))
    _wait_for(lambda: worker.log_file.read_text().strip())  # the grandchild's pid: both are running
    grandchild = int(worker.log_file.read_text().split()[0])
    supervisor.stop(grace_s=0.5)
    assert supervisor.alive_pids() == []
    # SIGKILLed with its process group; gone (or a zombie) as soon as the kernel has torn it down.
    _wait_for(lambda: not os.path.exists(f"/proc/{grandchild}") or "Z" in _state(grandchild))


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ", 1)[1][0]
    except OSError:
        return "Z"

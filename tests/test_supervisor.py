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


def test_a_restarted_workers_reason_is_the_last_line_it_printed_and_its_restarts_are_counted(tmp_path):
    supervisor = Supervisor(tmp_path, backoff_initial_s=0.05, backoff_max_s=0.1, healthy_after_s=60)
    code = (
        "import os, sys\n"
        'print(\'{"event": "loading", "level": "info"}\', flush=True)\n'
        "n = len(open(sys.argv[1]).read()) if os.path.exists(sys.argv[1]) else 0\n"
        "open(sys.argv[1], 'a').write('x')\n"
        "print(f'sprawl: error: the log did not answer (attempt {n})', file=sys.stderr)\n"
        "sys.exit(2)\n"
    )
    spec = WorkerSpec("flaky", [sys.executable, "-c", code, str(tmp_path / "attempts")], dict(os.environ))
    worker = supervisor.add(spec)
    _wait_for(lambda: worker.restarts >= 2 and worker.last_exit == 2, supervisor.poll)
    supervisor.stop()
    # The reason is this exit's, not an earlier one's: the log is appended to across restarts.
    attempts = len((tmp_path / "attempts").read_text())
    assert worker.last_reason in {
        f"sprawl: error: the log did not answer (attempt {n})" for n in (attempts - 2, attempts - 1)
    }
    assert "exited 2 after" in supervisor.events[0]
    assert supervisor.events[0].endswith(f"(see {worker.log_file})")
    assert ": sprawl: error: the log did not answer (attempt 0); restart 1 in " in supervisor.events[0]
    assert "(attempt 1); restart 2 in " in supervisor.events[1]


def test_exit_reason_reads_a_structlog_line_and_shortens_a_long_one(tmp_path):
    from workers.up.supervisor import exit_reason

    log_file = tmp_path / "w.log"
    log_file.write_text('old run\n{"event": "feed failed", "error": "LogUnavailable(...)", "level": "error"}\n')
    assert exit_reason(log_file, 0) == "feed failed LogUnavailable(...)"
    offset = log_file.stat().st_size
    assert exit_reason(log_file, offset) is None  # nothing printed by this start
    with log_file.open("a") as out:
        out.write("Traceback (most recent call last):\n  ...\nRuntimeError: " + "x" * 500 + "\n")
    reason = exit_reason(log_file, offset)
    assert reason.startswith("RuntimeError: xxx") and len(reason) == 240 and reason.endswith("…")

"""The launcher of a trainer of several ranks (`workers/trainer/launch.py`), against a stand-in for
torchrun: a stop is exit 0 only when rank 0 says it stopped cleanly (every computed version
published), and a rank refuses to run once its torchrun is gone.

The whole job under a real torchrun is `tests/test_trainer_ranks_faults.py` (slow)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.servers import HANG_GUARD_S

FAKE_TORCHRUN = textwrap.dedent(
    """
    import os, pathlib, signal, sys, time
    mode, ready = sys.argv[1], pathlib.Path(sys.argv[2])

    def stop(signum, frame):
        # What torchrun does on a stop: the ranks stop (rank 0 reports a clean one), then it exits 1.
        if mode == "clean":
            pathlib.Path(os.environ["SPRAWL_LAUNCHER_RESULT"]).write_text("stopped")
        sys.exit(1)

    signal.signal(signal.SIGTERM, stop)
    ready.write_text("up")
    while True:
        time.sleep(0.05)
    """
)

LAUNCHER = textwrap.dedent(
    """
    import sys
    from workers.trainer import launch
    from workers.trainer.settings import TrainerSettings

    launch.torchrun_command = lambda settings, argv: [sys.executable, "-c", sys.argv[1], sys.argv[2], sys.argv[3]]
    sys.exit(launch.launch_ranks(TrainerSettings(), []))
    """
)


def _stopped_launcher(tmp_path, mode: str) -> int:
    ready = tmp_path / "ready"
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, FAKE_TORCHRUN, mode, str(ready)])
    try:
        while not ready.exists():
            assert launcher.poll() is None, "the launcher ended before its torchrun started"
            time.sleep(0.02)  # polling a file the stand-in writes: no deadline, only a wait
        launcher.send_signal(signal.SIGTERM)
        return launcher.wait(timeout=HANG_GUARD_S)
    finally:
        launcher.kill()


@pytest.mark.parametrize(("mode", "clean"), [("clean", True), ("failed_drain", False)])
def test_a_stop_is_exit_0_only_when_rank_0_stopped_cleanly(tmp_path, mode, clean):
    """torchrun exits 1 after any forwarded stop; the launcher must not read a drain that failed (a
    computed version left unpublished) as a finished job, which a supervisor would not restart."""
    code = _stopped_launcher(tmp_path, mode)
    assert (code == 0) == clean, code


def test_a_rank_whose_parent_is_not_torchrun_refuses_to_run():
    """A rank ties its life to torchrun (SIGTERM when it dies); one whose torchrun is already gone (it
    was re-parented) must not go on holding the run's lease."""
    probe = textwrap.dedent(
        """
        from workers.trainer.launch import LauncherGone, die_with_torchrun
        try:
            die_with_torchrun()
        except LauncherGone as exc:
            print("refused:", exc.message)
        """
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert "refused:" in out.stdout and "not a running torchrun" in out.stdout, out.stdout + out.stderr

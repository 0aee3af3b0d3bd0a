"""`sprawl trainer` with `trainer.ranks > 1`: the same command again under torchrun, one process per rank.

torchrun (torch.distributed.run, shipped with torch) gives every rank its RANK / WORLD_SIZE and a
rendezvous on a free local port (`--standalone`), watches them, and when one fails or is killed stops
the others and starts them all again (`trainer.max_restarts` times): each start recovers from the
newest checkpoint and re-derives later versions from their lineage, as a single trainer does. Across
hosts, run torchrun yourself with `--nnodes` and a rendezvous endpoint (README).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from pipeline.errors import SprawlError
from pipeline.logs import get_logger
from workers.trainer.settings import TrainerSettings

log = get_logger(__name__)

STOP_RESULT_ENV = "SPRAWL_LAUNCHER_RESULT"
"""Where rank 0 writes `stopped` when it returns from a clean stop (every computed version published):
torchrun ends a requested stop with its own exit code whatever the ranks did, so the launcher reads
this file to tell a clean stop from a failed drain."""
CLEAN_STOP = "stopped"


class LauncherGone(SprawlError):
    """A rank whose torchrun died before this rank could tie its life to it."""


def torchrun_command(settings: TrainerSettings, argv: list[str]) -> list[str]:
    cfg = settings.trainer
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={cfg.ranks}",
        f"--max-restarts={cfg.max_restarts}",
        "--monitor-interval=1",
        "-m",
        "workers.cli",
        *argv,
    ]


def launch_ranks(settings: TrainerSettings, argv: list[str]) -> int:
    """Run the trainer's ranks under torchrun and return its exit code. SIGTERM and SIGINT go to
    torchrun, which passes them to the ranks: rank 0 stops the run as a single trainer does (every
    computed version published) and tells the others to return."""
    command = torchrun_command(settings, argv)
    log.info("launching trainer ranks", ranks=settings.trainer.ranks, max_restarts=settings.trainer.max_restarts)
    with tempfile.TemporaryDirectory(prefix="sprawl-launcher-") as tmp:
        result = Path(tmp) / "rank0.result"
        code, stopping = _run_torchrun(command, {**os.environ, STOP_RESULT_ENV: str(result)})
        clean = result.exists() and result.read_text() == CLEAN_STOP
    if stopping and code != 0:
        # torchrun ends a requested stop with its own SignalException (exit 1) after the ranks stopped: a
        # clean stop is not a crash (a supervisor would restart it), a failed drain is one.
        if clean:
            log.info("trainer ranks stopped on request", signal=signal.Signals(stopping[0]).name, torchrun_exit=code)
            return 0
        log.error(
            "trainer ranks stopped on request, but rank 0 did not finish cleanly (a computed version may be"
            " unpublished): see the ranks' errors above",
            signal=signal.Signals(stopping[0]).name,
            torchrun_exit=code,
        )
    return code


def _run_torchrun(command: list[str], env: dict[str, str]) -> tuple[int, list[int]]:
    """torchrun's exit code, and the stop signals this process forwarded to it."""
    # torchrun dies with this process (SIGKILLed by a supervisor or the OOM killer): its ranks, each in a
    # session of their own, would otherwise go on holding the run's lease beside the restarted launcher.
    process = subprocess.Popen(command, preexec_fn=_die_with_parent, env=env)
    stopping: list[int] = []

    def forward(signum, _frame) -> None:
        stopping.append(signum)
        process.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = process.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return code, stopping


def report_clean_stop() -> None:
    """Rank 0, returning from a stop with every computed version published: tell the launcher."""
    if path := os.environ.get(STOP_RESULT_ENV):
        Path(path).write_text(CLEAN_STOP)


def die_with_torchrun() -> None:
    """A rank: SIGTERM when torchrun dies (SIGKILLed, OOM-killed). Without it the ranks, in sessions of
    their own, go on (rank 0 renewing the run's lease) beside the launcher's next torchrun. On SIGTERM
    rank 0 stops as on any stop and tells the others to return (they ignore SIGTERM)."""
    parent = os.getppid()
    _die_with_parent()
    # torchrun may have died before the line above: then this rank was already re-parented.
    if os.getppid() != parent or not _is_torchrun(parent):
        raise LauncherGone(
            f"this trainer rank's parent (pid {parent}) is not a running torchrun: its launcher is gone",
            hint="start ranks with `sprawl trainer --trainer.ranks N` or `torchrun ... -m workers.cli trainer`",
        )


def _is_torchrun(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"torch.distributed.run" in cmdline or b"torchrun" in cmdline


def _die_with_parent() -> None:
    """SIGTERM this process when its parent dies (Linux prctl PR_SET_PDEATHSIG); in a child before exec,
    or in a process tying itself to its parent."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)

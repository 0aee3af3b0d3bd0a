"""`sprawl trainer` with `trainer.ranks > 1`: the same command again under torchrun, one process per rank.

torchrun (torch.distributed.run, shipped with torch) gives every rank its RANK / WORLD_SIZE and a
rendezvous on a free local port (`--standalone`), watches them, and when one fails or is killed stops
the others and starts them all again (`trainer.max_restarts` times): each start recovers from the
newest checkpoint and re-derives later versions from their lineage, as a single trainer does. Across
hosts, run torchrun yourself with `--nnodes` and a rendezvous endpoint (README).
"""

from __future__ import annotations

import signal
import subprocess
import sys

from pipeline.logs import get_logger
from workers.trainer.settings import TrainerSettings

log = get_logger(__name__)


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
    # torchrun dies with this process (SIGKILLed by a supervisor or the OOM killer): its ranks, each in a
    # session of their own, would otherwise go on holding the run's lease beside the restarted launcher.
    process = subprocess.Popen(command, preexec_fn=_die_with_parent)
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
    if stopping and code != 0:
        # torchrun ends a requested stop with its own SignalException (exit 1) after the ranks stopped:
        # a stop is not a crash (a supervisor would restart it). The ranks' own errors are in their log.
        log.info("trainer ranks stopped on request", signal=signal.Signals(stopping[0]).name, torchrun_exit=code)
        return 0
    return code


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it when this process dies (Linux prctl PR_SET_PDEATHSIG)."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)

"""The base policy's warm-up, run in a child process that `sprawl up` can stop at any moment.

In a thread of `up` itself the warm-up could not be interrupted: a thread cannot be cancelled, so a
SIGTERM waited for the last of its 550 steps, and a Ctrl-C left torch's threads running while the
interpreter exited (`terminate called without an active exception`, exit 134). A child process is
stopped like a worker: SIGTERM to its process group, SIGKILL after a grace period; it dies with `up`
if `up` is SIGKILLed. It runs on the workers' thread budget (`trainer.threads` torch threads, and
the same in the OpenMP/MKL variables), not torch's default of one thread per core: on a loaded
machine that default turned a 1-minute warm-up into 25.

The child speaks one JSON object per line on stdout: `{"step", "total", "loss"}` as it trains, then
`{"model_dir"}`. A cached model is answered by the parent without starting a child.

The addition demo warms up its own tiny model (`workers/up/demo_task.py`); a file task run without
`--model` warms up a character-level one on its rows (`workers/tasks/char_model.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from pipeline.errors import SprawlError
from pipeline.logs import get_logger
from workers.tasks.registry import TaskSpec
from workers.up.options import TaskSettings

log = get_logger(__name__)

STOP_GRACE_S = 5.0
"""How long a stopped warm-up may take to exit after SIGTERM before it is SIGKILLed."""


class WarmupFailed(SprawlError):
    """The warm-up process exited without a model."""


def thread_env(env: dict[str, str], threads: int) -> dict[str, str]:
    """`env` with every thread pool torch may use limited to `threads`."""
    return env | {name: str(threads) for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")}


async def warm_up(
    state_dir: Path,
    cfg: TaskSettings,
    *,
    threads: int,
    env: dict[str, str],
    on_step: Callable[[int, int, float], None] | None = None,
    spec: TaskSpec | None = None,
) -> Path:
    """The warmed-up base policy's directory: from the cache, else trained by a child process on
    `threads` threads. Cancelling this stops the child (SIGTERM, then SIGKILL) before returning.
    `spec`: a file task's (its character-level model); None: the addition demo's."""
    cached = _cached(state_dir, cfg, spec)
    if cached is not None:
        return cached
    from workers.up.supervisor import die_with_parent

    task = "-" if spec is None else spec.model_dump_json()
    argv = [sys.executable, "-m", "workers.up.warmup", str(state_dir), cfg.model_dump_json(), str(threads), task]
    process = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=thread_env(env, threads),
        start_new_session=True,  # a terminal's Ctrl-C reaches `up`, which stops it
        preexec_fn=die_with_parent,
    )
    steps = cfg.warmup_steps if spec is None else spec.warmup_steps
    log.info("warm-up started", pid=process.pid, threads=threads, steps=steps)
    stderr = asyncio.create_task(process.stderr.read())  # type: ignore[union-attr]
    model_dir: Path | None = None
    try:
        async for line in process.stdout:  # type: ignore[union-attr]
            try:
                message = json.loads(line)
            except ValueError:
                continue  # not ours (a library printing to stdout)
            if "model_dir" in message:
                model_dir = Path(message["model_dir"])
            elif on_step is not None and "step" in message:
                on_step(message["step"], message["total"], message["loss"])
        code = await process.wait()
    finally:
        if process.returncode is None:
            await _stop(process)
        errors = (await stderr).decode(errors="replace").strip().splitlines()
    if code != 0 or model_dir is None:
        reason = errors[-1] if errors else f"exit {code}"
        raise WarmupFailed(f"the warm-up process exited {code}: {reason}", hint="see `sprawl up`'s log")
    return model_dir


def _cached(state_dir: Path, cfg: TaskSettings, spec: TaskSpec | None) -> Path | None:
    if spec is None:
        from workers.up.demo_task import cached_model

        return cached_model(state_dir, cfg)
    from workers.tasks.char_model import cached_model as cached_task_model

    return cached_task_model(state_dir, spec, cfg.seed)


async def _stop(process: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        await asyncio.wait_for(asyncio.shield(process.wait()), STOP_GRACE_S)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        await process.wait()
    log.info("warm-up stopped", pid=process.pid, exit_code=process.returncode)


def main(argv: list[str]) -> int:
    state_dir, task, threads = Path(argv[0]), TaskSettings.model_validate_json(argv[1]), int(argv[2])
    spec = TaskSpec.model_validate_json(argv[3]) if len(argv) > 3 and argv[3] != "-" else None
    import torch

    torch.set_num_threads(threads)
    torch.set_num_interop_threads(threads)

    def report(step: int, total: int, loss: float) -> None:
        print(json.dumps({"step": step, "total": total, "loss": loss}), flush=True)

    if spec is None:
        from workers.up.demo_task import warmed_up_model

        model_dir = warmed_up_model(state_dir, task, report)
    else:
        from workers.tasks.char_model import warmed_up_model as warmed_up_task_model

        model_dir = warmed_up_task_model(state_dir, spec, task.seed, report)
    print(json.dumps({"model_dir": str(model_dir)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

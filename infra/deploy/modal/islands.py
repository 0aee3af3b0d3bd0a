"""Sampler islands as Modal GPU functions, joined to a run with a token held in a Modal Secret.

    modal secret create sprawl-join SPRAWL_JOIN="$(cat island.token)"     # sprawl token create --role sampler
    modal run infra/deploy/modal/islands.py                               # one bf16 and one fp8_e4m3 island
    modal run infra/deploy/modal/islands.py --views fp8_e4m3 --per-view 4 --gpus H100,L4

Each island is one call of `island`: a container with one GPU that runs `sprawl sampler` until the
call's timeout (24 h, Modal's longest), then ends; run the command again to keep the fleet. With
`--gpus`, islands are spread round-robin over those types; without it, each island takes the first
type of ISLAND_GPUS that Modal has free (Modal's GPU fallback list).

The plan (which islands, on which GPUs, with which command) is plain Python below, unit-tested
without Modal; the Modal part builds the app from it (tests/test_deploy_launchers.py imports this file
and checks the functions it defines; no Modal account is needed for that, nor reached).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import modal

APP_NAME = "sprawl-islands"
SECRET_NAME = "sprawl-join"
"""The Modal Secret that holds SPRAWL_JOIN, the island's join token (read by `sprawl sampler` itself:
never on a command line)."""
ISLAND_GPUS = ("H100", "A100-80GB", "L4")
"""Accelerator types islands run on, in order of preference (Modal's names)."""
VIEWS = ("bf16", "fp8_e4m3", "mxfp4")
"""The served views an island can take (workers/sampler/settings.py: ViewName; a test keeps them equal)."""
TORCH = "torch==2.13.0"
"""The README's install: this torch first (on Linux, PyPI's build of it is the CUDA one), then sprawl."""
TIMEOUT_S = 24 * 3600
"""Modal's longest function timeout: an island serves for a day per call."""
STATE_DIR = "/tmp/sprawl"
"""Where the island writes its credentials (from the token) and its materialized versions."""
REPO_ROOT = Path(__file__).resolve().parents[3]
IGNORED = [".git", ".sprawl", "**/__pycache__", "*.egg-info", ".venv", "**/.pytest_cache"]
"""Not copied into the image: history, local state and caches."""


@dataclass(frozen=True)
class IslandLaunch:
    view: str
    gpu: str | list[str]
    """One type, or a fallback list that Modal tries in order."""


def island_command(view: str) -> list[str]:
    """What an island container runs: the reference engine on the container's GPU."""
    if view not in VIEWS:
        raise ValueError(f"unknown view {view!r}: one of {', '.join(VIEWS)}")
    return ["sprawl", "sampler", "--island.view", view, "--island.device", "cuda"]


def island_env() -> dict[str, str]:
    return {"SPRAWL_STATE_DIR": STATE_DIR, "SPRAWL_LOG_FORMAT": "json"}


def island_plan(views: list[str], per_view: int, gpus: list[str] | None = None) -> list[IslandLaunch]:
    """`per_view` islands of each view; with `gpus`, their types round-robin over those, else each
    one takes the first free type of ISLAND_GPUS."""
    if per_view < 1:
        raise ValueError(f"per_view must be at least 1 (got {per_view})")
    unknown = [g for g in gpus or [] if g not in ISLAND_GPUS]
    if unknown:
        raise ValueError(f"unknown GPU type(s) {', '.join(unknown)}: one of {', '.join(ISLAND_GPUS)}")
    for view in views:
        island_command(view)  # refuses an unknown view before anything starts
    launches = []
    for view in views:
        for index in range(per_view):
            gpu: str | list[str] = gpus[index % len(gpus)] if gpus else list(ISLAND_GPUS)
            launches.append(IslandLaunch(view, gpu))
    return launches


# ---------------------------------------------------------------- the Modal app

# Debian + pip, as the Containerfile builds its image: the README's install of this checkout.
image = (
    modal.Image.debian_slim(python_version="3.11")
    .pip_install(TORCH)
    .add_local_dir(REPO_ROOT, remote_path="/opt/sprawl", copy=True, ignore=IGNORED)
    .run_commands("pip install /opt/sprawl")
    .env(island_env())
)

app = modal.App(APP_NAME, image=image)


@app.function(
    gpu=list(ISLAND_GPUS),
    secrets=[modal.Secret.from_name(SECRET_NAME, required_keys=["SPRAWL_JOIN"])],
    timeout=TIMEOUT_S,
    # Versions are materialized on the container's disk: `keep_versions` (2) copies of the view.
    ephemeral_disk=256 * 1024,
)
def island(view: str = "bf16") -> int:
    """Serve `view` until the call's timeout; the island drains on SIGTERM like anywhere else."""
    import subprocess

    done = subprocess.run(island_command(view), check=False)
    if done.returncode != 0:
        raise RuntimeError(f"sprawl sampler exited with {done.returncode}: see the container's log")
    return done.returncode


@app.local_entrypoint()
def main(views: str = "bf16,fp8_e4m3", per_view: int = 1, gpus: str = "") -> None:
    plan = island_plan(views.split(","), per_view, gpus.split(",") if gpus else None)
    calls = [island.with_options(gpu=launch.gpu).spawn(launch.view) for launch in plan]
    for launch, call in zip(plan, calls, strict=True):
        print(f"island {launch.view} on {launch.gpu}: {call.object_id}")
    for call in calls:
        call.get()

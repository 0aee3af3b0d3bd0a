"""`sprawl bench sync`: from a version's append to every island serving it, patch path vs keyframe path.

The trainer side publishes versions of a Qwen3-MoE (Adam-sized steps, lr 1e-6) through the real
ChainPublisher; 1, 2 and 4 island processes follow the chain (materialize, verify, commit to the
reference engine). Latency per island and version = the moment the island serves the version minus
the moment its event was appended. The patch path (one keyframe, then patches) and the keyframe
path (every version a keyframe, downloaded whole: each is published by a fresh publisher, which holds
no earlier version to ship a patch onto the keyframe from) run in the same invocation on the same
machine; their ratio is the figure. The pause is the time the engine stopped serving to commit the
new weights.

Everything here is on one machine, so downloads run at loopback speed and local work (reading,
verifying and writing the version, loading it into the engine) dominates both paths. The same
runs are repeated with each island's downloads capped at 1 Gbit/s (`blobs.max_download_mbps`),
a cross-region link, where bytes on the wire dominate as they do in production.

Versions are signed and islands pin the key, as in a real run; on the (secure) private stack each island
connects with the sampler's own identity. `--wan` replaces the download cap with real links: islands in
network namespaces of their own behind tbf-shaped links, joined by tokens (`workers/bench/wan_bench.py`).

What a version costs an island's disk: each island reports, per version, the bytes its build made the
kernel write (`written_bytes`: page-cache pages dirtied, downloads included) and the bytes of the tensors
that differ from the version it started from (`changed_tensor_bytes`); `disk_bytes_vs_patch_tensor_bytes`
is their ratio over every patch-path version (goal <= 2). Dirty pages are written back (`os.sync`) before
each version is published, outside the timed window: a page still dirty from an earlier version would be
counted once, not per version, and in a real run versions are far enough apart for writeback to finish.

Scaling: the patch path's latency (1 island, loopback) for the bench model and one with >= 4x the
parameters (more layers of the same sizes, the same Adam-sized steps, so the same density), measured back
to back: `patch_time_ratio_large_vs_small` against `patch_bytes_ratio_large_vs_small`, and their quotient
`patch_time_vs_bytes_scaling` (goal <= 1.5: time follows what changed, not the model's size).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from infra import stack
from infra.streams import apply
from pipeline.blobstore import open_blob_store
from pipeline.chain_publish import ChainPublisher
from pipeline.config import ChainSettings
from pipeline.eventlog import EventLog
from pipeline.logs import configure_logging
from pipeline.version_signing import generate_signing_key, public_key_text
from workers.bench.delta_bench import moe_config
from workers.bench.private_stack import private_stack


class IslandProcess:
    """An `island_proc` child: its commits by version, as it reports them on stdout (its logs: `log_file`)."""

    def __init__(self, proc: asyncio.subprocess.Process, log_file: Path):
        self.proc = proc
        self.log_file = log_file
        self.commits: dict[int, dict] = {}
        self.ready = asyncio.Event()
        self.reader = asyncio.create_task(self._read())

    async def wait_ready(self, timeout_s: float) -> None:
        """Until it follows the chain; one that exits or hangs first raises with the tail of its log."""
        waiting = asyncio.create_task(self.ready.wait())
        exited = asyncio.create_task(self.proc.wait())
        await asyncio.wait([waiting, exited], timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
        exited.cancel()
        if not self.ready.is_set():
            tail = self.log_file.read_text()[-2000:] if self.log_file.exists() else ""
            raise RuntimeError(f"an island did not start (exit {self.proc.returncode}): {tail}")

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        async for line in self.proc.stdout:
            if not line.startswith(b"{"):
                continue  # not a report (a library that prints); the reports are JSON objects
            record = json.loads(line)
            if record.get("ready"):
                self.ready.set()
            elif "version" in record:
                self.commits[record["version"]] = record

    async def stop(self) -> None:
        if self.proc.returncode is None:
            self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), 20)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        self.reader.cancel()


SCALE = 4.0
"""The large model of the scaling measurement has at least this many times the bench model's parameters."""


def _parameters(config) -> int:
    from transformers import Qwen3MoeForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in Qwen3MoeForCausalLM(config).parameters())


def scaled_config(quick: bool):
    """The bench model with more layers of the same sizes: the fewest giving >= SCALE x its parameters."""
    config = moe_config(quick)
    base = _parameters(config)
    while _parameters(config) < SCALE * base:
        config.num_hidden_layers += 1
    return config


def moe_state(quick: bool, config=None) -> tuple[dict, dict[str, torch.Tensor]]:
    """The benchmark's Qwen3-MoE (or `config`): its config and a detached copy of its weights (seed 0)."""
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config or moe_config(quick))
    return model.config.to_dict(), {k: v.detach().clone() for k, v in model.state_dict().items()}


def adam_sized_step(state: dict[str, torch.Tensor], generator: torch.Generator) -> None:
    """Every weight moved by ±1e-6 (Adam's per-weight step at lr 1e-6): most served bits stay the same."""
    with torch.no_grad():
        for tensor in state.values():
            tensor.add_(torch.randn(tensor.shape, generator=generator).sign() * 1e-6)


async def _start_islands(
    settings, run_id: str, count: int, cache_root: Path, link_mbps: float | None, public_key: str
) -> list[IslandProcess]:
    # The run's sampler identity is made here, once: islands taking it on first use at the same moment
    # would race to create the same S3 user. Each island then reads it from the stack's identities.
    stack.with_role(settings.model_copy(update={"run_id": run_id}), "sampler")
    islands = []
    for i in range(count):
        env = {
            **os.environ,
            "SPRAWL_RUN_ID": run_id,
            # The island takes the sampler's identity on the private stack, and pins the bench's version key.
            "SPRAWL_STATE_DIR": str(settings.state_dir),
            "SPRAWL_TRUST__VERSION_PUBLIC_KEY": public_key,
            "SPRAWL_NATS__URL": settings.nats.url,
            "SPRAWL_BLOBS__ENDPOINT_URL": settings.blobs.endpoint_url,
            "SPRAWL_ISLAND__ISLAND_ID": f"{run_id}-{i}",
            "SPRAWL_ISLAND__POLL_INTERVAL_S": "5",
            "SPRAWL_ISLAND__MATERIALIZE__CACHE_DIR": str(cache_root / f"island-{i}"),
            "OMP_NUM_THREADS": "1",
        }
        if link_mbps:
            env["SPRAWL_BLOBS__MAX_DOWNLOAD_MBPS"] = str(link_mbps)
        log_file = cache_root / f"island-{i}.log"
        log_file.parent.mkdir(parents=True, exist_ok=True)
        with log_file.open("w") as log:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "workers.bench.island_proc", env=env, stdout=asyncio.subprocess.PIPE, stderr=log
            )
        islands.append(IslandProcess(proc, log_file))
    for island in islands:
        await island.wait_ready(120)
    return islands


async def wait_all(islands: list[IslandProcess], version: int, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(version in i.commits for i in islands):
        if time.monotonic() > deadline:
            raise TimeoutError(f"islands did not reach version {version}")
        if any(i.proc.returncode is not None for i in islands):
            raise RuntimeError("an island process exited")
        await asyncio.sleep(0.005)


async def _one_run(
    settings,
    event_log,
    path: str,
    count: int,
    versions: int,
    quick: bool,
    tmp: Path,
    link_mbps: float | None,
    *,
    config=None,
    label: str = "",
) -> dict:
    run_id = f"sync-{path}-{count}-{'wan' if link_mbps else 'lo'}{label}"
    await apply(event_log.js, settings.streams, run_id)
    model_config, state = moe_state(quick, config)
    key = generate_signing_key()

    def new_publisher() -> ChainPublisher:
        return ChainPublisher(
            event_log,
            open_blob_store(settings.blobs),
            run_id=run_id,
            model_config=model_config,
            settings=ChainSettings(views=["bf16"], keyframe_every=1 if path == "keyframe" else 1_000_000),
            signing_key=key,
        )

    publisher = new_publisher()
    event0 = await publisher.publish(0, state)
    islands = await _start_islands(settings, run_id, count, tmp / run_id, link_mbps, public_key_text(key))
    latencies, pauses, verified = [], [], True
    profiles: list[dict[str, float]] = []
    written = changed = 0
    try:
        await wait_all(islands, 0)
        gen = torch.Generator().manual_seed(1)
        verified &= all(i.commits[0]["root_hash"] == event0.views[0].root_hash for i in islands)
        for version in range(1, versions + 1):
            adam_sized_step(state, gen)
            os.sync()  # the islands' earlier writes reach the disk first (see the module's docstring)
            if path == "keyframe":
                # A keyframe also ships a patch from the version before, which a follower would take instead:
                # a publisher that holds no earlier version (as after a restart) ships the keyframe alone.
                publisher.close()
                publisher = new_publisher()
                await publisher.open()
            event = await publisher.publish(version, state)
            appended = time.time()
            await wait_all(islands, version)
            for island in islands:
                record = island.commits[version]
                latencies.append(record["committed_at"] - appended)
                pauses.append(record["pause_s"])
                profiles.append(_profile(record["committed_at"] - appended, record))
                verified &= record["root_hash"] == event.views[0].root_hash
                written += record.get("written_bytes", 0)
                changed += record.get("changed_tensor_bytes", 0)
        bytes_per_version = event.views[0].bytes
    finally:
        for island in islands:
            await island.stop()
        publisher.close()
    return {
        "link": f"{link_mbps:g} Mbit/s" if link_mbps else "loopback",
        "path": path,
        "islands": count,
        "p50_s": statistics.median(latencies),
        "max_s": max(latencies),
        "pause_p50_s": statistics.median(pauses),
        "bytes_per_version": bytes_per_version,
        "verified": verified,
        "parameters": sum(t.numel() for t in state.values()),
        "written_bytes": written,
        "changed_tensor_bytes": changed,
        "profiles": profiles,
    }


BUILD_PHASES = ("fetch", "stage", "apply", "finish")
"""`Materialized.seconds`: blobs fetched, a slot made ready, patches applied in place, hashes checked
and the slot switched in."""


def _profile(total_s: float, record: dict) -> dict[str, float]:
    """Where one version's trip to one island went: the build's phases, the engine's load, and the rest
    (`other`: noticing the event, checking its signature, planning the route, scheduling)."""
    build = {phase: record.get("build_s", {}).get(phase, 0.0) for phase in BUILD_PHASES}
    engine = record["pause_s"]
    return {"total": total_s, **build, "engine_load": engine, "other": total_s - sum(build.values()) - engine}


def median_profile(profiles: list[dict[str, float]]) -> dict[str, float]:
    """The median of each part over versions and islands (the parts' medians need not sum to the
    total's)."""
    if not profiles:
        return {}
    return {part: round(statistics.median(p[part] for p in profiles), 4) for part in profiles[0]}


async def _scaling(settings, event_log, quick: bool, versions: int, tmp: Path) -> dict:
    """The patch path (1 island, loopback) for the bench model and the >= 4x one, back to back."""
    small = await _one_run(settings, event_log, "patch", 1, versions, quick, tmp, None, label="-small")
    large = await _one_run(
        settings, event_log, "patch", 1, versions, quick, tmp, None, config=scaled_config(quick), label="-large"
    )
    time_ratio = large["p50_s"] / small["p50_s"]
    bytes_ratio = large["bytes_per_version"] / small["bytes_per_version"]
    return {
        "scaling": {
            name: {
                "parameters": row["parameters"],
                "patch_bytes": row["bytes_per_version"],
                "p50_s": round(row["p50_s"], 4),
                "written_bytes_per_version": row["written_bytes"] // versions,
                "verified": row["verified"],
            }
            for name, row in (("small", small), ("large", large))
        },
        "parameters_ratio_large_vs_small": round(large["parameters"] / small["parameters"], 3),
        "patch_time_ratio_large_vs_small": round(time_ratio, 4),
        "patch_bytes_ratio_large_vs_small": round(bytes_ratio, 4),
        "patch_time_vs_bytes_scaling": round(time_ratio / bytes_ratio, 4),
    }


def _summarize(rows: list[dict]) -> dict:
    patch = [r for r in rows if r["path"] == "patch"]
    keyframe = [r for r in rows if r["path"] == "keyframe"]
    patch_p50 = statistics.median(r["p50_s"] for r in patch)
    keyframe_p50 = statistics.median(r["p50_s"] for r in keyframe)
    return {
        "patch_p50_s": round(patch_p50, 4),
        "keyframe_p50_s": round(keyframe_p50, 4),
        "patch_vs_keyframe": round(patch_p50 / keyframe_p50, 4),
        "pause_p50_s": round(statistics.median(r["pause_p50_s"] for r in rows), 5),
        "verified": all(r["verified"] for r in rows),
        "by_islands": {
            str(c): {r["path"]: round(r["p50_s"], 4) for r in rows if r["islands"] == c}
            for c in sorted({r["islands"] for r in rows})
        },
    }


async def _measure(settings, quick: bool, link_mbps: float) -> tuple[list[dict], dict]:
    counts = [1, 2] if quick else [1, 2, 4]
    versions = 3 if quick else 6
    rows = []
    event_log = await EventLog.connect(settings, worker="bench-sync")
    try:
        with tempfile.TemporaryDirectory(prefix="sprawl-sync-") as tmp:
            for link in (None, link_mbps):
                for count in counts:
                    for path in ("patch", "keyframe"):
                        rows.append(await _one_run(settings, event_log, path, count, versions, quick, Path(tmp), link))
            scaling = await _scaling(settings, event_log, quick, versions, Path(tmp))
    finally:
        await event_log.close()
    patch_rows = [r for r in rows if r["path"] == "patch"]
    loopback = _summarize([r for r in rows if r["link"] == "loopback"])
    wan = _summarize([r for r in rows if r["link"] != "loopback"])
    summary = {
        "quick": quick,
        "islands": counts,
        "versions_per_run": versions,
        **loopback,
        "wan_link_mbps": link_mbps,
        "wan": wan,
        "wan_patch_vs_keyframe": wan["patch_vs_keyframe"],
        "verified": loopback["verified"] and wan["verified"],
        "patch_bytes": next(r["bytes_per_version"] for r in rows if r["path"] == "patch"),
        "keyframe_bytes": next(r["bytes_per_version"] for r in rows if r["path"] == "keyframe"),
        "disk_bytes_vs_patch_tensor_bytes": round(
            sum(r["written_bytes"] for r in patch_rows) / max(1, sum(r["changed_tensor_bytes"] for r in patch_rows)), 4
        ),
        "patch_written_bytes_per_version": sum(r["written_bytes"] for r in patch_rows)
        // sum(r["islands"] * versions for r in patch_rows),
        # A profile of the patch path: where a version's time goes, island by island.
        "patch_profile_p50_s": median_profile(
            [p for r in patch_rows if r["link"] == "loopback" for p in r["profiles"]]
        ),
        "wan_patch_profile_p50_s": median_profile(
            [p for r in patch_rows if r["link"] != "loopback" for p in r["profiles"]]
        ),
        **scaling,
    }
    summary["verified"] = summary["verified"] and all(s["verified"] for s in scaling["scaling"].values())
    table = [
        {
            **{k: v for k, v in r.items() if k not in ("parameters", "changed_tensor_bytes", "profiles")},
            "p50_s": f"{r['p50_s']:.3f}",
            "max_s": f"{r['max_s']:.3f}",
            "pause_p50_s": f"{r['pause_p50_s']:.4f}",
        }
        for r in rows
    ]
    return table, summary


WAN_LINK_MBPS = 1000.0
"""The modelled cross-region link: 1 Gbit/s per island, a common inter-region budget per node."""


def bench_sync(quick: bool, wan: bool = False) -> tuple[list[dict], dict]:
    if wan:
        from workers.bench.wan_bench import bench_sync_wan

        return bench_sync_wan(quick)
    configure_logging("bench", fmt="json", level="WARNING")
    with private_stack("sync") as settings:
        return asyncio.run(_measure(settings, quick, WAN_LINK_MBPS))

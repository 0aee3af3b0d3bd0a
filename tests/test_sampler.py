"""Sampler islands on a real stack: bf16 and fp8 islands, version spans, and a SIGKILLed island."""

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from pipeline.config import MaterializeSettings
from pipeline.replay import replay
from pipeline.sampling import process_logits
from pipeline.version_signing import public_key_text
from schemas import PromptGroup, SamplingParams, Trajectory
from tests.chain_helpers import TEST_SIGNING_KEY, publisher, reference_island
from tests.servers import HANG_GUARD_S, connection_env
from tests.tiny_models import adam_like_step, tiny_moe
from workers.sampler.engines.reference import ReferenceEngine
from workers.sampler.island import IslandSection
from workers.sampler.worker import SamplerSettings, SamplerWorker

pytestmark = pytest.mark.integration

SAMPLING = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=10, logprobs_top_k=8)


def _model():
    model = tiny_moe(seed=4)
    with torch.no_grad():
        model.lm_head.weight.mul_(30)  # peaked, like a trained model
    return model


async def _publish(event_log, settings, versions=1):
    model = _model()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    pub = publisher(event_log, settings, model, views=["bf16", "fp8_e4m3"], keyframe_every=10)
    for v in range(versions):
        if v:
            adam_like_step(state, 1e-3, torch.Generator().manual_seed(v))
        await pub.publish(v, state)
    return pub, state


def _group(settings, gid: str, sampling=SAMPLING, n=2) -> PromptGroup:
    return PromptGroup(
        run_id=settings.run_id,
        group_id=gid,
        task="arith",
        prompt="",
        prompt_token_ids=[1, 7, 13, 21],
        n_samples=n,
        sampling=sampling,
    )


def _sampler(event_log, settings, tmp_path, view: str) -> SamplerWorker:
    section = IslandSection(
        island_id=f"island-{view}", view=view, materialize=MaterializeSettings(cache_dir=tmp_path / view)
    )
    sampler_settings = SamplerSettings(
        **{
            **settings.model_dump(include={"run_id", "nats", "blobs", "log"}),
            "island": section,
            "heartbeat_interval_s": 0.5,
        }
    )
    island = reference_island(event_log, settings, section)
    return SamplerWorker(sampler_settings, event_log, island)


async def _trajectories(event_log, settings) -> list[Trajectory]:
    return [r.event async for r in replay(event_log, "TRAJECTORIES", f"rl.{settings.run_id}.traj.>")]


async def _until(predicate):
    deadline = time.monotonic() + HANG_GUARD_S
    while not await predicate():
        assert time.monotonic() < deadline, "hung"
        await asyncio.sleep(0.1)


async def _run_until_trajectories(worker, event_log, settings, count):
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))

    async def enough():
        if task.done():
            task.result()
        return len(await _trajectories(event_log, settings)) >= count

    try:
        await _until(enough)
    finally:
        stop.set()
        await asyncio.wait_for(task, HANG_GUARD_S)


def _teacher_forced(engine: ReferenceEngine, t: Trajectory) -> torch.Tensor:
    tokens = torch.tensor([t.prompt_token_ids + t.output_token_ids])
    with torch.no_grad():
        logits = engine.model(input_ids=tokens).logits[0].float()
    start = len(t.prompt_token_ids) - 1
    processed = process_logits(
        logits[start : start + len(t.output_token_ids)], t.sampling.temperature, t.sampling.top_k, t.sampling.top_p
    )
    return processed.logprobs.gather(1, torch.tensor(t.output_token_ids)[:, None]).squeeze(1)


async def test_bf16_and_fp8_islands_record_their_own_numerics(event_log, settings, tmp_path):
    await _publish(event_log, settings)
    workers = {view: _sampler(event_log, settings, tmp_path, view) for view in ("bf16", "fp8_e4m3")}
    for i, view in enumerate(workers):
        for g in range(2):
            await event_log.append(_group(settings, f"g{i}{g}"))
        await _run_until_trajectories(workers[view], event_log, settings, 4 * (i + 1))
    trajectories = await _trajectories(event_log, settings)
    assert sorted(t.trajectory_id for t in trajectories) == sorted(
        f"g{i}{g}-{s}" for i in range(2) for g in range(2) for s in range(2)
    )
    engines = {}
    for view in workers:
        engines[view] = ReferenceEngine()
        await engines[view].start()
        await engines[view].load_weights(workers[view].island.materializer.path_of(0), 0)
    for t in trajectories:
        own = _teacher_forced(engines[t.island.view], t)
        other = _teacher_forced(engines["fp8_e4m3" if t.island.view == "bf16" else "bf16"], t)
        recorded = torch.tensor(t.logprobs)
        assert (recorded - own).abs().mean() < 0.05, (t.island.view, recorded, own)
        assert (recorded - own).abs().mean() < (recorded - other).abs().mean()
        assert t.version_spans[0].version == 0 and t.island.island_id == f"island-{t.island.view}"
        assert len(t.routed_experts) == len(t.prompt_token_ids) + len(t.output_token_ids) - 1
        assert t.top_p_kept_ids is not None and len(t.top_logprob_ids) == len(t.output_token_ids)
    heartbeats = [r.event async for r in replay(event_log, "METRICS", f"rl.{settings.run_id}.heartbeat.>")]
    assert {h.island.view for h in heartbeats} == {"bf16", "fp8_e4m3"}
    assert any(h.cached_versions == [0] and h.prompt_groups_done == 2 for h in heartbeats)
    assert all(h.queue_pending is not None for h in heartbeats if h.state == "serving")


async def test_a_version_published_mid_generation_shows_as_two_spans(event_log, settings, tmp_path):
    pub, state = await _publish(event_log, settings)
    worker = _sampler(event_log, settings, tmp_path, "bf16")
    long = SamplingParams(temperature=1.0, max_new_tokens=600)
    await event_log.append(_group(settings, "long", long, n=1))
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        await _until(lambda: _generating(worker))
        adam_like_step(state, 1e-3, torch.Generator().manual_seed(9))
        await pub.publish(1, state)

        async def one_trajectory():
            return len(await _trajectories(event_log, settings)) == 1

        await _until(one_trajectory)
    finally:
        stop.set()
        await asyncio.wait_for(task, HANG_GUARD_S)
    (t,) = await _trajectories(event_log, settings)
    assert [s.version for s in t.version_spans] == [0, 1]
    assert t.version_spans[0].end == t.version_spans[1].start
    assert t.version_spans[-1].end == len(t.output_token_ids)


async def _generating(worker) -> bool:
    return worker._inflight > 0


async def test_sigkill_mid_group_is_finished_by_another_island(event_log, settings, tmp_path):
    await _publish(event_log, settings)
    env = {
        **os.environ,
        "SPRAWL_RUN_ID": settings.run_id,
        **connection_env(settings, "sampler"),
        "SPRAWL_LOG_FORMAT": "json",
        "SPRAWL_ISLAND__ISLAND_ID": "doomed",
        "SPRAWL_ISLAND__MATERIALIZE__CACHE_DIR": str(tmp_path / "doomed"),
        "SPRAWL_TRUST__VERSION_PUBLIC_KEY": public_key_text(TEST_SIGNING_KEY),
    }
    long = SamplingParams(temperature=1.0, max_new_tokens=3000)
    await event_log.append(_group(settings, "victim", long, n=2))
    doomed = subprocess.Popen(
        [sys.executable, "-m", "workers.cli", "sampler"], env=env, stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL
    )
    try:

        async def held():
            info = await event_log.js.consumer_info("PROMPTS", f"{settings.run_id}-samplers")
            return info.num_ack_pending == 1

        await _until(held)
        await asyncio.sleep(1.0)  # well into the generation
        doomed.send_signal(signal.SIGKILL)
        doomed.wait(timeout=HANG_GUARD_S)
    finally:
        if doomed.poll() is None:
            doomed.kill()
    assert await _trajectories(event_log, settings) == []
    rescuer = _sampler(event_log, settings, tmp_path, "fp8_e4m3")
    await _run_until_trajectories(rescuer, event_log, settings, 2)
    trajectories = await _trajectories(event_log, settings)
    assert sorted(t.trajectory_id for t in trajectories) == ["victim-0", "victim-1"]
    assert {t.island.island_id for t in trajectories} == {"island-fp8_e4m3"}


async def test_a_prompt_group_whose_trajectories_are_all_in_the_log_is_not_generated_again(
    event_log, settings, tmp_path
):
    """A sampler killed between publishing a group's trajectories and acking it gets the group again:
    the log (one subject per trajectory id) says it is done, so it is acked without generating."""
    from tests.events import trajectory

    worker = _sampler(event_log, settings, tmp_path, "bf16")
    done, partial = _group(settings, "resampled-done", n=2), _group(settings, "resampled-partial", n=2)
    for index in range(2):
        await event_log.append(trajectory(settings.run_id, f"resampled-done-{index}", 3, group="resampled-done"))
    await event_log.append(trajectory(settings.run_id, "resampled-partial-0", 3, group="resampled-partial"))
    assert await worker._already_sampled(done)
    assert not await worker._already_sampled(partial)
    # Handled end to end: acked without touching the engine (this island has no version to serve at all).
    delivered = await event_log.append(done)

    class _Delivery:
        event = done
        subject = delivered.subject

    await worker.handle(_Delivery())
    assert worker.groups_done == 0
    assert [t.trajectory_id for t in await _trajectories(event_log, settings) if t.group_id == "resampled-done"] == [
        "resampled-done-0",
        "resampled-done-1",
    ]

"""The sampler worker: prompt groups in, trajectory events out, at an acceptable policy version.

One prompt group at a time from the shared `<run>-samplers` consumer: make sure the island's
version is acceptable, generate n samples, publish one Trajectory per sample, and only then let
the prompt be acked. Trajectory ids are `<group_id>-<sample_index>` and seeds derive from the
group id, so a group redone elsewhere after a crash reproduces and replaces, never duplicates.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import msgspec
import xxhash

from pipeline.codec.warm import warm_in_background
from pipeline.consumer import Consumer, Delivery
from pipeline.errors import PoisonEvent, TransientError
from pipeline.eventlog import NO_ANSWER, EventLog
from pipeline.log_lookup import count_subjects
from pipeline.logs import get_logger
from pipeline.subjects import group_trajectories_filter
from pipeline.topology import TRAJECTORIES, ConsumerRole, consumer_for
from pipeline.version_signing import island_trust
from schemas import IslandHeartbeat, PromptGroup, Trajectory
from workers.lifecycle import first_to_end, raise_if_cancelled, run_beside, run_connected
from workers.sampler.engines.base import GenerateRequest, Sample
from workers.sampler.island import Island, VersionUnreachable, build_island
from workers.sampler.settings import IslandSection as IslandSection  # re-exported: it lived here
from workers.sampler.settings import SamplerSettings

log = get_logger(__name__)


def trajectory_id(group_id: str, sample_index: int) -> str:
    return f"{group_id}-{sample_index}"


def group_seed(group: PromptGroup) -> int:
    return (
        group.sampling.seed if group.sampling.seed is not None else xxhash.xxh64_intdigest(group.group_id.encode()) >> 1
    )


class SamplerWorker:
    def __init__(self, settings: SamplerSettings, event_log: EventLog, island: Island):
        self.settings = settings
        self.log = event_log
        self.island = island
        self.groups_done = 0
        self.tokens = 0
        self._tokens_at_beat = 0
        self._beat_at = time.monotonic()
        self._inflight = 0
        self._tokenizer = None
        self._tokenizer_dir: Path | None = None

    async def handle(self, delivery: Delivery) -> None:
        group = delivery.event
        if not isinstance(group, PromptGroup):
            raise PoisonEvent(f"expected a prompt group, got {type(group).type_tag()}", error_class="wrong_event")
        if await self._already_sampled(group):
            log.info("prompt group already sampled: acked without generating again", group_id=group.group_id)
            return
        try:
            await self.island.ensure_version(group.accepts, self.settings.max_staleness)
        except VersionUnreachable as exc:
            raise TransientError(f"cannot serve group {group.group_id} yet: {exc}") from exc  # nak: retry later
        self._inflight += 1
        try:
            samples = await self.island.engine.generate(
                GenerateRequest(
                    prompt_token_ids=group.prompt_token_ids,
                    n=group.n_samples,
                    sampling=group.sampling,
                    stop_token_ids=self._stop_tokens(),
                    seed=group_seed(group),
                    request_id=delivery.event.event_id,
                )
            )
        finally:
            self._inflight -= 1
        identity = self.island.identity()
        for index, sample in enumerate(samples):
            await self.log.append(self._trajectory(group, index, sample, identity))
            self.tokens += len(sample.output_token_ids)
        self.groups_done += 1

    async def _already_sampled(self, group: PromptGroup) -> bool:
        """Whether the log holds all of this group's trajectories: a redelivery after a sampler was killed
        between publishing them and acking (or a republished group) is not generated again. Trajectory
        ids are `<group>-<index>`, one subject each, so the server counts them. A count the log does not
        answer is "no": generating again is only wasted work, the appends dedup."""
        try:
            held = await count_subjects(
                self.log, TRAJECTORIES.name, group_trajectories_filter(group.run_id, group.group_id)
            )
        except TransientError:
            return False
        return held >= group.n_samples

    def _trajectory(self, group: PromptGroup, index: int, sample: Sample, identity) -> Trajectory:
        return Trajectory(
            run_id=group.run_id,
            trajectory_id=trajectory_id(group.group_id, index),
            group_id=group.group_id,
            sample_index=index,
            task=group.task,
            prompt_token_ids=sample.prompt_token_ids,
            output_token_ids=sample.output_token_ids,
            logprobs=sample.logprobs,
            raw_logprobs=sample.raw_logprobs,
            finish_reason=sample.finish_reason,
            version_spans=sample.version_spans,
            island=identity,
            sampling=group.sampling,
            top_logprob_ids=sample.top_ids,
            top_logprobs=sample.top_logprobs,
            top_p_kept_ids=sample.kept_ids,
            routed_experts=sample.routed_experts,
            text=self._decode(sample.output_token_ids),
            group_size=group.n_samples,
        )

    def _model_dir(self) -> Path | None:
        return self.island.materializer.current()

    def _stop_tokens(self) -> list[int]:
        stops = list(self.settings.stop_token_ids)
        directory = self._model_dir()
        if directory is not None and (directory / "config.json").exists():
            eos = json.loads((directory / "config.json").read_text()).get("eos_token_id")
            stops += eos if isinstance(eos, list) else ([eos] if isinstance(eos, int) else [])
        return sorted(set(stops))

    def _decode(self, tokens: list[int]) -> str:
        directory = self._model_dir()
        if directory is None or not (directory / "tokenizer.json").exists():
            return ""
        if self._tokenizer is None or self._tokenizer_dir != directory:
            from tokenizers import Tokenizer

            self._tokenizer, self._tokenizer_dir = Tokenizer.from_file(str(directory / "tokenizer.json")), directory
        return self._tokenizer.decode(tokens)

    def heartbeat(self) -> IslandHeartbeat:
        now = time.monotonic()
        rate = (self.tokens - self._tokens_at_beat) / max(now - self._beat_at, 1e-9)
        self._tokens_at_beat, self._beat_at = self.tokens, now
        return IslandHeartbeat(
            run_id=self.settings.run_id,
            island=self.island.identity(),
            current_version=self.island.version,
            state=self.island.state
            if self.island.state in ("starting", "serving", "catching_up", "draining")
            else "serving",
            inflight_requests=self._inflight,
            cached_versions=self.island.materializer.cached_versions(),
            prompt_groups_done=self.groups_done,
            tokens_generated=self.tokens,
            tokens_per_s=round(rate, 2),
            refused_versions=self.island.refused_versions,
        )

    async def _queue_pending(self) -> int | None:
        prompts = consumer_for(self.settings.run_id, ConsumerRole.SAMPLERS)
        try:
            info = await self.log.js.consumer_info(prompts.stream.name, prompts.name)
        except NO_ANSWER:  # the heartbeat says "unknown", it does not invent a zero
            return None
        return info.num_pending

    async def _heartbeats(self) -> None:
        while True:
            raise_if_cancelled()  # a cancellation may have reached us as a swallowed timeout
            beat = self.heartbeat()
            beat = msgspec.structs.replace(beat, queue_pending=await self._queue_pending())
            try:
                await self.log.append(beat)
            except TransientError as exc:  # a missed beat is fine; the next one says the same, fresher
                log.warning("heartbeat not appended", error=str(exc))
            await asyncio.sleep(self.settings.heartbeat_interval_s)

    async def run(self, stop: asyncio.Event) -> None:
        await self.island.start()
        beats = asyncio.create_task(self._heartbeats(), name="the sampler's heartbeat loop")
        parts = [beats, *([self.island.follower] if self.island.follower is not None else [])]
        watch = asyncio.create_task(first_to_end(parts))
        prompts = consumer_for(self.settings.run_id, ConsumerRole.SAMPLERS)
        consumer = Consumer(
            self.log,
            prompts.stream.name,
            prompts.name,
            self.handle,
            batch=1,
            fetch_timeout_s=0.5,
            transient_retry_s=self.settings.streams.transient_retry_s,
            bug_attempts=self.settings.streams.bug_attempts,
        )
        try:
            # The consumer returns after the group in hand (SIGTERM drains); a dead heartbeat loop
            # must not leave a sampler alive and invisible.
            await run_beside(consumer.run(stop), watch, stop, "the sampler's heartbeat loop or chain follower")
        finally:
            self.island.state = "draining"
            try:
                await self.log.append(self.heartbeat())
            except TransientError as exc:  # draining: the log may be what is going away
                log.warning("last heartbeat not appended", error=str(exc))
            beats.cancel()
            await asyncio.gather(beats, return_exceptions=True)
            await self.island.stop()


async def run_sampler(settings: SamplerSettings) -> None:
    trust = island_trust(settings.trust)  # before connecting: no key and no opt-out, no island
    warm_in_background()

    async def body(event_log: EventLog, stop: asyncio.Event) -> None:
        island = build_island(event_log, settings.blobs, settings.run_id, settings.island, trust)
        await SamplerWorker(settings, event_log, island).run(stop)

    await run_connected(settings, f"sampler-{settings.island.view}", body)

"""`sprawl prompts` (workers/prompts/driver.py) on the session's secure stack, as the trainer role the
Kubernetes manifests give it: it keeps `groups_ahead` groups beyond what the trainer has taken, a
restarted driver continues after the groups in the log without duplicating any, and an unreachable
log ends it with LogUnavailable."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from infra import stack
from pipeline.errors import LogUnavailable
from pipeline.eventlog import EventLog
from pipeline.subjects import prompts_subject
from pipeline.topology import PROMPTS
from schemas import GroupDropped, PromptGroup
from tests.servers import HANG_GUARD_S, free_port, server_stopped
from workers.prompts.driver import publish_ahead, run_prompts, taken_groups
from workers.prompts.settings import PromptsSettings
from workers.up.prompt_driver import prompts_in_log

AHEAD = 3


def prompts_settings(settings, **feed: float) -> PromptsSettings:
    """The driver's settings as the trainer role of the test's run (its own credentials on the stack)."""
    own = stack.with_role(settings, "trainer")
    return PromptsSettings(
        run_id=settings.run_id,
        state_dir=settings.state_dir,
        nats=own.nats,
        blobs=own.blobs,
        log=settings.log,
        streams=settings.streams,
        trainer={"groups_per_batch": 2, "group_size": 2},
        prompts={"groups_ahead": AHEAD},
        feed={"poll_s": 0.05, **feed},
    )


class RecordingLog:
    """The trainer's EventLog, remembering every append's result (what the log answered)."""

    def __init__(self, event_log: EventLog):
        self._log, self.results = event_log, []

    def __getattr__(self, name):
        return getattr(self._log, name)

    async def append(self, event, **kwargs):
        result = await self._log.append(event, **kwargs)
        self.results.append((event.group_id, result))
        return result


async def until_prompts(event_log: EventLog, run_id: str, count: int) -> None:
    async with asyncio.timeout(HANG_GUARD_S):
        while await prompts_in_log(event_log, run_id) != count:
            assert await prompts_in_log(event_log, run_id) <= count, "published past the window"
            await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def driver_running(prompts: PromptsSettings):
    trainer_log = RecordingLog(await EventLog.connect(prompts, worker="prompts"))
    stop = asyncio.Event()
    task = asyncio.create_task(publish_ahead(trainer_log, prompts, stop))
    try:
        yield trainer_log
    finally:
        stop.set()
        await task
        await trainer_log.close()


async def group_ids(event_log: EventLog, run_id: str) -> list[str]:
    info = await event_log.js.stream_info(PROMPTS.name)
    ids = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        msg = await event_log.js.get_msg(PROMPTS.name, seq)
        if msg.subject == prompts_subject(run_id):
            event = await event_log.resolve(msg.data, subject=msg.subject)
            assert isinstance(event, PromptGroup)
            ids.append(event.group_id)
    return ids


def dropped(run_id: str, group: str) -> GroupDropped:
    return GroupDropped(run_id=run_id, group_id=group, reason="test", trajectory_ids=[], waited_s=1.0)


async def test_the_driver_keeps_the_window_ahead_and_a_restart_continues_without_duplicates(settings, event_log):
    run = settings.run_id
    prompts = prompts_settings(settings)
    async with driver_running(prompts) as first:
        await until_prompts(event_log, run, AHEAD)
        assert await taken_groups(event_log, run, 2) == 0
        # Two groups the trainer gave up on are taken too: the window moves by two.
        await event_log.append(dropped(run, "g0000000"))
        await event_log.append(dropped(run, "g0000001"))
        await until_prompts(event_log, run, AHEAD + 2)
    assert [group for group, _ in first.results] == [f"g{i:07d}" for i in range(AHEAD + 2)]

    # A restarted driver numbers after the groups in the log: nothing re-published, nothing deduplicated.
    await event_log.append(dropped(run, "g0000002"))
    async with driver_running(prompts) as second:
        await until_prompts(event_log, run, AHEAD + 3)
    assert [(group, result.duplicate) for group, result in second.results] == [(f"g{AHEAD + 2:07d}", False)]
    assert await group_ids(event_log, run) == [f"g{i:07d}" for i in range(AHEAD + 3)]

    # The same index is the same message id: a group published again (a lost ack) is dropped by the log.
    from workers.up.demo_task import VOCAB_SIZE, prompt_group

    again = prompt_group(run, 1, prompts.task, n_samples=2, top_p=prompts.prompts.top_p, top_logprobs=VOCAB_SIZE)
    assert (await event_log.append(again)).duplicate
    assert await prompts_in_log(event_log, run) == AHEAD + 3


async def test_an_unreachable_log_ends_the_driver_loudly(settings):
    prompts = prompts_settings(settings)
    nowhere = prompts.nats.model_copy(update={"url": f"tls://127.0.0.1:{free_port()}", "connect_attempts": 2})
    with pytest.raises(LogUnavailable):
        await run_prompts(prompts.model_copy(update={"nats": nowhere}))


async def test_a_log_that_stops_answering_ends_the_driver_after_its_patience(settings, event_log):
    prompts = prompts_settings(settings, outage_patience_s=0.0)
    trainer_log = await EventLog.connect(prompts, worker="prompts")
    try:
        await until_prompts_from(trainer_log, prompts)
        with server_stopped(settings, "nats"), pytest.raises(LogUnavailable, match="publishing prompt groups"):
            async with asyncio.timeout(HANG_GUARD_S):
                await publish_ahead(trainer_log, prompts, asyncio.Event())
    finally:
        await trainer_log.close()


async def until_prompts_from(trainer_log: EventLog, prompts: PromptsSettings) -> None:
    """The driver's first round on a healthy log (so the outage hits the loop, not the start)."""
    stop = asyncio.Event()
    task = asyncio.create_task(publish_ahead(trainer_log, prompts, stop))
    await until_prompts(trainer_log, prompts.run_id, AHEAD)
    stop.set()
    await task

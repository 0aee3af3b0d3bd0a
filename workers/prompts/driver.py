"""`sprawl prompts`: keeps `prompts.groups_ahead` prompt groups of the run's task published beyond what the
trainer has taken, as `sprawl up` does beside its trainer, for a cluster where no `sprawl up` runs.

The publishing is `sprawl up`'s own (`workers/up/prompt_driver.py`: `PromptDriver.top_up`, numbering
from `prompts_in_log`), so group i of a run is the same problem with the same message id wherever it
is published: a restarted driver continues after the groups the log holds, and one that re-publishes
a group (an append whose ack it missed) is deduplicated by the log.

What the trainer has taken is read from the log alone, without the S3 lineage `sprawl up`'s monitor
reads: every version trains exactly `trainer.groups_per_batch` groups (pipeline/batching.py), and a
group the trainer gave up on is a GroupDropped event, so taken = head version x groups_per_batch +
dropped groups. The driver must therefore run with the trainer's `groups_per_batch` (on Kubernetes both
read it from the `sprawl-run` ConfigMap).

A log that stops answering is waited out for `feed.outage_patience_s`, then the driver exits non-zero
with one line: its supervisor restarts it where everyone can see it.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time

from pipeline.errors import LogUnavailable
from pipeline.eventlog import NO_ANSWER, EventLog
from pipeline.logs import get_logger
from pipeline.subjects import group_dropped_subject
from pipeline.topology import TRAINER
from pipeline.version_log import chain_head
from workers.lifecycle import raise_if_cancelled, run_connected
from workers.prompts.settings import PromptsSettings

log = get_logger(__name__)


async def dropped_groups(event_log: EventLog, run_id: str) -> int:
    """How many groups the trainer gave up on (GroupDropped events), on the server's word."""
    subject = group_dropped_subject(run_id)
    info = await event_log.js.stream_info(TRAINER.name, subjects_filter=subject)
    return int((info.state.subjects or {}).get(subject, 0))


async def taken_groups(event_log: EventLog, run_id: str, groups_per_batch: int) -> int:
    """Prompt groups the trainer has used up: trained into a version, or dropped."""
    head = await chain_head(event_log, run_id)
    trained = (head.version if head is not None else 0) * groups_per_batch
    return trained + await dropped_groups(event_log, run_id)


def last_group(settings: PromptsSettings, dropped: int) -> int:
    """Publish no group beyond what `trainer.max_versions` can use (`sprawl up`'s bound); none: no end."""
    if settings.trainer.max_versions is None:
        return sys.maxsize
    return settings.trainer.max_versions * settings.trainer.groups_per_batch + dropped + settings.prompts.groups_ahead


async def publish_ahead(event_log: EventLog, settings: PromptsSettings, stop: asyncio.Event) -> None:
    """Top the window up every `feed.poll_s` until `stop`; LogUnavailable once the log has not answered
    for longer than `feed.outage_patience_s`."""
    from workers.up.prompt_driver import PromptDriver, prompts_in_log, task_prompts  # the demo task: torch

    run = settings.run_id
    # The rows are read and every prompt rendered once, before the first group: a task that cannot run
    # fails here, at start, in one line.
    prompts = task_prompts(settings, settings.model_dir)  # type: ignore[arg-type]
    driver: PromptDriver | None = None
    silent_since: float | None = None
    while not stop.is_set():
        try:
            if driver is None:  # numbered after the groups in the log, once the log says how many
                # PromptDriver reads `.prompts` and `.trainer.group_size`, which these settings share.
                first = await prompts_in_log(event_log, run)
                driver = PromptDriver(event_log, run, settings, first, prompts)  # type: ignore[arg-type]
                log.info("prompt driver started", run=run, next_group=driver.next_index)
            dropped = await dropped_groups(event_log, run)
            taken = await taken_groups(event_log, run, settings.trainer.groups_per_batch)
            before = driver.next_index
            await driver.top_up(taken, last_group(settings, dropped))
            if driver.next_index != before:
                log.info("prompt groups published", taken=taken, published=driver.next_index)
            silent_since = None
        except (LogUnavailable, *NO_ANSWER) as exc:
            raise_if_cancelled()
            now = time.monotonic()
            silent_since = now if silent_since is None else silent_since
            if now - silent_since >= settings.feed.outage_patience_s:
                raise LogUnavailable(
                    f"publishing prompt groups (no answer for {now - silent_since:.0f} s)",
                    exc,
                    hint="is the log reachable from here? the driver continues where it stopped once restarted",
                ) from exc
            log.warning("prompt driver waits for the log", error=repr(exc), waited_s=round(now - silent_since, 1))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=settings.feed.poll_s)


async def run_prompts(settings: PromptsSettings) -> None:
    """The worker: connected to the log (giving up after `nats.connect_attempts`), publishing until a
    signal stops it."""
    await run_connected(settings, "prompts", lambda event_log, stop: publish_ahead(event_log, settings, stop))

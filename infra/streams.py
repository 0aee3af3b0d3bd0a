"""Streams and consumers, declared in code and applied idempotently (`sprawl infra apply`).

Workers bind to these consumers and never create their own: a typo in a
worker then fails loudly instead of silently reading from a fresh consumer.
All log streams use LIMITS retention: WORK_QUEUE or INTEREST would delete
history, and the log *is* the run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nats.js import api
from nats.js.errors import NotFoundError

from pipeline.config import StreamSettings


@dataclass(frozen=True)
class StreamSpec:
    name: str
    subjects: list[str]
    description: str
    deny_delete: bool = False
    deny_purge: bool = False
    policy_log: bool = False
    """Uses the long dedup window of the policy chain."""


@dataclass(frozen=True)
class ConsumerSpec:
    stream: str
    name: str
    filter_subjects: list[str]
    description: str
    ack_wait_s: float | None = None
    max_deliver: int | None = None
    backoff_s: list[float] | None = None
    max_ack_pending: int | None = None
    deliver_all: bool = True
    extra: dict[str, str] = field(default_factory=dict)


# One stream per retention class. Subjects span every run: `rl.*.<kind>...`.
STREAMS: tuple[StreamSpec, ...] = (
    StreamSpec(
        "POLICY",
        ["rl.*.policy.*"],
        "policy version chain (create-only, never deleted)",
        deny_delete=True,
        deny_purge=True,
        policy_log=True,
    ),
    StreamSpec("PROMPTS", ["rl.*.prompts", "rl.*.prompts.>"], "prompt groups to sample"),
    StreamSpec("TRAJECTORIES", ["rl.*.traj.>"], "sampled trajectories"),
    StreamSpec("REWARDS", ["rl.*.reward.>"], "rewards keyed by trajectory id"),
    StreamSpec("METRICS", ["rl.*.metrics.>", "rl.*.heartbeat.>"], "trainer metrics and island heartbeats"),
    StreamSpec("DEADLETTER", ["rl.*.deadletter.>"], "messages consumers refused, with reasons"),
    StreamSpec("TRAINER", ["rl.*.trainer.>"], "trainer checkpoints, leases and dropped groups"),
)


ARCHIVER_MAX_ACK_PENDING = 20_000


def consumers_for_run(run_id: str) -> tuple[ConsumerSpec, ...]:
    """The durable consumers of one run; names carry the run so runs never share a cursor."""
    from pipeline.subjects import prompts_subject, rewards_filter, token, trajectories_filter

    run = token(run_id, "run_id")
    return (
        ConsumerSpec("PROMPTS", f"{run}-samplers", [prompts_subject(run)], "sampler islands share prompt groups"),
        ConsumerSpec("TRAJECTORIES", f"{run}-rewards", [trajectories_filter(run)], "reward workers"),
        ConsumerSpec("TRAJECTORIES", f"{run}-trainer-traj", [trajectories_filter(run)], "trainer: trajectories"),
        ConsumerSpec("REWARDS", f"{run}-trainer-rewards", [rewards_filter(run)], "trainer: rewards"),
        *tuple(
            ConsumerSpec(
                spec.name,
                f"{run}-archiver-{spec.name.lower()}",
                [s.replace("rl.*.", f"rl.{run}.", 1) for s in spec.subjects],
                f"archiver: every event of {spec.name}",
                # The archiver acks a whole Parquet file's worth of events at once, after the PUT.
                max_ack_pending=ARCHIVER_MAX_ACK_PENDING,
            )
            for spec in STREAMS
        ),
    )


def stream_config(spec: StreamSpec, settings: StreamSettings) -> api.StreamConfig:
    window = settings.policy_duplicate_window_s if spec.policy_log else settings.duplicate_window_s
    return api.StreamConfig(
        name=spec.name,
        description=spec.description,
        subjects=spec.subjects,
        retention=api.RetentionPolicy.LIMITS,
        storage=api.StorageType.FILE if settings.storage == "file" else api.StorageType.MEMORY,
        num_replicas=settings.replicas,
        duplicate_window=window,
        deny_delete=spec.deny_delete,
        deny_purge=spec.deny_purge,
        allow_direct=True,
        max_msg_size=-1,
    )


def consumer_config(spec: ConsumerSpec, settings: StreamSettings) -> api.ConsumerConfig:
    backoff = spec.backoff_s if spec.backoff_s is not None else settings.backoff_s
    max_deliver = spec.max_deliver or settings.max_deliver
    # JetStream requires max_deliver > len(backoff); keep the schedule's prefix that fits.
    backoff = backoff[: max(0, max_deliver - 1)]
    filters = spec.filter_subjects
    return api.ConsumerConfig(
        durable_name=spec.name,
        description=spec.description,
        deliver_policy=api.DeliverPolicy.ALL,
        ack_policy=api.AckPolicy.EXPLICIT,
        # JetStream replaces ack_wait with backoff[0] when a backoff is set; say so explicitly.
        ack_wait=backoff[0] if backoff else (spec.ack_wait_s or settings.ack_wait_s),
        max_deliver=max_deliver,
        backoff=backoff or None,
        max_ack_pending=spec.max_ack_pending or settings.max_ack_pending,
        filter_subject=filters[0] if len(filters) == 1 else None,
        filter_subjects=filters if len(filters) > 1 else None,
        num_replicas=settings.replicas,
    )


@dataclass
class ApplyReport:
    created: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)


def _differs(wanted: object, current: object, fields: list[str]) -> list[str]:
    changed = []
    for name in fields:
        want, have = getattr(wanted, name), getattr(current, name)
        if isinstance(want, list) and isinstance(have, list):
            want, have = sorted(want), sorted(have)
        if want is not None and want != have:
            changed.append(name)
    return changed


_STREAM_FIELDS = [
    "subjects",
    "retention",
    "storage",
    "num_replicas",
    "duplicate_window",
    "deny_delete",
    "deny_purge",
    "allow_direct",
    "description",
]
_CONSUMER_FIELDS = [
    "ack_wait",
    "max_deliver",
    "backoff",
    "max_ack_pending",
    "filter_subject",
    "filter_subjects",
    "description",
]


async def apply(
    js, settings: StreamSettings, run_id: str, extra_consumers: tuple[ConsumerSpec, ...] = ()
) -> ApplyReport:
    """Create or update every stream and consumer; re-running with the same inputs changes nothing."""
    report = ApplyReport()
    for spec in STREAMS:
        wanted = stream_config(spec, settings)
        try:
            current = (await js.stream_info(spec.name)).config
        except NotFoundError:
            await js.add_stream(wanted)
            report.created.append(f"stream {spec.name}")
            continue
        if _differs(wanted, current, _STREAM_FIELDS):
            await js.update_stream(wanted)
            report.updated.append(f"stream {spec.name}")
        else:
            report.unchanged.append(f"stream {spec.name}")
    for cspec in consumers_for_run(run_id) + extra_consumers:
        await apply_consumer(js, cspec, settings, report)
    return report


async def apply_consumer(js, spec: ConsumerSpec, settings: StreamSettings, report: ApplyReport) -> None:
    wanted = consumer_config(spec, settings)
    label = f"consumer {spec.stream}/{spec.name}"
    try:
        current = (await js.consumer_info(spec.stream, spec.name)).config
    except NotFoundError:
        await js.add_consumer(spec.stream, wanted)
        report.created.append(label)
        return
    if _differs(wanted, current, _CONSUMER_FIELDS):
        # add_consumer on an existing durable name is JetStream's update.
        await js.add_consumer(spec.stream, wanted)
        report.updated.append(label)
    else:
        report.unchanged.append(label)

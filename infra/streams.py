"""Apply the log's topology (`pipeline/topology.py`) to a NATS server, idempotently (`sprawl infra apply`).

What the streams and consumers are is data in `pipeline/topology.py`; this module only turns
each declaration into a JetStream API config and creates or updates it. Workers bind to these
consumers and never create their own: a typo in a worker then fails loudly instead of silently
reading from a fresh consumer.

Streams that keep one message per subject get it from the server (max one message per subject,
discard new per subject). Giving an existing stream that limit would make the server delete all but
the newest message of every subject holding more; `apply` refuses that (`StreamUpgradeRefused`)
instead of losing history.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nats.js import api
from nats.js.errors import NotFoundError

from pipeline.config import LogSettings, NatsSettings, StreamSettings
from pipeline.errors import StreamUpgradeRefused
from pipeline.eventlog import publish_retry_span_s
from pipeline.topology import STREAMS, Dedup, RunConsumer, Stream, consumers_of_run, retired_consumers

_RETENTION = {"limits": api.RetentionPolicy.LIMITS}


def replicas(stream: Stream, settings: StreamSettings) -> int:
    """`stream`'s own pin, else the configured count, else 1 (`apply` resolves None against the server)."""
    if stream.replicas is not None:
        return stream.replicas
    return settings.replicas if settings.replicas is not None else 1


def is_cluster(nc) -> bool:
    """Is the connected log a cluster? Its INFO names the cluster and lists the client URLs of the
    servers that are up (`connect_urls`). Only whether it is one is read from there, never its size: a
    node that is down at the moment is missing from the list. A cluster that hides the URLs
    (`no_advertise`) counts as one server: set `streams.replicas` explicitly there."""
    info = nc._server_info  # nats.py keeps the server's INFO here and offers no public accessor
    return bool(info.get("cluster")) and len(info.get("connect_urls") or []) >= 2


async def resolved(settings: StreamSettings, js) -> StreamSettings:
    """`settings` with `replicas` decided when it is None: 3 on a cluster, 1 on one server, and never
    fewer than a declared stream already has (a node being down while `apply` runs must not scale the
    log's streams down)."""
    if settings.replicas is not None:
        return settings
    wanted = 3 if is_cluster(js._nc) else 1
    for stream in STREAMS:
        try:
            wanted = max(wanted, (await js.stream_info(stream.name)).config.num_replicas or 1)
        except NotFoundError:
            continue
    return settings.model_copy(update={"replicas": wanted})


def dedup_floor_s(log: LogSettings, nats: NatsSettings) -> float:
    """The shortest dedup window that still covers one append's retries of one Nats-Msg-Id: every publish
    attempt and its backoff (`publish_retry_span_s`), plus one reconnect (a connect timeout and the wait
    before it) while the server restarts under it. A window shorter than that forgets the id while the
    producer still retries it, and the retry lands as a second event. Retries beyond one append (a worker
    re-running a failed handler minutes later) are covered where it matters by one subject per logical
    id, not by the window."""
    return publish_retry_span_s(log) + nats.connect_timeout_s + nats.reconnect_wait_s


def stream_config(stream: Stream, settings: StreamSettings, dedup_floor: float | None = None) -> api.StreamConfig:
    """`dedup_floor`: `dedup_floor_s` of the run's producers; None: of the default log and NATS settings."""
    if dedup_floor is None:
        dedup_floor = dedup_floor_s(LogSettings(), NatsSettings())
    configured = settings.policy_duplicate_window_s if stream.dedup == Dedup.POLICY else settings.duplicate_window_s
    window = max(configured, dedup_floor)
    one_per_subject = stream.one_message_per_subject
    return api.StreamConfig(
        name=stream.name,
        description=stream.description,
        subjects=list(stream.subjects),
        retention=_RETENTION[stream.retention],
        storage=api.StorageType.FILE if settings.storage == "file" else api.StorageType.MEMORY,
        num_replicas=replicas(stream, settings),
        duplicate_window=window,
        deny_delete=stream.deny_delete,
        deny_purge=stream.deny_purge,
        allow_direct=True,
        max_msg_size=-1,
        # One message per subject, and the server refuses the second (instead of dropping the first).
        max_msgs_per_subject=1 if one_per_subject else -1,
        discard=api.DiscardPolicy.NEW if one_per_subject else api.DiscardPolicy.OLD,
        discard_new_per_subject=one_per_subject,
    )


def consumer_config(consumer: RunConsumer, settings: StreamSettings) -> api.ConsumerConfig:
    backoff = list(consumer.backoff_s if consumer.backoff_s is not None else settings.backoff_s)
    max_deliver = consumer.max_deliver or settings.max_deliver
    # JetStream requires max_deliver > len(backoff); keep the schedule's prefix that fits.
    backoff = backoff[: max(0, max_deliver - 1)]
    filters = list(consumer.filter_subjects)
    return api.ConsumerConfig(
        durable_name=consumer.name,
        description=consumer.description,
        deliver_policy=api.DeliverPolicy.ALL,
        ack_policy=api.AckPolicy.EXPLICIT,
        # JetStream replaces ack_wait with backoff[0] when a backoff is set; say so explicitly.
        ack_wait=backoff[0] if backoff else (consumer.ack_wait_s or settings.ack_wait_s),
        max_deliver=max_deliver,
        backoff=backoff or None,
        max_ack_pending=consumer.max_ack_pending or settings.max_ack_pending,
        filter_subject=filters[0] if len(filters) == 1 else None,
        filter_subjects=filters if len(filters) > 1 else None,
        # A consumer cannot have more replicas than its stream.
        num_replicas=replicas(consumer.stream, settings),
    )


@dataclass
class ApplyReport:
    created: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)


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
    "max_msgs_per_subject",
    "discard",
    "discard_new_per_subject",
]
_CONSUMER_FIELDS = [
    # A consumer left at fewer replicas than its stream (a stream scaled up to a cluster) would stop
    # with the one server holding it.
    "num_replicas",
    "ack_wait",
    "max_deliver",
    "backoff",
    "max_ack_pending",
    "filter_subject",
    "filter_subjects",
    "description",
]


async def apply(
    js,
    settings: StreamSettings,
    run_id: str,
    *,
    log: LogSettings | None = None,
    nats: NatsSettings | None = None,
) -> ApplyReport:
    """Create or update every stream and consumer; re-running with the same inputs changes nothing.

    `log` and `nats`: the run's producer settings, which size the dedup windows' floor (`dedup_floor_s`);
    None: the defaults. Raises StreamUpgradeRefused, changing nothing on that stream, where limiting an
    existing stream to one message per subject would delete messages."""
    report = ApplyReport()
    settings = await resolved(settings, js)
    floor = dedup_floor_s(log or LogSettings(), nats or NatsSettings())
    for stream in STREAMS:
        wanted = stream_config(stream, settings, floor)
        try:
            current = (await js.stream_info(stream.name)).config
        except NotFoundError:
            await js.add_stream(wanted)
            report.created.append(f"stream {stream.name}")
            continue
        if _differs(wanted, current, _STREAM_FIELDS):
            if wanted.max_msgs_per_subject == 1 and current.max_msgs_per_subject != 1:
                await _check_one_message_per_subject(js, stream.name)
            await js.update_stream(wanted)
            report.updated.append(f"stream {stream.name}")
        else:
            report.unchanged.append(f"stream {stream.name}")
    for consumer in consumers_of_run(run_id):
        await apply_consumer(js, consumer, settings, report)
    for stream, name in retired_consumers(run_id):
        await _remove_consumer(js, stream, name, report)
    return report


async def _check_one_message_per_subject(js, name: str) -> None:
    """Raise StreamUpgradeRefused unless every subject of stream `name` holds at most one message, on the
    server's word: the per-subject limit would otherwise delete the older ones."""
    info = await js.stream_info(name, subjects_filter=">")
    subjects = info.state.subjects or {}
    crowded = {subject: count for subject, count in subjects.items() if count > 1}
    if crowded:
        examples = ", ".join(f"{s} ({n})" for s, n in sorted(crowded.items())[:3])
        raise StreamUpgradeRefused(name, f"{len(crowded)} subjects hold more than one message, e.g. {examples}")
    listed = sum(subjects.values())
    if listed != info.state.messages:
        # The server lists a bounded number of subjects per answer: the rest are unknown, so no promise.
        raise StreamUpgradeRefused(
            name, f"the server listed {len(subjects)} subjects holding {listed} of its {info.state.messages} messages"
        )


async def apply_consumer(js, consumer: RunConsumer, settings: StreamSettings, report: ApplyReport) -> None:
    wanted = consumer_config(consumer, settings)
    stream = consumer.stream.name
    label = f"consumer {stream}/{consumer.name}"
    try:
        current = (await js.consumer_info(stream, consumer.name)).config
    except NotFoundError:
        await js.add_consumer(stream, wanted)
        report.created.append(label)
        return
    if _differs(wanted, current, _CONSUMER_FIELDS):
        # add_consumer on an existing durable name is JetStream's update.
        await js.add_consumer(stream, wanted)
        report.updated.append(label)
    else:
        report.unchanged.append(label)


async def _remove_consumer(js, stream: Stream, name: str, report: ApplyReport) -> None:
    """Delete a consumer an older topology declared, so a run applied before it does not keep a cursor
    nobody reads (its pending count would grow forever). The stream's history is untouched."""
    try:
        await js.delete_consumer(stream.name, name)
    except NotFoundError:
        return
    report.removed.append(f"consumer {stream.name}/{name}")

"""The log's topology: declared in pipeline/topology.py, applied by infra/streams.py, named through it by workers."""

import ast
import re
from pathlib import Path

import pytest
from nats.js import api
from nats.js.errors import NotFoundError

from infra.streams import apply, consumer_config, dedup_floor_s, stream_config
from pipeline.config import LogSettings, NatsSettings, StreamSettings
from pipeline.subjects import subject_for
from pipeline.topology import (
    ARCHIVER_MAX_ACK_PENDING,
    CONSUMERS,
    POLICY,
    PROMPTS,
    REWARDS,
    STREAMS,
    SUBJECT_ROOT,
    TRAJECTORIES,
    ConsumerRole,
    consumer_for,
    consumers_of_run,
    retired_consumers,
    stream_named,
    subject_matches,
)
from schemas import (
    DeadLetter,
    GroupDropped,
    IslandDrift,
    IslandHeartbeat,
    PromptGroup,
    StabilityResult,
    TrainerCheckpoint,
    TrainerLease,
    TrainerMetrics,
)
from schemas.events import CURRENT_EVENTS
from tests.events import ISLAND, policy_version, reward, trajectory

ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------- the declarations


def _one_event_of_each_type(run: str) -> list:
    events = [
        policy_version(run, 3),
        PromptGroup(run_id=run, group_id="g0", task="arith", prompt="1+1", prompt_token_ids=[1], n_samples=2),
        trajectory(run, "t0", 2),
        reward(run, 0),
        IslandHeartbeat(run_id=run, island=ISLAND, current_version=0),
        TrainerMetrics(run_id=run, step=1, version=1, metrics={}),
        DeadLetter(
            run_id=run,
            reason="r",
            error_class="e",
            stream=TRAJECTORIES.label,
            consumer="c",
            original_subject="s",
            original_seq=1,
            num_delivered=1,
            payload=b"",
        ),
        TrainerCheckpoint(
            run_id=run, version=1, step=1, uri="u", sha256="0", bytes=1, trajectory_position=1, reward_position=1
        ),
        GroupDropped(run_id=run, group_id="g0", reason="r", trajectory_ids=[], waited_s=1.0),
        TrainerLease(run_id=run, holder="h", expires_at=0.0),
        IslandDrift(
            run_id=run,
            island_id="i0",
            state="flagged",
            version=1,
            kl_k3=1.0,
            ess_ratio=0.5,
            baseline_kl_k3=0.001,
            factor=50.0,
        ),
        StabilityResult(
            run_id=run,
            experiment_id=run,
            cell_run_id=f"{run}-mixed-none-s0",
            fleet="mixed",
            correction="none",
            seed=0,
            updates=1,
            collapsed=False,
            start_reward=0.5,
            final_reward=0.5,
            kl_mean=0.01,
            collapse_rule="r",
        ),
    ]
    # A claim check travels on the subject of the event it stands in for; every other type is here.
    assert {type(e) for e in events} == {c for c in CURRENT_EVENTS if c.type_tag() != "claim_check.v1"}
    return events


def test_every_event_subject_lands_in_exactly_one_stream():
    for event in _one_event_of_each_type("r1"):
        subject = subject_for(event)
        holders = [s.name for s in STREAMS if any(subject_matches(p, subject) for p in s.subjects)]
        assert len(holders) == 1, (type(event).type_tag(), subject, holders)
        stream = stream_named(holders[0])
        assert subject_matches(stream.run_filter("r1"), subject) and any(
            subject_matches(p, subject) for p in stream.run_subjects("r1")
        )


def test_streams_keep_history_and_the_policy_chain_is_never_deleted():
    assert {s.retention for s in STREAMS} == {"limits"}
    assert POLICY.deny_delete and POLICY.deny_purge
    assert [s for s in STREAMS if s.deny_delete or s.deny_purge] == [POLICY]
    assert len({s.name for s in STREAMS}) == len(STREAMS)


def test_consumer_names_carry_the_run_and_the_role():
    names = {c.name for c in consumers_of_run("Run1")}
    assert {"run1-samplers", "run1-rewards"} | {f"run1-archiver-{s.label}" for s in STREAMS} == names
    samplers = consumer_for("run1", ConsumerRole.SAMPLERS)
    assert (samplers.stream, samplers.filter_subjects) == (PROMPTS, ("rl.run1.prompts",))
    assert consumer_for("run1", "rewards").filter_subjects == ("rl.run1.traj.>",)
    archiver = consumer_for("run1", ConsumerRole.ARCHIVER, REWARDS)
    assert (archiver.name, archiver.max_ack_pending) == ("run1-archiver-rewards", ARCHIVER_MAX_ACK_PENDING)
    assert consumer_for("run1", ConsumerRole.ARCHIVER, PROMPTS).filter_subjects == PROMPTS.run_subjects("run1")
    with pytest.raises(LookupError, match="name the stream"):
        consumer_for("run1", ConsumerRole.ARCHIVER)
    with pytest.raises(LookupError, match="declare it"):
        consumer_for("run1", ConsumerRole.REWARDS, POLICY)
    with pytest.raises(ValueError, match="subject token"):
        consumer_for("run.1", ConsumerRole.SAMPLERS)


def test_every_declared_consumer_has_an_owner_that_binds_it():
    """A consumer nobody binds only piles up pending messages: each role's owner names it through the topology."""
    owners = {
        ConsumerRole.SAMPLERS: "workers/sampler/worker.py",
        ConsumerRole.REWARDS: "workers/rewards/worker.py",
        ConsumerRole.ARCHIVER: "workers/archiver/stream.py",
    }
    assert {c.role for c in CONSUMERS} == set(owners)
    for role, path in owners.items():
        source = (ROOT / path).read_text()
        assert "consumer_for(" in source and f"ConsumerRole.{role.name}" in source, (role, path)


# ---------------------------------------------------------------- no literals outside the topology

_SCANNED = ("pipeline", "workers", "infra")
_TOPOLOGY = ROOT / "pipeline" / "topology.py"
_STREAM_NAMES = {s.name for s in STREAMS}
# `f"{run}-samplers"`, `f"{run}-archiver-{stream}"`, and the retired `-trainer-traj`/`-trainer-rewards`.
_CONSUMER_SUFFIX = re.compile(r"^-(" + "|".join([*(r.value for r in ConsumerRole), "trainer"]) + r")\b")


def _string_pieces(tree: ast.AST):
    """Every string constant, with f-strings split into their literal parts (`f"rl.{run}.traj"` -> "rl.", ".traj")."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.lineno, node.value


def _spelled_names(path: Path) -> list[str]:
    found = []
    for line, piece in _string_pieces(ast.parse(path.read_text(), str(path))):
        if piece in _STREAM_NAMES:
            why = "stream name"
        elif _CONSUMER_SUFFIX.match(piece):
            why = "consumer name"
        elif piece.startswith(f"{SUBJECT_ROOT}."):
            why = "subject"
        else:
            continue
        found.append(f"{path.relative_to(ROOT)}:{line}: {why} {piece!r}")
    return found


def test_no_module_spells_a_stream_consumer_or_subject_outside_the_topology():
    """Stream names, consumer names and subjects come from pipeline/topology.py (and pipeline/subjects.py,
    which builds subjects from its grammar), never from a literal: a literal is how a worker ends up
    reading a stream or a consumer nobody declared."""
    offenders = [
        hit
        for folder in _SCANNED
        for path in sorted((ROOT / folder).rglob("*.py"))
        if path != _TOPOLOGY
        for hit in _spelled_names(path)
    ]
    assert offenders == [], "spell these through pipeline.topology:\n" + "\n".join(offenders)


def test_the_literal_scan_sees_what_it_should():
    tree = ast.parse('x = "TRAJECTORIES"\ny = f"{run}-samplers"\nz = f"rl.{run}.traj.>"\nw = "a POLICY doc"')
    pieces = [p for _, p in _string_pieces(tree)]
    assert "TRAJECTORIES" in pieces and "-samplers" in pieces and "rl." in pieces
    assert _CONSUMER_SUFFIX.match("-samplers") and _CONSUMER_SUFFIX.match("-archiver-")
    assert not _CONSUMER_SUFFIX.match("-rewardsish") and "a POLICY doc" not in _STREAM_NAMES


# ---------------------------------------------------------------- applying it to a server


@pytest.mark.integration
async def test_apply_is_idempotent(event_log, settings):
    # The fixture applied once already; a second and third apply change nothing.
    second = await apply(event_log.js, settings.streams, settings.run_id)
    third = await apply(event_log.js, settings.streams, settings.run_id)
    for report in (second, third):
        assert report.created == [] and report.updated == [] and report.removed == []
        assert len(report.unchanged) == len(STREAMS) + len(consumers_of_run(settings.run_id))


@pytest.mark.integration
async def test_declared_streams_keep_history(event_log):
    for stream in STREAMS:
        config = (await event_log.js.stream_info(stream.name)).config
        assert config.retention == api.RetentionPolicy.LIMITS, stream.name
        assert sorted(config.subjects) == sorted(stream.subjects)
        assert config.duplicate_window and config.duplicate_window > 0
    policy = (await event_log.js.stream_info(POLICY.name)).config
    assert policy.deny_delete and policy.deny_purge


@pytest.mark.integration
async def test_declared_consumers_bound_redelivery(event_log, settings):
    for consumer in consumers_of_run(settings.run_id):
        config = (await event_log.js.consumer_info(consumer.stream.name, consumer.name)).config
        assert config.ack_policy == api.AckPolicy.EXPLICIT
        assert config.max_ack_pending == (consumer.max_ack_pending or settings.streams.max_ack_pending)
        if consumer.role == ConsumerRole.ARCHIVER:
            # Unlimited: every message must reach the archive; the ack wait brings a killed archiver's back.
            assert config.max_deliver == -1 and not config.backoff
            assert config.ack_wait == settings.streams.ack_wait_s
        else:
            assert config.max_deliver == settings.streams.max_deliver and config.backoff


@pytest.mark.integration
async def test_changed_settings_update_consumers_in_place(event_log, settings):
    changed = settings.streams.model_copy(update={"max_ack_pending": 7})
    report = await apply(event_log.js, changed, settings.run_id)
    assert len(report.updated) == sum(1 for c in consumers_of_run(settings.run_id) if c.max_ack_pending is None)
    rewards = consumer_for(settings.run_id, ConsumerRole.REWARDS)
    info = await event_log.js.consumer_info(rewards.stream.name, rewards.name)
    assert info.config.max_ack_pending == 7
    await apply(event_log.js, settings.streams, settings.run_id)


@pytest.mark.integration
async def test_apply_removes_consumers_an_older_topology_declared(event_log, settings):
    for stream, name in retired_consumers(settings.run_id):
        await event_log.js.add_consumer(
            stream.name, api.ConsumerConfig(durable_name=name, ack_policy=api.AckPolicy.EXPLICIT)
        )
    report = await apply(event_log.js, settings.streams, settings.run_id)
    assert sorted(report.removed) == sorted(f"consumer {s.name}/{n}" for s, n in retired_consumers(settings.run_id))
    # Asked by name: a listing of the stream's consumers is one page, which the suite's many runs overflow.
    await event_log.js.consumer_info(TRAJECTORIES.name, consumer_for(settings.run_id, ConsumerRole.REWARDS).name)
    for stream, name in retired_consumers(settings.run_id):
        with pytest.raises(NotFoundError):
            await event_log.js.consumer_info(stream.name, name)


def test_replicas_are_configurable():
    cluster = StreamSettings(replicas=3)
    assert stream_config(STREAMS[0], cluster).num_replicas == 3
    assert consumer_config(consumers_of_run("r")[0], cluster).num_replicas == 3


def test_dedup_windows_cover_a_producers_retries_of_one_message_id():
    # 3 attempts of up to 2 s each, with 0.25 + 0.5 + 1 s of backoff after them, and one reconnect of 5 + 0.5 s.
    log = LogSettings(publish_timeout_s=2.0, publish_attempts=3, publish_backoff_s=0.25)
    nats = NatsSettings(connect_timeout_s=5.0, reconnect_wait_s=0.5)
    assert dedup_floor_s(log, nats) == pytest.approx(3 * 2.0 + 0.25 + 0.5 + 1 + 5.0 + 0.5)
    # The backoff is capped (at 1 s) as the append's retry loop caps it.
    patient = LogSettings(publish_timeout_s=30.0, publish_attempts=8, publish_backoff_s=0.25)
    floor = dedup_floor_s(patient, nats)
    assert floor == pytest.approx(8 * 30.0 + 0.25 + 0.5 + 6 * 1.0 + 5.0 + 0.5)
    settings = StreamSettings(duplicate_window_s=120.0, policy_duplicate_window_s=3600.0)
    # A window configured shorter than the producers' retries is raised to cover them; a longer one is kept.
    assert stream_config(TRAJECTORIES, settings, floor).duplicate_window == pytest.approx(floor)
    assert stream_config(POLICY, settings, floor).duplicate_window == 3600.0
    assert stream_config(TRAJECTORIES, settings, dedup_floor_s(log, nats)).duplicate_window == 120.0

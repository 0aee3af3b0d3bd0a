"""The drift guard inside the trainer, on a real stack: a broken island is flagged (event, metrics),
quarantined, the quarantined set is recorded in each version's lineage, and a restarted trainer
re-derives every version bit for bit with it (and could not without it)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from pipeline.blobstore import S3BlobStore
from pipeline.replay import replay
from schemas import IslandDrift, IslandIdentity, Reward, SamplingParams, TrainerMetrics, Trajectory, VersionSpan
from tests.chain_helpers import signed_trust
from tests.servers import HANG_GUARD_S
from tests.trainer_data import publish_groups, write_initial_model
from workers.trainer.loop import Trainer, determinism
from workers.trainer.recovery import RecoveryMismatch, batch_from_lineage, check_rederived, read_lineage, root_hashes
from workers.trainer.settings import DriftSection, TrainerSection, TrainerSettings

pytestmark = pytest.mark.integration

ISLANDS = {"isl-bf16": 0.0, "isl-fp8": 0.002, "isl-mxfp4": 0.01, "isl-bad": 3.0}
"""Each island's sampler logprobs sit this far below the model's: the broken one's by 3 nats a token."""
GROUP_SIZE = 4
VERSIONS = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_initial_model(tmp_path_factory.mktemp("initial"))


def _groups(directory, run_id: str, groups: int):
    """Group g comes from island g % 4: every batch of 4 groups has one of each."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(7)
    names = list(ISLANDS)
    out = []
    for g in range(groups):
        island_id = names[g % len(names)]
        island = IslandIdentity(island_id=island_id, accelerator="cpu", view="bf16", engine="torch")
        prompt = torch.randint(2, model.config.vocab_size, (5,), generator=gen).tolist()
        trajectories, rewards = [], []
        for i in range(GROUP_SIZE):
            output = torch.randint(2, model.config.vocab_size, (6,), generator=gen).tolist()
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([prompt + output[:-1]])).logits[0, len(prompt) - 1 :]
            logp = torch.log_softmax(logits.float(), -1)
            chosen = logp.gather(-1, torch.tensor(output)[:, None]).squeeze(-1)
            top_lp, top_ids = torch.topk(logp, 4, dim=-1)
            tid = f"g{g}-{i}"
            trajectories.append(
                Trajectory(
                    run_id=run_id,
                    trajectory_id=tid,
                    group_id=f"g{g}",
                    sample_index=i,
                    task="synthetic",
                    prompt_token_ids=prompt,
                    output_token_ids=output,
                    logprobs=(chosen - ISLANDS[island_id]).tolist(),
                    finish_reason="stop",
                    version_spans=[VersionSpan(version=0, start=0, end=6)],
                    island=island,
                    sampling=SamplingParams(temperature=1.0, max_new_tokens=6, logprobs_top_k=4),
                    top_logprob_ids=top_ids.tolist(),
                    top_logprobs=top_lp.tolist(),
                    group_size=GROUP_SIZE,
                )
            )
            rewards.append(
                Reward(
                    run_id=run_id,
                    trajectory_id=tid,
                    group_id=f"g{g}",
                    value=float(i % 2),
                    verifier="synthetic",
                    verifier_version="1",
                    duration_s=0.0,
                )
            )
        out.append((trajectories, rewards))
    return out


def _settings(settings, model_dir) -> TrainerSettings:
    # 24 tokens per island per update: judged from the first update on
    drift = DriftSection(quarantine=True, window=2, min_tokens=20)
    section = TrainerSection(
        model_dir=model_dir,
        groups_per_batch=4,
        trainer_id="t-drift",
        max_versions=VERSIONS,
        checkpoint_every=100,  # no checkpoint: a restart re-derives every version from its lineage
        drift=drift,
    )
    return TrainerSettings(
        **settings.model_dump(include={"run_id", "nats", "blobs", "log", "streams"}),
        trust=signed_trust(),
        trainer=section,
    )


async def test_a_broken_island_is_quarantined_and_recovery_replays_the_quarantine(event_log, settings, model_dir):
    await publish_groups(event_log, _groups(model_dir, settings.run_id, 4 * VERSIONS))
    blobs = S3BlobStore(settings.blobs)
    trainer = Trainer(_settings(settings, model_dir), event_log, blobs)
    await asyncio.wait_for(trainer.run(asyncio.Event()), HANG_GUARD_S)
    assert trainer.published == list(range(VERSIONS + 1))

    events = [r.event async for r in replay(event_log, "METRICS", f"rl.{settings.run_id}.metrics.>")]
    drift = [e for e in events if isinstance(e, IslandDrift)]
    assert [(d.island_id, d.state, d.version, d.quarantined) for d in drift] == [("isl-bad", "flagged", 1, True)]
    assert drift[0].kl_k3 > 10 and drift[0].kl_k3 > drift[0].factor * drift[0].baseline_kl_k3
    metrics = [e for e in events if isinstance(e, TrainerMetrics)]
    assert [m.metrics["islands_flagged"] for m in metrics] == [1.0] * VERSIONS
    assert [m.metrics["quarantined_trajectories"] for m in metrics] == [0.0] + [4.0] * (VERSIONS - 1)
    assert set(metrics[0].per_island) == set(ISLANDS)
    assert metrics[-1].per_island["isl-bad"]["flagged"] == 1.0 and metrics[-1].per_island["isl-bad"]["tokens"] == 24
    assert metrics[-1].per_island["isl-bf16"]["flagged"] == 0.0

    # `sprawl audit fleet`: per island its newest drift state and windowed KL, from the archive
    from pipeline.audit import AUDITS, open_archive, query
    from workers.archiver import ArchiverSettings, ArchiveSection, drain_once

    await drain_once(
        ArchiverSettings(
            **settings.model_dump(include={"run_id", "nats", "blobs", "log"}), archive=ArchiveSection(flush_events=50)
        )
    )
    con, views = open_archive(settings)
    relation = query(con, views, AUDITS["fleet"])
    rows = {row[0]: dict(zip(relation.columns, row, strict=True)) for row in relation.fetchall()}
    assert sorted(rows) == sorted(ISLANDS)
    bad = rows.pop("isl-bad")
    assert (bad["drift_state"], bad["quarantined"], bad["drift_since_version"]) == ("flagged", True, 1)
    assert bad["window_kl_k3"] > 10 and bad["baseline_kl_k3"] == DriftSection().floor_kl_k3
    for island, row in rows.items():
        assert (row["drift_state"], row["quarantined"]) == ("ok", False), island
        assert row["window_kl_k3"] < 1e-2, island

    recorded = [(await read_lineage(event_log, blobs, settings.run_id, v))[1].quarantined_islands for v in (1, 2, 4)]
    assert recorded == [[], ["isl-bad"], ["isl-bad"]]  # v1 was trained before the verdict

    # A restarted trainer with no checkpoint re-derives v1..v4 from their lineage, each checked bit for
    # bit against the logged root hashes, and starts with the island still quarantined.
    restarted = Trainer(_settings(settings, model_dir), event_log, blobs)
    await asyncio.wait_for(restarted.run(asyncio.Event()), HANG_GUARD_S)
    assert restarted.version == VERSIONS and restarted.published == []
    assert restarted.guard.quarantined == {"isl-bad"}

    # Without the recorded set the replay forks: the lineage field is what keeps recovery exact.
    forgetful = Trainer(_settings(settings, model_dir), event_log, blobs)
    determinism(forgetful.cfg)
    forgetful._load_model()
    for version in (1, 2):
        event, batch, quarantined = await batch_from_lineage(event_log, blobs, settings.run_id, version)
        forgetful._update(batch, version - 1, quarantined if version == 1 else frozenset())
        ours = root_hashes(forgetful.model, forgetful.settings.chain.views)
        if version == 1:
            check_rederived(event, ours)
        else:
            with pytest.raises(RecoveryMismatch):
                check_rederived(event, ours)


def _out_of_vocabulary(good, config):
    return {"output_token_ids": [*good.output_token_ids[:-1], 10**6]}


def _longer_than_the_model_takes(good, config):
    # The prompt (no per-token fields to keep in step) repeated past the model's positions.
    repeats = config.max_position_embeddings // len(good.prompt_token_ids) + 1
    return {"prompt_token_ids": good.prompt_token_ids * repeats}


@pytest.mark.parametrize(
    ("forge", "reason"),
    [
        (_out_of_vocabulary, "outside the model's vocabulary"),
        (_longer_than_the_model_takes, "positions"),
    ],
)
async def test_a_trajectory_the_model_cannot_take_is_dead_lettered_not_a_crash_loop(
    event_log, settings, model_dir, forge, reason
):
    """A forged trajectory whose token id the model cannot index used to raise IndexError inside the
    update, before any lineage named the batch: every restart read it again and crashed again. One far
    longer than the model's positions would have made the update allocate logits for all of it."""
    import msgspec
    from transformers import AutoConfig

    from schemas import DeadLetter, decode_event

    groups = _groups(model_dir, settings.run_id, 4)
    good = groups[0][0][0]
    changes = forge(good, AutoConfig.from_pretrained(model_dir))
    forged = msgspec.structs.replace(good, trajectory_id="gx-0", group_id="gx", group_size=1, **changes)
    forged_reward = msgspec.structs.replace(groups[0][1][0], trajectory_id="gx-0", group_id="gx")
    landed = await event_log.append(forged)  # first in the log: without the check it would be in the first batch
    await event_log.append(forged_reward)
    await publish_groups(event_log, groups)
    one_version = _settings(settings, model_dir)
    one_version = one_version.model_copy(update={"trainer": one_version.trainer.model_copy(update={"max_versions": 1})})
    trainer = Trainer(one_version, event_log, S3BlobStore(settings.blobs))
    await asyncio.wait_for(trainer.run(asyncio.Event()), HANG_GUARD_S)
    assert trainer.published == [0, 1]
    _, lineage = await read_lineage(event_log, S3BlobStore(settings.blobs), settings.run_id, 1)
    assert "gx" not in {g.group_id for g in lineage.groups}

    dead = [r.event async for r in replay(event_log, "DEADLETTER", f"rl.{settings.run_id}.deadletter.>")]
    assert [(d.error_class, d.original_seq) for d in dead if isinstance(d, DeadLetter)] == [
        ("TrajectoryOutOfModel", landed.seq)
    ]
    assert reason in dead[0].reason
    assert decode_event(dead[0].payload).trajectory_id == "gx-0"  # the refused event itself, for the audit

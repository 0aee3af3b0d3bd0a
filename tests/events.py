"""Small event factories for tests."""

from __future__ import annotations

from schemas import (
    BlobPointer,
    IslandIdentity,
    PolicyVersion,
    Reward,
    TensorDigest,
    Trajectory,
    VersionSpan,
    ViewVersion,
)

ISLAND = IslandIdentity(island_id="island-0", accelerator="cpu", view="bf16", engine="torch")


def reward(run_id: str, n: int, group: str = "g0") -> Reward:
    return Reward(
        run_id=run_id,
        trajectory_id=f"traj-{n}",
        group_id=group,
        value=float(n),
        verifier="exact",
        verifier_version="1",
        duration_s=0.01,
    )


def policy_version(run_id: str, version: int) -> PolicyVersion:
    view = ViewVersion(
        view="bf16",
        kind="keyframe" if version == 0 else "patch",
        base_version=None if version == 0 else version - 1,
        blobs=[BlobPointer(uri=f"s3://sprawl/{run_id}/v{version}", sha256="0" * 64, bytes=1)],
        tensors=[TensorDigest(name="w", dtype="BF16", shape=[1], xxh3="0" * 32, changed=1)],
        root_hash="0" * 32,
        bytes=1,
        changed_elements=1,
        total_elements=1,
    )
    return PolicyVersion(
        run_id=run_id,
        version=version,
        parent_version=version - 1 if version else None,
        trainer_step=version,
        views=[view],
    )


def trajectory(run_id: str, trajectory_id: str, output_tokens: int, group: str = "g0") -> Trajectory:
    return Trajectory(
        run_id=run_id,
        trajectory_id=trajectory_id,
        group_id=group,
        sample_index=0,
        task="arith",
        prompt_token_ids=list(range(16)),
        output_token_ids=[i % 50_000 for i in range(output_tokens)],
        logprobs=[-0.5] * output_tokens,
        finish_reason="length",
        version_spans=[VersionSpan(version=0, start=0, end=output_tokens)],
        island=ISLAND,
        top_logprob_ids=[[1, 2, 3, 4]] * output_tokens,
        top_logprobs=[[-0.1, -2.0, -3.0, -4.0]] * output_tokens,
    )

import json
from datetime import UTC, datetime

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from schemas import (
    BlobPointer,
    EventDecodeError,
    IslandHeartbeat,
    IslandIdentity,
    PolicyVersion,
    Reward,
    TensorDigest,
    Trajectory,
    VersionSpan,
    ViewVersion,
    decode_event,
    encode_event,
)
from schemas.events import CURRENT_EVENTS
from schemas.export import JSON_DIR, rendered_schemas
from schemas.upcasters import IslandHeartbeatV1

ISLAND = IslandIdentity(island_id="i0", accelerator="cpu", view="bf16", engine="torch")


def test_committed_json_schemas_are_fresh():
    expected = rendered_schemas()
    on_disk = {p.name: p.read_text() for p in JSON_DIR.glob("*.json")}
    assert on_disk == expected, "schemas/json is stale: run `python -m schemas` and commit the result"


def test_every_event_type_has_a_versioned_tag_and_matching_schema_version():
    for cls in CURRENT_EVENTS:
        kind, _, version = cls.type_tag().rpartition(".v")
        assert kind and version.isdigit()
        assert cls.__struct_defaults__ is not None
        fields = dict(zip(cls.__struct_fields__, range(len(cls.__struct_fields__)), strict=True))
        assert "schema_version" in fields and "event_id" in fields and "produced_at" in fields


def test_policy_version_round_trip():
    event = PolicyVersion(
        run_id="r1",
        version=3,
        parent_version=2,
        trainer_step=3,
        views=[
            ViewVersion(
                view="bf16",
                kind="patch",
                base_version=2,
                blobs=[BlobPointer(uri="s3://b/p", sha256="0" * 64, bytes=10, name="model.safetensors")],
                tensors=[TensorDigest(name="w", dtype="BF16", shape=[2, 3], xxh3="1" * 32, changed=1)],
                root_hash="1" * 32,
                bytes=10,
                changed_elements=1,
                total_elements=6,
            )
        ],
    )
    assert decode_event(encode_event(event)) == event
    assert event.business_key() == f"policy.v3.{event.event_id}"


def test_trajectory_round_trip_keeps_nested_arrays():
    event = Trajectory(
        run_id="r1",
        trajectory_id="t1",
        group_id="g1",
        sample_index=0,
        task="arith",
        prompt_token_ids=[1, 2],
        output_token_ids=[3, 4],
        logprobs=[-0.1, -2.0],
        finish_reason="stop",
        version_spans=[VersionSpan(version=4, start=0, end=1), VersionSpan(version=5, start=1, end=2)],
        island=ISLAND,
        top_logprob_ids=[[3, 9], [4, 8]],
        top_logprobs=[[-0.1, -3.0], [-2.0, -2.5]],
        routed_experts=[[[0, 1]], [[2, 3]]],
    )
    assert decode_event(encode_event(event)) == event


@given(
    value=st.floats(allow_nan=False, allow_infinity=False),
    text=st.text(max_size=50),
    duration=st.floats(0, 1e6),
)
def test_reward_round_trip_property(value, text, duration):
    event = Reward(
        run_id="r",
        trajectory_id="t",
        group_id="g",
        value=value,
        verifier=text,
        verifier_version="1",
        duration_s=duration,
        components={text: value},
    )
    assert decode_event(encode_event(event)) == event


@pytest.mark.parametrize(
    ("payload", "category"),
    [
        (b"\x00\xffnot json", "malformed"),
        (b"[1, 2, 3]", "malformed"),
        (b'{"type": "made_up.v1", "run_id": "r"}', "unknown_type"),
        (b'{"type": "reward.v9", "run_id": "r"}', "unknown_type"),
        (b'{"type": "reward.v1", "run_id": "r"}', "invalid"),
    ],
)
def test_bad_bytes_are_refused_with_a_category(payload, category):
    with pytest.raises(EventDecodeError) as info:
        decode_event(payload)
    assert info.value.category == category


def test_wrong_schema_version_is_refused():
    good = json.loads(
        encode_event(
            Reward(
                run_id="r",
                trajectory_id="t",
                group_id="g",
                value=1.0,
                verifier="v",
                verifier_version="1",
                duration_s=0.0,
            )
        )
    )
    good["schema_version"] = 2
    with pytest.raises(EventDecodeError, match="schema_version 2 does not match"):
        decode_event(json.dumps(good).encode())


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_reward_is_refused_at_the_producer(value):
    with pytest.raises(ValueError, match="not finite"):
        Reward(
            run_id="r",
            trajectory_id="t",
            group_id="g",
            value=value,
            verifier="v",
            verifier_version="1",
            duration_s=0.0,
        )


def test_empty_run_id_is_refused():
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"type": "reward.v1", "run_id": ""}, type=Reward)


def test_v1_heartbeat_is_read_as_v2():
    old = IslandHeartbeatV1(
        run_id="r",
        island_id="isl-7",
        accelerator="H100-80GB/fp8_e4m3/vllm",
        current_version=12,
        produced_at=datetime(2026, 1, 1, tzinfo=UTC),
    )
    new = decode_event(encode_event(old))
    assert isinstance(new, IslandHeartbeat)
    assert new.schema_version == 2
    assert new.island == IslandIdentity(island_id="isl-7", accelerator="H100-80GB", view="fp8_e4m3", engine="vllm")
    assert (new.event_id, new.current_version, new.produced_at) == (old.event_id, 12, old.produced_at)


def test_unknown_fields_from_newer_producers_are_ignored():
    data = json.loads(
        encode_event(
            Reward(
                run_id="r",
                trajectory_id="t",
                group_id="g",
                value=1.0,
                verifier="v",
                verifier_version="1",
                duration_s=0.0,
            )
        )
    )
    data["added_later"] = {"x": 1}
    assert isinstance(decode_event(json.dumps(data).encode()), Reward)

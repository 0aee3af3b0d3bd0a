import fnmatch
import json
from datetime import UTC, datetime

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from schemas import (
    ArchiveKey,
    BlobPointer,
    EventDecodeError,
    IslandHeartbeat,
    IslandIdentity,
    Lineage,
    LineageDecodeError,
    LineageGroup,
    LineageMember,
    PolicyVersion,
    Reward,
    TensorDigest,
    Trajectory,
    VersionSpan,
    ViewVersion,
    decode_event,
    decode_lineage,
    encode_event,
    encode_lineage,
)
from schemas.archive import UNKNOWN_DATE, archive_date, parquet_glob, run_prefix
from schemas.events import CURRENT_EVENTS
from schemas.export import JSON_DIR, LAYOUTS, rendered_schemas
from schemas.lineage import lineage_key
from schemas.upcasters import LEGACY_EVENTS, IslandHeartbeatV1

ISLAND = IslandIdentity(island_id="i0", accelerator="cpu", view="bf16", engine="torch")


def test_committed_json_schemas_are_fresh():
    expected = rendered_schemas()
    on_disk = {p.name: p.read_text() for p in JSON_DIR.glob("*.json")}
    assert on_disk == expected, "schemas/json is stale: run `python -m schemas` and commit the result"


def test_every_event_type_and_layout_has_its_own_schema_file():
    names = set(rendered_schemas())
    assert {f"{c.type_tag()}.json" for c in CURRENT_EVENTS} | {f"{n}.json" for n in LAYOUTS} <= names
    assert len(names) == len(CURRENT_EVENTS) + len(LEGACY_EVENTS) + len(LAYOUTS)  # no layout shadows an event


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
    text=st.text(min_size=1, max_size=50),
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


def _reward_fields() -> dict:
    return json.loads(
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


def test_wrong_schema_version_is_refused():
    good = _reward_fields()
    good["schema_version"] = 2
    with pytest.raises(EventDecodeError, match=r"schema_version") as info:
        decode_event(json.dumps(good).encode())
    assert info.value.category == "invalid"


def test_a_producer_cannot_construct_a_wrong_schema_version():
    with pytest.raises(ValueError, match="schema_version 2 does not match"):
        Reward(
            run_id="r",
            schema_version=2,
            trajectory_id="t",
            group_id="g",
            value=1.0,
            verifier="v",
            verifier_version="1",
            duration_s=0.0,
        )


@pytest.mark.parametrize("field", ["event_id", "produced_at", "schema_version", "run_id"])
def test_bytes_without_an_envelope_field_are_invalid_not_completed(field):
    fields = _reward_fields()
    del fields[field]
    with pytest.raises(EventDecodeError, match=f"missing required field `{field}`") as info:
        decode_event(json.dumps(fields).encode())
    assert info.value.category == "invalid"


def test_decoding_the_same_bytes_twice_gives_the_same_event():
    data = json.dumps(_reward_fields()).encode()
    first, second = decode_event(data), decode_event(data)
    assert (first.event_id, first.produced_at) == (second.event_id, second.produced_at)
    assert first.event_id == json.loads(data)["event_id"]


def test_a_python_producer_may_leave_the_envelope_out():
    one, two = (
        Reward(run_id="r", trajectory_id="t", group_id="g", value=1.0, verifier="v", verifier_version="1", duration_s=0)
        for _ in range(2)
    )
    assert one.event_id and two.event_id and one.event_id != two.event_id
    assert one.produced_at.tzinfo is not None and one.schema_version == 1
    assert decode_event(encode_event(one)) == one


@pytest.mark.parametrize(
    "produced_at",
    ["2026-01-01 00:00:00Z", "2026-01-01T00:00:00", "2026-01-01", "yesterday", "2026-13-01T00:00:00Z", 1767225600],
)
def test_a_produced_at_that_is_not_an_rfc3339_date_time_is_invalid(produced_at):
    fields = _reward_fields() | {"produced_at": produced_at}
    with pytest.raises(EventDecodeError) as info:
        decode_event(json.dumps(fields).encode())
    assert info.value.category == "invalid"


@pytest.mark.parametrize("produced_at", ["2026-01-01T00:00:00Z", "2026-01-01t00:00:00.5z", "2026-01-01T01:00:00+01:00"])
def test_rfc3339_date_times_are_accepted(produced_at):
    fields = _reward_fields() | {"produced_at": produced_at}
    assert decode_event(json.dumps(fields).encode()).produced_at.utcoffset() is not None


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


@pytest.mark.parametrize("run_id", ["", "a.b", "a b", "*", "-x", "x\n"])
def test_a_run_id_that_cannot_be_a_subject_token_is_invalid(run_id):
    fields = _reward_fields() | {"run_id": run_id}
    with pytest.raises(EventDecodeError, match="run_id") as info:
        decode_event(json.dumps(fields).encode())
    assert info.value.category == "invalid"


def test_empty_run_id_is_refused_at_the_producer():
    with pytest.raises(ValueError, match="run_id must not be empty"):
        Reward(run_id="", trajectory_id="t", group_id="g", value=1.0, verifier="v", verifier_version="1", duration_s=0)


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
    data = _reward_fields()
    data["added_later"] = {"x": 1}
    assert isinstance(decode_event(json.dumps(data).encode()), Reward)


# ---------------------------------------------------------------- layouts: lineage and archive keys

LINEAGE = Lineage(
    version=7,
    groups=[
        LineageGroup(group_id="g0", members=[LineageMember("g0-0", 11, 21), LineageMember("g0-1", 12, 22)]),
        LineageGroup(group_id="g1", members=[LineageMember("g1-0", 13, 23)]),
    ],
)


def test_lineage_round_trip_and_member_arrays():
    assert decode_lineage(encode_lineage(LINEAGE)) == LINEAGE
    assert json.loads(encode_lineage(LINEAGE))["groups"][0]["members"][1] == ["g0-1", 12, 22]
    assert LINEAGE.trajectory_ids() == ["g0-0", "g0-1", "g1-0"]


def test_lineage_blobs_the_trainer_wrote_before_the_schema_still_decode():
    # Exactly what the trainer wrote by hand (json.dumps of plain dicts and lists).
    written = json.dumps(
        {
            "version": 7,
            "groups": [
                {"group_id": "g0", "members": [["g0-0", 11, 21], ["g0-1", 12, 22]]},
                {"group_id": "g1", "members": [["g1-0", 13, 23]]},
            ],
        }
    ).encode()
    assert decode_lineage(written) == LINEAGE


@pytest.mark.parametrize(
    "blob", [b"", b"{}", b'{"version": 1, "groups": [{"group_id": "g", "members": [["t", 1]]}]}', b"\x00"]
)
def test_a_blob_that_is_not_a_lineage_is_refused(blob):
    with pytest.raises(LineageDecodeError, match="not a lineage blob"):
        decode_lineage(blob)


def test_lineage_key_sorts_by_version():
    assert lineage_key("r1", 7) == "runs/r1/lineage/v00000007.json"
    assert sorted([lineage_key("r1", 10), lineage_key("r1", 9)]) == [lineage_key("r1", 9), lineage_key("r1", 10)]


KEY = ArchiveKey(
    run_id="r1", event_type="trajectory.v1", date="2026-11-30", stream="trajectories", first_seq=3, last_seq=1200
)


def test_archive_key_round_trip():
    key = KEY.to_key()
    assert (
        key
        == "archive/run_id=r1/event_type=trajectory.v1/date=2026-11-30/trajectories-000000000003-000000001200.parquet"
    )
    assert ArchiveKey.parse(key) == KEY
    assert key.startswith(run_prefix("r1"))
    unknown = msgspec.structs.replace(KEY, event_type="undecodable", date=UNKNOWN_DATE, stream="deadletter")
    assert ArchiveKey.parse(unknown.to_key()) == unknown


@given(
    run=st.from_regex(r"[a-z0-9][a-z0-9_-]{0,20}", fullmatch=True),
    stream=st.from_regex(r"[a-z_]{1,12}", fullmatch=True),
    first=st.integers(1, 10**12 - 1),
    length=st.integers(0, 10**6),
)
def test_archive_key_round_trip_property(run, stream, first, length):
    key = ArchiveKey(
        run_id=run,
        event_type="reward.v1",
        date="2026-01-02",
        stream=stream,
        first_seq=first,
        last_seq=min(first + length, 10**12 - 1),
    )
    assert ArchiveKey.parse(key.to_key()) == key


@pytest.mark.parametrize(
    "key",
    [
        "archive/run_id=r1/event_type=reward.v1/date=2026-01-02/rewards-1-2.parquet",  # unpadded sequences
        "archive/run_id=r1/event_type=reward.v1/rewards-000000000001-000000000002.parquet",  # no date
        "archive/run_id=r1/notes.txt",
        "runs/r1/lineage/v00000001.json",
    ],
)
def test_keys_that_are_not_archive_files_are_refused_or_skipped(key):
    with pytest.raises(ValueError, match="not an archive file key"):
        ArchiveKey.parse(key)
    assert ArchiveKey.parse_listing([key, KEY.to_key()]) == [KEY]


def test_archive_dates_are_utc_days_and_globs_match_the_keys():
    from datetime import timedelta, timezone

    late_in_tokyo = datetime(2026, 1, 2, 8, 0, tzinfo=timezone(timedelta(hours=9)))
    assert archive_date(late_in_tokyo) == "2026-01-01"
    assert archive_date(None) == UNKNOWN_DATE
    assert fnmatch.fnmatchcase(KEY.to_key(), parquet_glob("r1"))
    assert fnmatch.fnmatchcase(KEY.to_key(), parquet_glob("r1", "trajectory.v1", "trajectories"))
    assert not fnmatch.fnmatchcase(KEY.to_key(), parquet_glob("r1", stream="rewards"))


@pytest.mark.parametrize(
    ("field", "value"),
    [("logprobs", [-0.1]), ("loss_mask", [1]), ("raw_logprobs", [-0.1]), ("top_logprobs", [[-0.1], [-2.0]])],
)
def test_a_producer_cannot_construct_a_trajectory_whose_arrays_miss_tokens(field, value):
    fields = {
        "run_id": "r1",
        "trajectory_id": "t1",
        "group_id": "g1",
        "sample_index": 0,
        "task": "arith",
        "prompt_token_ids": [1, 2],
        "output_token_ids": [3, 4],
        "logprobs": [-0.1, -2.0],
        "finish_reason": "stop",
        "version_spans": [VersionSpan(version=4, start=0, end=2)],
        "island": ISLAND,
        "top_logprob_ids": [[3, 9], [4, 8]],
        "top_logprobs": [[-0.1, -3.0], [-2.0, -2.5]],
    }
    assert Trajectory(**fields).output_token_ids == [3, 4]
    with pytest.raises(ValueError, match="trajectory t1"):
        Trajectory(**(fields | {field: value}))

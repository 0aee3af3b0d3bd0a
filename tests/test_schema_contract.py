"""The exported JSON Schema is the contract: a generic validator and the decoder agree on every event.

A client in another language validates what it produces against `schemas/json/` with a stock Draft
2020-12 validator; the workers decode with `schemas.decode_event`. For a valid instance of every event
type (current and legacy) and for a corpus of mutations of each (hand-written, a matrix of wrong values
at every field, and Hypothesis-generated), both must accept or both must refuse. The few places where
they cannot agree by construction are listed in KNOWN_DIFFERENCES and asserted to differ exactly so.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator

from schemas import (
    BlobPointer,
    ClaimCheck,
    DeadLetter,
    EventDecodeError,
    GroupDropped,
    IslandDrift,
    IslandHeartbeat,
    IslandIdentity,
    PolicyVersion,
    PromptGroup,
    Reward,
    SamplingParams,
    SkipPatch,
    StabilityResult,
    TensorDigest,
    TrainerCheckpoint,
    TrainerLease,
    TrainerMetrics,
    Trajectory,
    VersionConstraint,
    VersionSpan,
    ViewVersion,
    decode_event,
    encode_event,
    known_event_types,
)
from schemas.codec import upcast
from schemas.envelope import Event
from schemas.export import JSON_DIR
from schemas.upcasters import IslandHeartbeatV1

Path = tuple[str | int, ...]
Doc = Any

FORMAT_CHECKER = Draft202012Validator.FORMAT_CHECKER
SCHEMAS = {tag: json.loads((JSON_DIR / f"{tag}.json").read_text()) for tag in known_event_types()}
VALIDATORS = {tag: Draft202012Validator(schema, format_checker=FORMAT_CHECKER) for tag, schema in SCHEMAS.items()}

AT = datetime(2026, 1, 2, 3, 4, 5, 678000, tzinfo=UTC)
ISLAND = IslandIdentity(island_id="island-0", accelerator="cpu", view="bf16", engine="torch", kernels={"attn": "sdpa"})
BLOB = BlobPointer(uri="s3://sprawl/r1/v2/model.safetensors", sha256="ab" * 32, bytes=10, name="model.safetensors")


def _envelope(tag: str) -> dict[str, Any]:
    return {"run_id": "run-1", "event_id": f"id-{tag}", "produced_at": AT, "producer": "test/host/1"}


EXAMPLES: dict[str, Event] = {
    "policy_version.v1": PolicyVersion(
        **_envelope("pv"),
        version=2,
        parent_version=1,
        trainer_step=2,
        views=[
            ViewVersion(
                view="bf16",
                kind="patch",
                base_version=1,
                blobs=[BLOB],
                tensors=[TensorDigest(name="w", dtype="BF16", shape=[2, 3], xxh3="1f" * 16, changed=1)],
                root_hash="2e" * 16,
                bytes=10,
                changed_elements=1,
                total_elements=6,
                skip_patches=[SkipPatch(base_version=0, blobs=[BLOB], bytes=10, changed_elements=2)],
            )
        ],
        consumed_trajectories=4,
        lineage_uri="s3://sprawl/r1/lineage/v2.json",
    ),
    "prompt_group.v1": PromptGroup(
        **_envelope("pg"),
        group_id="g-1",
        task="arith",
        prompt="1+1=",
        prompt_token_ids=[5, 6],
        n_samples=2,
        sampling=SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=8, logprobs_top_k=2, seed=3),
        accepts=VersionConstraint(min_version=1, max_staleness=2),
        answer="2",
        metadata={"source": "unit"},
    ),
    "trajectory.v1": Trajectory(
        **_envelope("tr"),
        trajectory_id="g-1-0",
        group_id="g-1",
        sample_index=0,
        task="arith",
        prompt_token_ids=[5, 6],
        output_token_ids=[7, 8],
        logprobs=[-0.5, -1.25],
        raw_logprobs=[-0.25, -1.0],
        finish_reason="stop",
        version_spans=[VersionSpan(version=1, start=0, end=1), VersionSpan(version=2, start=1, end=2)],
        island=ISLAND,
        top_logprob_ids=[[7, 9], [8, 9]],
        top_logprobs=[[-0.5, -2.0], [-1.25, -3.0]],
        top_p_kept_ids=[[7], [8, 9]],
        routed_experts=[[[0, 1]], [[1, 2]], [[2, 3]], [[0, 3]]],
        loss_mask=[1, 0],
        text="2",
        group_size=2,
    ),
    "reward.v1": Reward(
        **_envelope("rw"),
        trajectory_id="g-1-0",
        group_id="g-1",
        value=0.5,
        verifier="exact",
        verifier_version="1",
        duration_s=0.01,
        components={"format": 1.0},
        sandbox_id="sb-1",
        error_class=None,
        details={"first_failure": "none"},
    ),
    "island_heartbeat.v2": IslandHeartbeat(
        **_envelope("hb"),
        island=ISLAND,
        current_version=2,
        state="serving",
        inflight_requests=1,
        queue_pending=3,
        cached_versions=[1, 2],
        prompt_groups_done=4,
        tokens_generated=40,
        tokens_per_s=12.5,
    ),
    "island_heartbeat.v1": IslandHeartbeatV1(
        **_envelope("hb1"), island_id="island-0", accelerator="H100-80GB/fp8_e4m3/vllm", current_version=2
    ),
    "trainer_metrics.v1": TrainerMetrics(
        **_envelope("tm"), step=2, version=2, metrics={"loss": 0.25}, per_group={"bf16-cpu": {"kl": 0.01}}
    ),
    "dead_letter.v1": DeadLetter(
        **_envelope("dl"),
        reason="not json",
        error_class="malformed",
        stream="trajectories",
        consumer="trainer",
        original_subject="rl.run-1.traj.g-1",
        original_seq=7,
        num_delivered=1,
        payload=b"\x00\xffnot json",
        headers={"Nats-Msg-Id": "x"},
    ),
    "claim_check.v1": ClaimCheck(
        **_envelope("cc"), event_type="trajectory.v1", uri="s3://sprawl/r1/claims/x", sha256="cd" * 32, bytes=300_000
    ),
    "trainer_checkpoint.v1": TrainerCheckpoint(
        **_envelope("ck"),
        version=2,
        step=2,
        uri="s3://sprawl/r1/ckpt/v2",
        sha256="ef" * 32,
        bytes=1000,
        trajectory_position=10,
        reward_position=11,
    ),
    "group_dropped.v1": GroupDropped(
        **_envelope("gd"), group_id="g-1", reason="incomplete", trajectory_ids=["g-1-0"], waited_s=300.0
    ),
    "trainer_lease.v1": TrainerLease(**_envelope("tl"), holder="trainer/host/1", expires_at=1_767_225_600.5),
    "island_drift.v1": IslandDrift(
        **_envelope("dr"),
        island_id="island-3",
        view="mxfp4",
        state="flagged",
        version=12,
        kl_k3=0.8,
        ess_ratio=0.3,
        baseline_kl_k3=0.01,
        factor=10.0,
        quarantined=True,
    ),
    "stability_result.v1": StabilityResult(
        **_envelope("st"),
        experiment_id="stab-1",
        cell_run_id="stab-1-mixed-sc_mis-s2",
        fleet="mixed",
        correction="sc+mis",
        seed=2,
        updates=60,
        collapsed=True,
        updates_to_collapse=41,
        start_reward=0.4,
        final_reward=0.05,
        kl_mean=0.02,
        collapse_rule="reward below start for 5 updates",
        stress={"max_staleness": 4.0},
        series={"reward_mean": [0.4, 0.3], "kl_k3": [0.01, 0.03]},
    ),
}


# ---------------------------------------------------------------- the two judges


def validator_accepts(doc: Doc) -> bool:
    """What a client validating against the published schema concludes: valid for the schema its type names
    (every schema pins `type`, so no other schema could accept it)."""
    tag = doc.get("type") if isinstance(doc, dict) else None
    validator = VALIDATORS.get(tag) if isinstance(tag, str) else None
    return validator is not None and validator.is_valid(doc)


def decoder_accepts(doc: Doc) -> bool:
    try:
        decode_event(json.dumps(doc).encode())
    except EventDecodeError:
        return False
    return True


def as_doc(event: Event) -> dict[str, Any]:
    return json.loads(encode_event(event))


# ---------------------------------------------------------------- documents and their mutations


def paths(doc: Doc, prefix: Path = ()) -> Iterator[Path]:
    """Every value's path inside `doc`, the root excluded, parents before children."""
    children = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for key, value in children:
        yield (*prefix, key)
        yield from paths(value, (*prefix, key))


def replaced(doc: Doc, path: Path, value: Any) -> Doc:
    out = copy.deepcopy(doc)
    parent = out
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = value
    return out


def without(doc: Doc, path: Path) -> Doc:
    out = copy.deepcopy(doc)
    parent = out
    for key in path[:-1]:
        parent = parent[key]
    del parent[path[-1]]
    return out


def _value_at(doc: Doc, path: Path) -> Any:
    for key in path:
        doc = doc[key]
    return doc


# ---------------------------------------------------------------- where they cannot agree, and why


def _refused_only_for(doc: Doc, repair: Callable[[Doc], Doc]) -> bool:
    """The validator accepts `doc`, the decoder refuses it, and accepts it once `repair` fixed one thing."""
    return validator_accepts(doc) and not decoder_accepts(doc) and decoder_accepts(repair(doc))


def _integral_floats_as_ints(doc: Doc) -> Doc:
    return json.loads(
        json.dumps(doc), parse_float=lambda text: int(float(text)) if float(text).is_integer() else float(text)
    )


def _huge_numbers_as_zero(doc: Doc) -> Doc:
    return json.loads(json.dumps(doc), parse_int=lambda text: 0 if abs(int(text)) >= 2**1024 else int(text))


def _per_token_arrays_trimmed(doc: Doc) -> Doc:
    """The trajectory with every per-token array cut or padded to its output length (top-k rows paired)."""
    out = len(doc["output_token_ids"])
    fixed = copy.deepcopy(doc)
    fixed["logprobs"] = (doc["logprobs"] + [0.0] * out)[:out]
    for name, filler in (("raw_logprobs", 0.0), ("top_p_kept_ids", [])):
        if fixed.get(name):
            fixed[name] = (fixed[name] + [filler] * out)[:out]
    if fixed.get("loss_mask") is not None:
        fixed["loss_mask"] = (fixed["loss_mask"] + [1] * out)[:out]
    ids, lps = fixed.get("top_logprob_ids", []), fixed.get("top_logprobs", [])
    if ids or lps:
        rows = [(ids[i] if i < len(ids) else [], lps[i] if i < len(lps) else []) for i in range(out)]
        fixed["top_logprob_ids"] = [i[: min(len(i), len(p))] for i, p in rows]
        fixed["top_logprobs"] = [p[: min(len(i), len(p))] for i, p in rows]
    return fixed


KNOWN_DIFFERENCES: dict[str, Callable[[str, Doc], bool]] = {
    # Rules between fields JSON Schema cannot state; the decoder enforces them (a trajectory that breaks one
    # would crash the trainer's batch) and the schema's descriptions say so ("checked by the decoder").
    "a trajectory's per-token arrays must match its output length": lambda tag, doc: (
        tag == "trajectory.v1" and _refused_only_for(doc, _per_token_arrays_trimmed)
    ),
    # JSON Schema's data model has one number type: 1.0 is an integer. msgspec refuses a fraction where an
    # int is declared. The exported files' $comment tells clients to write integers as integers.
    "an integer written with a fraction (1.0)": lambda tag, doc: _refused_only_for(doc, _integral_floats_as_ints),
    # Python's json reads 1e400 as inf, a valid "number"; the decoder refuses a number no float64 holds.
    "a number no 64-bit float can hold": lambda tag, doc: _refused_only_for(doc, _huge_numbers_as_zero),
}
"""Where the validator accepts and the decoder refuses, by design, each with the one repair that makes the
decoder accept. Every entry is asserted to hold exactly: outside them both judges agree."""


def known_difference(doc: Doc) -> str | None:
    tag = doc.get("type") if isinstance(doc, dict) else None
    if not isinstance(tag, str) or tag not in SCHEMAS:
        return None
    return next((why for why, applies in KNOWN_DIFFERENCES.items() if applies(tag, doc)), None)


def assert_agree(doc: Doc, case: str) -> None:
    by_schema, by_decoder = validator_accepts(doc), decoder_accepts(doc)
    why = known_difference(doc)
    if why is not None:
        assert (by_schema, by_decoder) == (True, False), f"{case}: known difference '{why}' no longer holds"
        return
    assert by_schema == by_decoder, (
        f"{case}: the published schema {'accepts' if by_schema else 'refuses'} what the decoder "
        f"{'accepts' if by_decoder else 'refuses'}: {json.dumps(doc)[:400]}"
    )


# ---------------------------------------------------------------- the checks


def test_every_event_type_has_an_example():
    assert set(EXAMPLES) == set(known_event_types())
    assert all(type(event).type_tag() == tag for tag, event in EXAMPLES.items())


@pytest.mark.parametrize("tag", sorted(SCHEMAS))
def test_every_exported_schema_is_a_valid_draft_2020_12_schema(tag):
    Draft202012Validator.check_schema(SCHEMAS[tag])
    assert SCHEMAS[tag]["$schema"] == "https://json-schema.org/draft/2020-12/schema"


def test_the_format_checker_really_checks_date_times():
    # Without rfc3339-validator installed jsonschema silently accepts any string as a date-time.
    assert FORMAT_CHECKER.conforms("2026-01-02T03:04:05Z", "date-time")
    assert not FORMAT_CHECKER.conforms("2026-01-02 03:04:05", "date-time")
    assert not FORMAT_CHECKER.conforms("yesterday", "date-time")


@pytest.mark.parametrize("tag", sorted(EXAMPLES))
def test_a_valid_event_passes_the_schema_and_the_decoder_unchanged(tag):
    event = EXAMPLES[tag]
    doc = as_doc(event)
    errors = [e.message for e in VALIDATORS[tag].iter_errors(doc)]
    assert errors == []
    decoded = decode_event(encode_event(event))
    assert decoded == upcast(event)
    assert (decoded.event_id, decoded.produced_at) == (event.event_id, event.produced_at)


@pytest.mark.parametrize("tag", sorted(SCHEMAS))
def test_the_schema_pins_the_envelope(tag):
    definition = SCHEMAS[tag]["$defs"][SCHEMAS[tag]["$ref"].rsplit("/", 1)[1]]
    version = int(tag.rsplit(".v", 1)[1])
    assert {"type", "run_id", "event_id", "schema_version", "produced_at"} <= set(definition["required"])
    assert definition["properties"]["type"] == {"enum": [tag]}
    assert definition["properties"]["schema_version"] == {"enum": [version]}
    assert definition["properties"]["produced_at"]["format"] == "date-time"
    assert "pattern" in definition["properties"]["run_id"] and "pattern" in definition["properties"]["event_id"]


def _envelope_mutations(tag: str) -> Iterator[tuple[str, Callable[[Doc], Doc]]]:
    version = int(tag.rsplit(".v", 1)[1])
    for value in (version + 1, 0, -1, str(version), None, float(version) + 0.5):
        yield f"schema_version={value!r}", lambda d, v=value: d | {"schema_version": v}
    for value in (
        "yesterday",
        "2026-01-02",
        "2026-01-02T03:04:05",  # no offset
        "2026-01-02 03:04:05Z",  # a space for the T: msgspec alone would accept it
        "2026-02-30T03:04:05Z",
        "2026-01-02T24:00:00Z",
        "2026-01-02T03:04:05+24:00",
        "2026-01-02t03:04:05.5z",  # lowercase is RFC 3339 too: both accept
        "2026-01-02T03:04:05-07:30",
        1767225600,
        None,
    ):
        yield f"produced_at={value!r}", lambda d, v=value: d | {"produced_at": v}
    for value in ("", "a.b", "a b", "-a", "_a", "a\n", "*", ">", "ä", 7, None, "Run_1-X"):
        yield f"run_id={value!r}", lambda d, v=value: d | {"run_id": v}
    for value in ("", "has space", "tab\tid", "x\n", None, 5, "550e8400-e29b-41d4-a716-446655440000", "a.b:c/d"):
        yield f"event_id={value!r}", lambda d, v=value: d | {"event_id": v}
    for value in ("made_up.v1", f"{tag.rsplit('.v', 1)[0]}.v99", "", 3, None):
        yield f"type={value!r}", lambda d, v=value: d | {"type": v}
    for field in ("type", "run_id", "event_id", "schema_version", "produced_at", "producer"):
        yield f"without {field}", lambda d, f=field: without(d, (f,))
    yield "an unknown field (additive evolution: both accept)", lambda d: d | {"added_later": {"x": [1]}}
    yield "producer=5", lambda d: d | {"producer": 5}


@pytest.mark.parametrize("tag", sorted(EXAMPLES))
def test_envelope_mutations_are_judged_alike(tag):
    doc = as_doc(EXAMPLES[tag])
    outcomes = {}
    for case, mutate in _envelope_mutations(tag):
        mutated = mutate(doc)
        assert_agree(mutated, f"{tag}: {case}")
        outcomes[case] = decoder_accepts(mutated)
    # The corpus is not vacuous: it holds refusals and acceptances, the three among the refusals.
    refused = {case for case, accepted in outcomes.items() if not accepted}
    next_version = int(tag.rsplit(".v", 1)[1]) + 1
    assert {f"schema_version={next_version}", "produced_at='yesterday'", "run_id=''"} <= refused
    assert {"without event_id", "without produced_at", "produced_at='2026-01-02 03:04:05Z'"} <= refused
    assert outcomes["an unknown field (additive evolution: both accept)"] and outcomes["run_id='Run_1-X'"]


WRONG_VALUES: tuple[Any, ...] = (None, True, -1, 0, 1, 0.5, 1e300, "", "x", "a.b", "ab" * 32, [], [1], {}, {"k": "v"})
"""Put at every field of every example: the wrong JSON types, the bounds (-1, 0, 1), an empty string, a
non-token, a hex digest. Most are refused by both; where one is legal (0 for a version, "" for a prompt),
both must accept it."""


@pytest.mark.parametrize("tag", sorted(EXAMPLES))
def test_a_wrong_value_at_any_field_is_judged_alike(tag):
    doc = as_doc(EXAMPLES[tag])
    judged = refused = 0
    for path in paths(doc):
        for value in WRONG_VALUES:
            mutated = replaced(doc, path, value)
            assert_agree(mutated, f"{tag}: {'.'.join(map(str, path))}={value!r}")
            judged += 1
            refused += not decoder_accepts(mutated)
        if isinstance(path[-1], str):
            assert_agree(without(doc, path), f"{tag}: without {'.'.join(map(str, path))}")
    assert refused > judged // 2, f"{tag}: only {refused} of {judged} wrong values refused: the corpus is too weak"


BOUNDARIES: dict[str, list[tuple[Path, Any, bool]]] = {
    # (path, value, whether both must accept it): the bounds the matrix above does not reach.
    "prompt_group.v1": [
        (("n_samples",), 0, False),
        (("n_samples",), 1, True),
        (("sampling", "top_p"), 1.5, False),
        (("sampling", "top_p"), 1.0, True),
        (("sampling", "top_p"), 1e-9, True),
        (("sampling", "temperature"), -0.1, False),
        (("sampling", "top_k"), -2, False),
        (("sampling", "top_k"), -1, True),
        (("sampling", "max_new_tokens"), 0, False),
        (("prompt_token_ids",), [], False),
        (("prompt_token_ids",), [-1], False),
        (("accepts", "min_version"), -1, False),
        (("group_id",), "g.1", False),
    ],
    "trajectory.v1": [
        (("trajectory_id",), "t.1", False),
        (("island", "island_id"), "i 0", False),
        (("finish_reason",), "done", False),
        (("loss_mask",), [2, 0], False),
        (("loss_mask",), None, True),
        (("version_spans", 0, "start"), -1, False),
        (("output_token_ids",), [7, -8], False),
        (("top_p_kept_ids",), None, True),
        (("raw_logprobs",), [], True),
    ],
    "policy_version.v1": [
        (("version",), -1, False),
        (("views", 0, "blobs", 0, "sha256"), "AB" * 32, False),
        (("views", 0, "blobs", 0, "sha256"), "ab" * 31, False),
        (("views", 0, "root_hash"), "xyz", False),
        (("views", 0, "kind"), "delta", False),
        (("views", 0, "tensors", 0), ["w", "BF16", [-1], "1f" * 16, 1], False),
        (("views", 0, "tensors", 0), ["w", "BF16", [2, 3], "1f" * 16], False),
        (("views", 0, "base_version"), None, True),
    ],
    "reward.v1": [(("duration_s",), -0.5, False), (("verifier",), "", False), (("group_id",), "g/1", False)],
    "island_heartbeat.v2": [(("state",), "sleeping", False), (("tokens_per_s",), -1.0, False)],
    "island_heartbeat.v1": [(("island_id",), "a.b", False), (("current_version",), None, True)],
    "dead_letter.v1": [
        (("payload",), "not base64!", False),
        (("payload",), "YQ", False),
        (("payload",), "YQ==", True),
        (("payload",), "", True),
    ],
    "claim_check.v1": [(("event_type",), "Reward", False), (("event_type",), "reward.v1\n", False)],
    "group_dropped.v1": [(("trajectory_ids",), ["ok", "not ok"], False), (("trajectory_ids",), [], True)],
    "trainer_lease.v1": [(("holder",), "", False)],
    "trainer_checkpoint.v1": [(("sha256",), "0", False), (("reward_position",), -1, False)],
    "trainer_metrics.v1": [(("metrics",), {"loss": "high"}, False), (("step",), -1, False)],
}


@pytest.mark.parametrize("tag", sorted(BOUNDARIES))
def test_bounds_are_judged_alike(tag):
    doc = as_doc(EXAMPLES[tag])
    for path, value, accepted in BOUNDARIES[tag]:
        mutated = replaced(doc, path, value)
        case = f"{tag}: {'.'.join(map(str, path))}={value!r}"
        assert_agree(mutated, case)
        assert decoder_accepts(mutated) == accepted, case


# ---------------------------------------------------------------- the known differences, pinned


def test_a_trajectory_whose_arrays_disagree_with_its_output_is_refused_by_the_decoder_only():
    doc = as_doc(EXAMPLES["trajectory.v1"])
    for path, value in [
        (("logprobs",), [-0.5]),
        (("raw_logprobs",), [-0.5]),
        (("loss_mask",), [1]),
        (("loss_mask",), []),
        (("top_p_kept_ids",), [[7]]),
        (("top_logprobs",), [[-0.5, -2.0], [-1.25]]),
        (("top_logprobs",), []),
    ]:
        mutated = replaced(doc, path, value)
        assert validator_accepts(mutated) and not decoder_accepts(mutated), path
        assert known_difference(mutated) == "a trajectory's per-token arrays must match its output length"
    assert (
        "checked by the decoder"
        in SCHEMAS["trajectory.v1"]["$defs"]["Trajectory"]["properties"]["logprobs"]["description"]
    )


def test_an_integer_written_as_a_float_is_refused_by_the_decoder_only():
    mutated = replaced(as_doc(EXAMPLES["trainer_metrics.v1"]), ("step",), 2.0)
    assert validator_accepts(mutated) and not decoder_accepts(mutated)
    assert known_difference(mutated) == "an integer written with a fraction (1.0)"
    assert "1.0" in SCHEMAS["trainer_metrics.v1"]["$comment"]


def test_a_number_beyond_float64_is_refused_by_the_decoder_only():
    mutated = replaced(as_doc(EXAMPLES["reward.v1"]), ("value",), 10**400)
    assert validator_accepts(mutated) and not decoder_accepts(mutated)
    assert known_difference(mutated) == "a number no 64-bit float can hold"


# ---------------------------------------------------------------- generated mutations

JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False).filter(lambda f: not f.is_integer())
    | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=4), children, max_size=3),
    max_leaves=6,
)
DATE_TIME_LIKE = st.from_regex(
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt ][0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]{0,4})?([Zz]|[+-][0-9]{2}:[0-9]{2})?",
    fullmatch=True,
)
TOKEN_LIKE = st.from_regex(r"[A-Za-z0-9_. \-]{0,6}", fullmatch=True)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_generated_mutations_are_judged_alike(data):
    tag = data.draw(st.sampled_from(sorted(EXAMPLES)))
    doc = as_doc(EXAMPLES[tag])
    path = data.draw(st.sampled_from(list(paths(doc))))
    current = _value_at(doc, path)
    if path == ("produced_at",):
        value = data.draw(DATE_TIME_LIKE | JSON_VALUES)
    elif isinstance(current, str):
        value = data.draw(TOKEN_LIKE | JSON_VALUES)
    else:
        value = data.draw(JSON_VALUES)
    assert_agree(replaced(doc, path, value), f"{tag}: {'.'.join(map(str, path))}={value!r}")

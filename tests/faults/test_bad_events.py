"""Every bad-event class of issue 13, published into a real running fleet: each must end dead-lettered
(with its reason) or refused by the server, and none may cost an event or count one twice."""

from __future__ import annotations

import pytest

from tests.servers import HANG_GUARD_S
from workers.bench.faults.bad_events import GOOD_OUTCOMES
from workers.bench.faults.fleet import FleetShape
from workers.bench.faults.matrix import run_bad_events

pytestmark = pytest.mark.integration

CLASSES = {
    "malformed_json",
    "unknown_type",
    "wrong_schema_version",
    "non_date_produced_at",
    "empty_run_id",
    "missing_event_id",
    "body_run_not_subject_run",
    "body_group_not_subject_group",
    "claim_check_to_missing_bucket",
    "claim_check_oversized",
    "second_different_v1",
    "republished_trajectory_new_msg_id",
    "garbage_on_rewards",
    "garbage_on_metrics",
    "garbage_on_prompts_no_sampler",
}


async def test_every_bad_event_is_dead_lettered_or_refused(tmp_path, model_root):
    result = await run_bad_events(tmp_path, shape=FleetShape(islands=1), guard_s=HANG_GUARD_S, model_root=model_root)
    table = {o.cls: (o.outcome, o.seconds, o.reason, o.effects) for o in result.outcomes}
    assert set(table) == CLASSES
    assert {c: t for c, t in table.items() if t[0] not in GOOD_OUTCOMES} == {}
    assert {c: t for c, t in table.items() if not _harmless(c, t[3])} == {}
    assert (result.findings.lost, result.findings.duplicated) == (0, 0), result.findings.details


def _harmless(cls: str, effects: dict) -> bool:
    """A refused or dead-lettered event changed nothing: no reward, no second copy, no second v1."""
    if cls == "republished_trajectory_new_msg_id":  # the original keeps its one reward
        return effects.get("rewards", 0) <= 1 and "stored_copies" not in effects
    if cls == "second_different_v1":
        return effects.get("v1_messages") == 1 and not effects.get("readers_see_forged_v1")
    return not effects

"""A worker SIGKILLed during a real run (default suite): nothing acked is lost, nothing counted twice,
the archive matches the log, the islands serve the log's bits, and training resumes by itself."""

from __future__ import annotations

import pytest

from tests.servers import HANG_GUARD_S
from workers.bench.faults.faults import fault_named
from workers.bench.faults.fleet import FleetShape
from workers.bench.faults.matrix import run_fault

pytestmark = pytest.mark.integration


async def test_sigkill_of_the_reward_worker_loses_nothing_and_training_resumes(tmp_path, model_root):
    result = await run_fault(
        fault_named("sigkill_rewards"),
        tmp_path,
        shape=FleetShape(islands=1),
        guard_s=HANG_GUARD_S,
        model_root=model_root,
    )
    assert (result.lost, result.duplicated) == (0, 0), result.details
    assert "archive_count_differs_by_type" not in result.details, result.details
    assert "islands_not_serving_log_bits" not in result.details, result.details
    assert result.recovery_s is not None, result.details
    assert result.details["loop_recovery_s"] is not None, (
        result.details
    )  # samples taken after it were trained on  # a version was appended after the kill

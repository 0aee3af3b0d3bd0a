"""The whole fault matrix of issue 13, each fault on a fresh real run (slow: minutes each): SIGKILL of
every worker type, nats-server killed and restarted from its store, a 60 s nats outage, SeaweedFS
stopped for 20 s, a corrupted patch blob. After each: nothing acked lost, nothing trained or rewarded
twice, the archive equal to the log, the islands serving the log's bits, training resumed."""

from __future__ import annotations

import pytest

from tests.servers import HANG_GUARD_S
from workers.bench.faults.faults import catalogue
from workers.bench.faults.fleet import FleetShape
from workers.bench.faults.matrix import run_fault

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.parametrize("fault", catalogue(), ids=lambda f: f.name)
async def test_fault_loses_nothing_counts_nothing_twice_and_recovers(fault, tmp_path, model_root):
    result = await run_fault(fault, tmp_path, shape=FleetShape(islands=2), guard_s=HANG_GUARD_S, model_root=model_root)
    assert (result.lost, result.duplicated) == (0, 0), result.details
    assert "archive_count_differs_by_type" not in result.details, result.details
    assert "archive_drain_failed" not in result.details, result.details
    assert "islands_not_serving_log_bits" not in result.details, result.details
    assert result.recovery_s is not None, result.details
    assert result.details["loop_recovery_s"] is not None, result.details  # samples taken after it were trained on

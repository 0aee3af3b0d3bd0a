"""An island's bookkeeping: lifetime counters plus a bounded window of recent commits."""

import tracemalloc

import pytest
import torch

from pipeline.config import MaterializeSettings
from tests.chain_helpers import publisher, reference_island
from tests.tiny_models import adam_like_step, tiny_moe
from workers.sampler.island import CommitRecord, IslandSection, IslandStats
from workers.sampler.sidecar import Sidecar


def _commit(version: int) -> CommitRecord:
    return CommitRecord(version, 1e9 + version, 0.001, f"root-{version}", f"patch:v{version}")


def test_island_stats_stay_bounded_over_many_versions():
    stats = IslandStats()
    tracemalloc.start()  # before the first record, so the window's records are traced in both snapshots
    try:
        for version in range(2_000):
            stats.record(_commit(version))
        before = tracemalloc.take_snapshot()
        for version in range(2_000, 22_000):
            stats.record(_commit(version))
        grown = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(before, "filename"))
    finally:
        tracemalloc.stop()
    assert grown < 64 * 1024  # unbounded, 20k more records would be ~5 MiB
    assert len(stats.recent) == 256 and len(stats.pauses_s) == 256
    assert stats.commits == 22_000 and stats.pause_total_s == pytest.approx(22.0)
    assert sorted(stats.committed_at) == list(range(22_000 - 256, 22_000))
    assert stats.root_hashes[21_999] == "root-21999" and stats.routes[21_999] == "patch:v21999"
    assert stats.pause_by_version[21_999] == 0.001 and 0 not in stats.pause_by_version


@pytest.mark.integration
async def test_an_island_keeps_its_recent_commits_for_the_benchmark_and_the_sidecar(event_log, settings, tmp_path):
    model = tiny_moe(seed=6)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    pub = publisher(event_log, settings, model)
    section = IslandSection(island_id="stats-test", materialize=MaterializeSettings(cache_dir=tmp_path))
    island = reference_island(event_log, settings, section)
    island.stats = IslandStats(keep=2)
    await island.start(follow=False)
    roots = {}
    for version in range(4):
        if version:
            adam_like_step(state, 1e-3, torch.Generator().manual_seed(version))
        roots[version] = (await pub.publish(version, state)).views[0].root_hash
        await island.commit(version)
    stats = island.stats
    assert stats.commits == 4 and [c.version for c in stats.recent] == [2, 3]
    # what workers/bench/island_proc.py reads for each version it reports
    for version in sorted(stats.committed_at):
        assert stats.root_hashes[version] == roots[version] and stats.routes[version]
        assert stats.pause_by_version[version] >= 0
    assert stats.pause_total_s >= sum(stats.pauses_s)
    metrics = (await Sidecar(island).metrics(None)).text
    assert "sprawl_island_version 3" in metrics and "sprawl_commit_pause_seconds_count" in metrics
    # what materializing cost the disk, against the bytes of the tensors that changed
    assert stats.changed_tensor_bytes_total > 0 and stats.written_bytes_total > 0
    assert f"sprawl_materialize_written_bytes_total {stats.written_bytes_total}" in metrics
    assert all(c.changed_tensor_bytes > 0 for c in stats.recent)
    await island.stop()

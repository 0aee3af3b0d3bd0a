"""A corrupt patch in the store: islands route around it, serve what they can verify, and retry with backoff.

Blobs are corrupted in S3 right after the publisher wrote and verified them and before it appends the
event (`CorruptingBlobStore`), so an island following the chain never sees them intact. Every served
version is checked against the log's root hash; attempts are counted by the materializer's
`RouteFailures`, never timed.
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest
import torch

from pipeline.blobstore import S3BlobStore
from pipeline.config import MaterializeSettings
from pipeline.materialize import verify_directory
from pipeline.route_failures import Backoff, RouteFailures
from schemas import VersionConstraint
from tests.chain_helpers import (
    TEST_TRUST,
    CorruptingBlobStore,
    corrupt_object,
    enlarge_object,
    expected_root,
    patch_key,
    publisher,
    republish_object,
)
from tests.servers import HANG_GUARD_S, free_port
from tests.tiny_models import adam_like_step, tiny_moe
from workers.sampler.engines.reference import ReferenceEngine
from workers.sampler.island import Island, IslandSection, VersionUnreachable
from workers.sampler.settings import RouteRetrySection
from workers.sampler.sidecar import Sidecar

# ---------------------------------------------------------------- the backoff itself (no servers)


def test_backoff_is_exponential_capped_and_jittered():
    plain = Backoff(first_s=1.0, max_s=10.0, jitter=0.0)
    assert [plain.delay(n, random.Random(0)) for n in range(1, 7)] == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert plain.delay(10_000, random.Random(0)) == 10.0  # no overflow however long it fails
    jittered = Backoff(first_s=1.0, max_s=10.0, jitter=0.5)
    rng = random.Random(7)
    delays = [jittered.delay(4, rng) for _ in range(200)]
    assert all(4.0 <= d <= 8.0 for d in delays)
    assert len(set(delays)) > 100  # islands failing together do not retry together


def test_a_failed_part_is_set_aside_until_its_backoff_passes_and_cleared_when_it_works():
    now = [100.0]
    failures = RouteFailures(Backoff(first_s=2.0, max_s=5.0, jitter=0.0), clock=lambda: now[0])
    part = ("patch", 3, 4)
    assert failures.usable(part)
    first = failures.record(part, blob="s3://b/p4", reason="corrupt")
    assert (first.failures, first.delay_s, first.part, first.version) == (1, 2.0, "patch v3->v4", 4)
    assert not failures.usable(part) and failures.usable(("patch", 4, 5))
    assert failures.retry_in_s() == 2.0 and failures.retry_in_s(5, 9) is None
    now[0] += 2.0
    assert failures.usable(part) and failures.retry_in_s() is None  # nothing left to wait for
    assert [failures.record(part, blob="s3://b/p4", reason="corrupt").delay_s for _ in range(3)] == [4.0, 5.0, 5.0]
    assert failures.total == 4 and failures.by_blob == {"s3://b/p4": 4}
    assert failures.reasons(4, 4) == ["patch v3->v4: corrupt"]
    failures.cleared(part)
    assert failures.usable(part) and failures.open() == [] and failures.total == 4  # counters are lifetime


def test_route_retry_settings_refuse_a_cap_below_the_first_wait():
    with pytest.raises(ValueError, match="max_s"):
        RouteRetrySection(first_s=10.0, max_s=1.0)
    with pytest.raises(ValueError, match="jitter"):
        RouteRetrySection(jitter=1.0)


# ---------------------------------------------------------------- islands against a real store

LR = 1e-5


def _drift(state: dict[str, torch.Tensor]) -> None:
    """One optimizer-like step whose signs repeat from step to step (momentum), so a skip patch over
    two steps changes more bits than one patch and the planner tries the ordinary patch first."""
    adam_like_step(state, LR, torch.Generator().manual_seed(0))


class Chain:
    """A tiny model's chain being published, with the blobs chosen by `corrupt` corrupted in the store."""

    def __init__(self, event_log, settings, corrupt, tamper=corrupt_object, **chain):
        model = tiny_moe(seed=6)
        self.state = {k: v.clone() for k, v in model.state_dict().items()}
        self.blobs = CorruptingBlobStore(settings.blobs, corrupt, tamper)
        self.pub = publisher(event_log, settings, model, blobs=self.blobs, **chain)
        self.events = []

    async def publish_to(self, version: int) -> None:
        for v in range(len(self.events), version + 1):
            if v:
                _drift(self.state)
            event = await self.pub.publish(v, self.state)
            assert event.views[0].root_hash == expected_root(self.state, "bf16")
            self.events.append(event)

    def root(self, version: int) -> str:
        return self.events[version].views[0].root_hash


async def _island(
    event_log, settings, cache_dir, *, first_s: float, max_s: float = 3600.0, jitter: float = 0.0, blobs=None
):
    section = IslandSection(
        island_id="corrupt-patch",
        poll_interval_s=0.2,
        materialize=MaterializeSettings(cache_dir=cache_dir),
        route_retry=RouteRetrySection(first_s=first_s, max_s=max_s, jitter=jitter),
    )
    blobs = blobs or S3BlobStore(settings.blobs)
    island = Island(event_log, blobs, ReferenceEngine(), run_id=settings.run_id, settings=section, trust=TEST_TRUST)
    await island.start(follow=True)
    return island


async def _until(island: Island, predicate, what: str) -> None:
    """Wait for something the follower does; fail (not hang) if it dies or never gets there."""
    deadline = time.monotonic() + HANG_GUARD_S
    while not predicate():
        follower = island._tasks[0]
        if follower.done():
            follower.result()
            raise AssertionError(f"the follower ended before: {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        await asyncio.sleep(0.02)


def _assert_every_served_version_is_the_logs(island: Island, chain: Chain) -> None:
    assert island.stats.root_hashes, "nothing was served"
    for version, root in island.stats.root_hashes.items():
        assert root == chain.root(version), f"v{version} served with root {root}"
    current = island.materializer.current()
    assert current is not None and verify_directory(current) == chain.root(island.version)


@pytest.mark.integration
async def test_a_following_island_routes_around_a_corrupt_patch_through_a_skip_patch(event_log, settings, tmp_path):
    chain = Chain(event_log, settings, patch_key(4, 3), keyframe_every=100, skip_distances=[2])
    island = await _island(event_log, settings, tmp_path, first_s=3600.0)
    try:
        # One version at a time, so the A/B slots hold v3 (served) and v2 (standby) whatever the load:
        # an island that sees v1..v3 at once may build v3 straight from v1, leaving v1 on standby.
        for version in (1, 2, 3):
            await chain.publish_to(version)
            await _until(island, lambda v=version: island.version == v, f"serving v{version}")
        await chain.publish_to(4)
        await _until(island, lambda: island.version == 4, "serving v4")
        [corrupt] = chain.blobs.corrupted
        ordinary, [skip] = chain.events[4].views[0], chain.events[4].views[0].skip_patches
        assert ordinary.bytes < skip.bytes  # so the ordinary patch was the plan, and it was tried
        assert island.stats.routes[4] == "cache:v2 -> skip:v4"
        assert island.materializer.failures.by_blob == {corrupt: 1}
        await chain.publish_to(5)
        await _until(island, lambda: island.version == 5, "serving the head")
        # The standby slot (v3) catches up around the set-aside patch to v4 with the skip patch to v5.
        assert island.stats.routes[5] == "cache:v3 -> skip:v5"
        assert island.blocked is None and island.state == "serving"
        _assert_every_served_version_is_the_logs(island, chain)
        assert island.materializer.failures.total == 1
    finally:
        await island.stop()


@pytest.mark.integration
async def test_without_a_skip_patch_the_island_serves_the_last_buildable_version_until_the_next_keyframe(
    event_log, settings, tmp_path
):
    chain = Chain(event_log, settings, patch_key(4, 3), keyframe_every=8)
    island = await _island(event_log, settings, tmp_path, first_s=3600.0)
    try:
        await chain.publish_to(1)
        await _until(island, lambda: island.version == 1, "serving v1")
        await chain.publish_to(7)  # v4's patch is corrupt: v2 and v3 can be built, nothing after
        await _until(island, lambda: island.blocked is not None and island.blocked.head == 7, "blocked at v7")
        [corrupt] = chain.blobs.corrupted
        assert island.version == 3 and island.blocked.serving == 3
        assert island.state == "catching_up" and corrupt in island.blocked.reason
        # Woken again and again (a version a second under `sprawl up`), it plans but fetches nothing:
        # the corrupt patch stays set aside for its backoff.
        for _ in range(5):
            assert await island.advance(7) == 3
        assert island.materializer.failures.by_blob == {corrupt: 1}
        # Requests that accept v3 are served; one that insists on the head is refused (409 / nak).
        assert await island.ensure_version(None) == 3
        with pytest.raises(VersionUnreachable) as refused:
            await island.ensure_version(VersionConstraint(min_version=7), wait_for_log=False)
        assert refused.value.current == 3
        ready = await Sidecar(island).readyz(None)
        assert ready.status == 200 and '"blocked": {"head": 7' in ready.text
        metrics = (await Sidecar(island).metrics(None)).text
        assert "sprawl_island_blocked_head 7" in metrics and "sprawl_route_failures_total 1" in metrics
        _assert_every_served_version_is_the_logs(island, chain)

        await chain.publish_to(8)  # the next keyframe: a route that does not need v4
        await _until(island, lambda: island.version == 8, "serving the keyframe")
        assert island.stats.routes[8] == "keyframe:v8"
        assert island.blocked is None and island.state == "serving"
        assert island.materializer.failures.by_blob == {corrupt: 1}
        _assert_every_served_version_is_the_logs(island, chain)
    finally:
        await island.stop()


@pytest.mark.integration
async def test_retries_back_off_and_a_republished_blob_is_picked_up(event_log, settings, tmp_path):
    chain = Chain(event_log, settings, patch_key(2, 1), keyframe_every=100)
    island = await _island(event_log, settings, tmp_path, first_s=0.05, max_s=0.4)
    try:
        await chain.publish_to(0)  # served alone first, so v0 is the standby slot whatever the load
        await _until(island, lambda: island.version == 0, "serving v0")
        await chain.publish_to(3)
        [corrupt] = chain.blobs.corrupted
        failures = island.materializer.failures
        await _until(island, lambda: failures.by_blob[corrupt] >= 5, "five failed attempts")
        assert island.version == 1 and island.blocked is not None and island.blocked.head == 3
        [failure] = [f for f in failures.open() if f.blob == corrupt]
        # each retry waited twice as long as the one before, up to the cap (jitter 0 here)
        assert failure.failures >= 5 and failure.delay_s == pytest.approx(min(0.4, 0.05 * 2 ** (failure.failures - 1)))
        republish_object(chain.blobs, corrupt, chain.blobs.corrupted[corrupt])
        await _until(island, lambda: island.version == 3, "serving the head from the re-published blob")
        # from the standby slot (v0), v1's patch read from the local store
        assert island.stats.routes[3] == "cache:v0 -> patch:v1 -> patch:v2 -> patch:v3"
        assert island.blocked is None and failures.open() == []
        _assert_every_served_version_is_the_logs(island, chain)
    finally:
        await island.stop()


@pytest.mark.integration
async def test_a_patch_swapped_for_a_larger_blob_is_refused_by_its_size_and_leaves_no_file(
    event_log, settings, tmp_path
):
    chain = Chain(event_log, settings, patch_key(2, 1), tamper=enlarge_object, keyframe_every=100)
    island = await _island(event_log, settings, tmp_path, first_s=3600.0)
    try:
        await chain.publish_to(2)
        [swapped] = chain.blobs.corrupted
        await _until(island, lambda: island.blocked is not None and island.blocked.head == 2, "blocked at v2")
        assert island.version == 1 and island.materializer.failures.by_blob == {swapped: 1}
        assert "larger than the" in island.blocked.reason and "bytes its version names" in island.blocked.reason
        # Nothing of it stays on disk: not in the patch store, not as a temp file beside it.
        leftovers = [p for p in tmp_path.rglob("*") if p.is_file() and p.stat().st_size >= 4 << 20]
        assert leftovers == []
        _assert_every_served_version_is_the_logs(island, chain)
    finally:
        await island.stop()


@pytest.mark.integration
async def test_an_island_started_after_a_corrupt_patch_serves_the_newest_keyframe(event_log, settings, tmp_path):
    corrupt_v2_and_v5 = lambda key: patch_key(2, 1)(key) or patch_key(5, 4)(key)  # noqa: E731
    chain = Chain(event_log, settings, corrupt_v2_and_v5, keyframe_every=4)
    await chain.publish_to(6)
    before_keyframe, after_keyframe = sorted(chain.blobs.corrupted, key=lambda uri: "/v00000005-" in uri)
    island = await _island(event_log, settings, tmp_path, first_s=3600.0)
    try:
        await _until(island, lambda: island.blocked is not None and island.blocked.head == 6, "blocked at v6")
        assert island.version == 4 and island.stats.routes[4] == "keyframe:v4"
        assert island.stats.commits == 1  # started from the keyframe, not from v0 through v2's patch
        assert island.materializer.failures.by_blob == {after_keyframe: 1}
        assert before_keyframe not in island.materializer.failures.by_blob
        for _ in range(5):
            assert await island.advance(6) == 4
        assert island.materializer.failures.by_blob == {after_keyframe: 1}
        _assert_every_served_version_is_the_logs(island, chain)
    finally:
        await island.stop()


@pytest.mark.integration
async def test_an_island_that_can_build_nothing_refuses_and_says_why(event_log, settings, tmp_path):
    chain = Chain(event_log, settings, lambda _key: False, keyframe_every=100)
    await chain.publish_to(1)
    shard = next(b for b in chain.events[0].views[0].blobs if b.name.endswith(".safetensors"))
    corrupt_object(chain.blobs, shard.uri)  # the only keyframe: no version can be verified
    island = await _island(event_log, settings, tmp_path, first_s=3600.0)
    try:
        for _ in range(3):  # each request is refused at once; the keyframe is not fetched again
            with pytest.raises(VersionUnreachable, match="corrupt after a refetch") as refused:
                await island.ensure_version(None)
            assert refused.value.current is None
        assert island.materializer.failures.by_blob == {shard.uri: 1}
        assert island.version is None and island.state == "starting" and island.blocked.head == 1
        ready = await Sidecar(island).readyz(None)
        assert ready.status == 503
    finally:
        await island.stop()


@pytest.mark.integration
async def test_a_store_that_does_not_answer_is_retried_with_growing_waits(event_log, settings, tmp_path):
    chain = Chain(event_log, settings, lambda _key: False, keyframe_every=100)
    await chain.publish_to(0)
    nobody = settings.blobs.model_copy(update={"endpoint_url": f"http://127.0.0.1:{free_port()}", "max_attempts": 1})
    island = await _island(event_log, settings, tmp_path, first_s=0.05, max_s=0.2, blobs=S3BlobStore(nobody))
    try:
        await _until(island, lambda: island.follow_failures >= 4, "four failed rounds")
        failure = island.follow_failure
        assert failure is not None and "BlobStoreUnavailable" in failure.error
        assert failure.delay_s == pytest.approx(min(0.2, 0.05 * 2 ** (failure.failures - 1)))
        # an outage is no verdict on the blobs: nothing was set aside, and serving starts once it ends
        assert island.materializer.failures.total == 0 and island.version is None
        island.materializer.blobs = S3BlobStore(settings.blobs)  # the store is back
        await _until(island, lambda: island.version == 0, "serving once the store answers")
        assert island.follow_failure is None and island.state == "serving"
        _assert_every_served_version_is_the_logs(island, chain)
    finally:
        await island.stop()

"""The trainer publishes beside its updates: the update waits only when `publish_depth` versions are
in flight, versions reach the log strictly in order (metrics after their version), a checkpoint
waits for its version, a stopping trainer publishes every version it computed, and a version that
cannot be published stops the trainer loudly: none after it appended, none skipped.

Slow and failing uploads are the real S3 store with one version's policy blobs held back until the
test lets them go, or written to a bucket that does not exist."""

import asyncio
import threading
import time
import uuid

import pytest
import torch
from pydantic import ValidationError

from pipeline.blobstore import S3BlobStore
from pipeline.errors import WorkerPartFailed
from pipeline.replay import replay
from pipeline.topology import METRICS
from pipeline.version_log import chain_head, fetch_version
from schemas import TrainerMetrics
from tests.chain_helpers import signed_trust
from tests.servers import HANG_GUARD_S
from tests.tiny_models import tiny_moe
from tests.trainer_data import make_groups, publish_groups, write_initial_model
from workers.trainer.checkpoint import latest_checkpoint
from workers.trainer.loop import Trainer
from workers.trainer.publishing import BackgroundPublisher, PublishFailed, copy_weights
from workers.trainer.settings import TrainerSection, TrainerSettings


def _policy_blob_of(version: int, key: str | None) -> bool:
    return key is not None and f"/policy/v{version:08d}-" in key


class HeldUploads(S3BlobStore):
    """The real store, except that uploads of one version's policy blobs wait until `release` is set:
    an upload exactly as slow as the test needs, without a sleep."""

    def __init__(self, settings, version: int):
        super().__init__(settings)
        self.version = version
        self.release = threading.Event()

    def _hold(self, key: str | None) -> None:
        if _policy_blob_of(self.version, key) and not self.release.wait(HANG_GUARD_S):
            raise TimeoutError("the test never released the held upload")

    def put_bytes(self, data, key=None, **kw):
        self._hold(key)
        return super().put_bytes(data, key, **kw)

    def put_file(self, path, key, **kw):
        self._hold(key)
        return super().put_file(path, key, **kw)


class BucketGoneFor(S3BlobStore):
    """The real store, except that one version's policy blobs are written to a bucket that does not
    exist: the S3 server refuses them, as it would once the bucket was removed under the trainer."""

    def __init__(self, settings, version: int):
        super().__init__(settings)
        self.version = version
        self.gone = S3BlobStore(settings.model_copy(update={"bucket": f"gone-{uuid.uuid4().hex[:12]}"}))

    def put_bytes(self, data, key=None, **kw):
        if _policy_blob_of(self.version, key):
            return self.gone.put_bytes(data, key, **kw)
        return super().put_bytes(data, key, **kw)

    def put_file(self, path, key, **kw):
        if _policy_blob_of(self.version, key):
            return self.gone.put_file(path, key, **kw)
        return super().put_file(path, key, **kw)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_initial_model(tmp_path_factory.mktemp("initial"))


def _trainer(event_log, settings, model_dir, blobs, **trainer) -> Trainer:
    section = TrainerSection(
        model_dir=model_dir, groups_per_batch=2, trainer_id="t-bg", **{"checkpoint_every": 100, **trainer}
    )
    trainer_settings = TrainerSettings(
        **settings.model_dump(include={"run_id", "nats", "blobs", "log", "streams"}),
        trust=signed_trust(),
        trainer=section,
    )
    return Trainer(trainer_settings, event_log, blobs)


async def _until(run: asyncio.Task, predicate, what: str) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while not predicate():
        assert not run.done(), f"the trainer ended before {what}: {run}"
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(0.01)


async def _metrics(event_log, run_id) -> list[TrainerMetrics]:
    return [
        r.event
        async for r in replay(event_log, METRICS.name, f"rl.{run_id}.metrics.>")
        if isinstance(r.event, TrainerMetrics)
    ]


@pytest.mark.integration
async def test_the_update_waits_only_when_the_queue_is_full_and_versions_stay_in_order(event_log, settings, model_dir):
    await publish_groups(event_log, make_groups(model_dir, settings.run_id, 10))
    blobs = HeldUploads(settings.blobs, version=1)
    trainer = _trainer(event_log, settings, model_dir, blobs, publish_depth=2, max_versions=5)
    run = asyncio.create_task(trainer.run(asyncio.Event()))
    try:
        await _until(run, lambda: trainer.background.waiting and trainer.version == 3, "the update waits")
        waiting_seen = time.perf_counter()
        # v1 is being uploaded, v2 is queued, v3 is computed and waits for a snapshot: two versions in
        # flight, the update ran ahead by exactly the depth and no further, and nothing is appended yet.
        assert trainer.background.submitted == 2 and trainer.step == 3
        assert trainer.published == [0] and await fetch_version(event_log, settings.run_id, 1) is None
    finally:
        released = time.perf_counter()
        blobs.release.set()
    await asyncio.wait_for(run, HANG_GUARD_S)

    assert trainer.published == [0, 1, 2, 3, 4, 5]
    events = [await fetch_version(event_log, settings.run_id, v) for v in range(6)]
    assert [e.parent_version for e in events] == [None, 0, 1, 2, 3, 4]
    assert [e.trainer_step for e in events] == [0, 1, 2, 3, 4, 5]
    metrics = await _metrics(event_log, settings.run_id)
    assert [(m.version, m.step) for m in metrics] == [(v, v) for v in range(1, 6)]
    for m, event in zip(metrics, events[1:], strict=True):
        assert m.produced_at >= event.produced_at  # a step's metrics follow its version
        assert m.metrics["publish_s"] > 0 and m.metrics["publish_wait_s"] > 0
    # v3's capture waited all the while v1 was held: the wait is measured, not hidden.
    assert metrics[2].metrics["publish_wait_s"] >= released - waiting_seen


@pytest.mark.integration
async def test_a_stopping_trainer_publishes_every_version_it_computed(event_log, settings, model_dir):
    await publish_groups(event_log, make_groups(model_dir, settings.run_id, 12))
    blobs = HeldUploads(settings.blobs, version=1)
    trainer = _trainer(event_log, settings, model_dir, blobs, publish_depth=2)
    stop = asyncio.Event()
    run = asyncio.create_task(trainer.run(stop))
    try:
        await _until(run, lambda: trainer.background.waiting and trainer.version == 3, "three versions computed")
        stop.set()
    finally:
        blobs.release.set()
    await asyncio.wait_for(run, HANG_GUARD_S)
    assert trainer.published == [0, 1, 2, 3]
    head = await chain_head(event_log, settings.run_id)
    assert head is not None and head.version == 3
    assert [m.version for m in await _metrics(event_log, settings.run_id)] == [1, 2, 3]


@pytest.mark.integration
async def test_a_checkpoint_waits_until_its_version_is_in_the_chain(event_log, settings, model_dir):
    await publish_groups(event_log, make_groups(model_dir, settings.run_id, 6))
    blobs = HeldUploads(settings.blobs, version=2)
    trainer = _trainer(event_log, settings, model_dir, blobs, publish_depth=2, checkpoint_every=2, max_versions=3)
    run = asyncio.create_task(trainer.run(asyncio.Event()))
    try:
        await _until(
            run,
            lambda: trainer.background.waiting and trainer.version == 2 and trainer.published == [0, 1],
            "the checkpoint of v2 waits for v2",
        )
        assert await latest_checkpoint(event_log, settings.run_id) is None
        assert trainer.step == 2  # and the next update waits with it: the checkpoint holds this state
    finally:
        blobs.release.set()
    await asyncio.wait_for(run, HANG_GUARD_S)
    checkpoint = await latest_checkpoint(event_log, settings.run_id)
    assert checkpoint is not None and (checkpoint.version, checkpoint.step) == (2, 2)
    assert trainer.published == [0, 1, 2, 3]


@pytest.mark.integration
async def test_a_version_that_cannot_be_published_stops_the_trainer_and_nothing_after_it_is_appended(
    event_log, settings, model_dir
):
    await publish_groups(event_log, make_groups(model_dir, settings.run_id, 10))
    blobs = BucketGoneFor(settings.blobs, version=3)
    trainer = _trainer(event_log, settings, model_dir, blobs, publish_depth=2, max_versions=5)
    with pytest.raises(WorkerPartFailed) as failure:
        await asyncio.wait_for(trainer.run(asyncio.Event()), HANG_GUARD_S)
    message = str(failure.value)
    assert "the trainer's publisher failed: publishing policy version 3 failed" in message, message
    assert blobs.gone.bucket in message  # the store's own refusal, named
    assert isinstance(failure.value.__cause__, PublishFailed) and failure.value.__cause__.version == 3

    # The trainer had computed v3 (and maybe more), but the chain stops at v2: nothing skipped, nothing after.
    assert trainer.background.submitted >= 3 and trainer.published == [0, 1, 2]
    head = await chain_head(event_log, settings.run_id)
    assert head is not None and head.version == 2
    for version in (3, 4, 5):
        assert await fetch_version(event_log, settings.run_id, version) is None
    assert [m.version for m in await _metrics(event_log, settings.run_id)] == [1, 2]

    # A restart with a working store resumes from the head: v1 and v2 re-derived, then v3 and v4 published.
    restarted = _trainer(event_log, settings, model_dir, S3BlobStore(settings.blobs), publish_depth=2, max_versions=4)
    await asyncio.wait_for(restarted.run(asyncio.Event()), HANG_GUARD_S)
    assert restarted.published == [3, 4]
    assert [(await fetch_version(event_log, settings.run_id, v)).parent_version for v in (3, 4)] == [2, 3]


def test_a_snapshot_keeps_ties_reuses_its_buffers_and_ignores_later_updates():
    model = tiny_moe(tie_word_embeddings=True)
    state = model.state_dict()
    assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    snapshot: dict[str, torch.Tensor] = {}
    copy_weights(snapshot, state)
    assert snapshot.keys() == state.keys()
    assert snapshot["lm_head.weight"] is snapshot["model.embed_tokens.weight"]  # copied once, still tied
    before = {n: t.clone() for n, t in state.items()}
    addresses = {n: t.data_ptr() for n, t in snapshot.items()}
    with torch.no_grad():
        for tensor in model.parameters():
            tensor.add_(1.0)  # the next update, in place
    assert all(torch.equal(snapshot[n], before[n]) for n in state)
    assert not torch.equal(snapshot["lm_head.weight"], model.state_dict()["lm_head.weight"])
    copy_weights(snapshot, model.state_dict())  # the next capture reuses the same memory
    assert {n: t.data_ptr() for n, t in snapshot.items()} == addresses
    assert all(torch.equal(snapshot[n], t) for n, t in model.state_dict().items())


def test_a_snapshot_is_bit_exact_for_every_dtype_and_layout():
    """The CPU copy is a byte copy: NaN payloads, -0.0, fp8, bool, a transposed (non-contiguous) tensor,
    a scalar and an empty tensor all come back with the same bits, shape and dtype."""
    odd = torch.tensor([float("nan"), -0.0, float("inf"), 1e-45]).view(torch.int32)
    odd[0] |= 0x1234  # a NaN with a payload
    state = {
        "f32": odd.view(torch.float32),
        "bf16": torch.randn(7, 3).to(torch.bfloat16),
        "fp8": torch.randn(64).to(torch.float8_e4m3fn),
        "mask": torch.rand(10) > 0.5,
        "transposed": torch.randn(5, 4).t(),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 3),
    }
    snapshot: dict[str, torch.Tensor] = {"gone": torch.zeros(1)}
    copy_weights(snapshot, state)
    assert snapshot.keys() == state.keys()  # an entry the state no longer has is dropped
    for name, tensor in state.items():
        copy = snapshot[name]
        assert (copy.dtype, copy.shape) == (tensor.dtype, tensor.shape), name
        assert copy.data_ptr() != tensor.data_ptr() or tensor.numel() == 0, name
        assert torch.equal(copy.reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name


@pytest.mark.parametrize("depth", [0, -1, 17])
def test_a_publish_depth_out_of_bounds_is_refused_naming_it(depth):
    with pytest.raises(ValidationError, match="publish_depth"):
        TrainerSection(publish_depth=depth)


async def test_a_blocked_caller_is_kept_company_until_the_publish_lands():
    """Blocked on a full queue (a store outage is waited out for minutes), the caller's `while_waiting`
    runs every period: a trainer of several ranks tells the others it is alive, or their wait for its
    next command would time out. It stops once the publish lands."""
    release = asyncio.Event()
    published: list[int] = []
    beats: list[float] = []

    async def publish(pending) -> None:
        await release.wait()
        published.append(pending.version)

    async def beat() -> None:
        beats.append(time.monotonic())
        if len(beats) == 3:
            release.set()

    background = BackgroundPublisher(publish, 1, name="test publisher", while_waiting=beat, while_waiting_every_s=0.01)
    task = background.start()
    try:
        state = {"w": torch.zeros(4)}
        await background.submit(1, state, None)  # takes the only snapshot
        await background.submit(2, state, None)  # waits for it: beats until the publish lands
        after = len(beats)
        await background.drain()
        assert after >= 3 and published == [1, 2]
    finally:
        task.cancel()


async def test_without_while_waiting_nothing_but_the_wait_runs():
    background = BackgroundPublisher(lambda pending: asyncio.sleep(0), 1, name="test publisher")
    task = background.start()
    try:
        await background.submit(1, {"w": torch.zeros(2)}, None)
        await background.submit(2, {"w": torch.zeros(2)}, None)
        await background.drain()
        assert background.published == 2
    finally:
        task.cancel()

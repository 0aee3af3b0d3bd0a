"""The version chain end to end: publish through ChainPublisher, materialize through Materializer."""

import asyncio
import json
import subprocess
import sys

import pytest
import torch
from transformers import Qwen3MoeForCausalLM

from pipeline.blobstore import S3BlobStore
from pipeline.chain_publish import VersionOutOfOrder
from pipeline.errors import AppendConflict
from pipeline.materialize import MaterializeError, VersionUnbuildable, verify_directory
from pipeline.route_failures import Backoff, RouteFailures
from pipeline.version_log import VersionNotAvailable
from tests.chain_helpers import corrupt_object, expected_root, materializer, publisher, republish_object
from tests.servers import connection_env
from tests.tiny_models import adam_like_step, tiny_moe

pytestmark = pytest.mark.integration


async def _publish_chain(event_log, settings, versions: int, lr: float = 1e-5, drift: bool = False, **chain):
    """`drift`: every step has the same signs (momentum), so a skip patch over k steps changes more
    bits than one patch; otherwise random signs cancel and skip patches come out smaller."""
    model = tiny_moe()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    pub = publisher(event_log, settings, model, **chain)
    gen = torch.Generator().manual_seed(1)
    roots, events = [], []
    for v in range(versions):
        if v:
            adam_like_step(state, lr, torch.Generator().manual_seed(0) if drift else gen)
        events.append(await pub.publish(v, state))
        roots.append({view: expected_root(state, view) for view in chain.get("views", ["bf16"])})
    pub.close()
    return model, state, roots, events


async def test_twenty_versions_materialize_bit_exact_along_every_route(event_log, settings, tmp_path):
    views = ["bf16", "fp8_e4m3"]
    _, _, roots, events = await _publish_chain(
        event_log, settings, 20, views=views, keyframe_every=7, skip_distances=[4]
    )
    for v, event in enumerate(events):
        for entry in event.views:
            assert entry.root_hash == roots[v][entry.view]
            assert entry.kind == ("keyframe" if v % 7 == 0 else "patch")
            if entry.kind == "patch":
                assert 0 < entry.changed_elements < entry.total_elements
                assert entry.bytes < 0.5 * events[v - v % 7].views[views.index(entry.view)].bytes
    assert [s.base_version for s in events[9].views[0].skip_patches] == [5]

    # A follower that materializes every version, in two slots (A/B): the standby one is patched in place.
    follower = materializer(event_log, settings, tmp_path / "follower", view="fp8_e4m3")
    for v in range(20):
        got = await follower.materialize(v)
        assert got.root_hash == roots[v]["fp8_e4m3"] == verify_directory(got.path)
        entry = events[v].views[1]
        if v == 0:
            assert (got.route, got.slot) == ("keyframe:v0", "new")
        elif v == 1:  # one slot so far: the served keyframe is copied once to make the second
            assert (got.route, got.slot) == ("cache:v0 -> patch:v1", "copy of v0")
        else:  # the standby slot catches up two versions, the older patch read from the local store
            last = "patch" if entry.kind == "patch" else "skip"  # a keyframe is reached by its patch from v-1
            assert got.route == f"cache:v{v - 2} -> {'patch' if v % 7 != 1 else 'skip'}:v{v - 1} -> {last}:v{v}"
            assert got.slot == f"recycled v{v - 2}"
        # every blob crosses the network once, and onto a keyframe only its patch from v-1
        onto_keyframe = {s.base_version: s.bytes for s in entry.skip_patches}.get(v - 1)
        assert got.downloaded_bytes == (entry.bytes if entry.kind == "patch" or v == 0 else onto_keyframe)
    assert follower.current() == follower.path_of(19)
    assert follower.cached_versions() == [18, 19]  # keep_versions: the served one and the standby

    # A fresh sampler: nearest keyframe, then the cheapest mix of patches and skip-patches.
    fresh = materializer(event_log, settings, tmp_path / "fresh")
    got = await fresh.materialize(19)
    assert got.route.startswith("keyframe:v14")
    assert verify_directory(got.path) == roots[19]["bf16"]
    assert (got.path / "generation_config.json").exists()

    # A laggard at v3 catches up to v12: walking patches from its cache beats a keyframe download.
    laggard = materializer(event_log, settings, tmp_path / "laggard")
    await laggard.materialize(3)
    got = await laggard.materialize(12)
    assert verify_directory(got.path) == roots[12]["bf16"]
    assert got.route.startswith(("cache:v3", "keyframe:v7"))
    patch_bytes = sum(events[v].views[0].bytes for v in range(4, 13))
    assert got.downloaded_bytes <= patch_bytes


async def test_materialized_keyframe_generates_like_the_in_memory_model(event_log, settings, tmp_path):
    model, state, _, _ = await _publish_chain(event_log, settings, 3, keyframe_every=2)
    got = await materializer(event_log, settings, tmp_path).materialize(2)
    loaded = Qwen3MoeForCausalLM.from_pretrained(got.path, dtype=torch.bfloat16).eval()
    model.load_state_dict(state)
    reference = model.to(torch.bfloat16).eval()
    prompt = torch.tensor([[1, 5, 9, 17, 33]])
    with torch.no_grad():
        a = reference.generate(prompt, max_new_tokens=12, do_sample=False)
        b = loaded.generate(prompt, max_new_tokens=12, do_sample=False)
    assert torch.equal(a, b)
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, reference.state_dict()[name]), name


def _tamper(settings, uri: str) -> None:
    corrupt_object(S3BlobStore(settings.blobs), uri)


def _delete(settings, uri: str) -> str:
    bucket, key = uri.removeprefix("s3://").split("/", 1)
    S3BlobStore(settings.blobs).client.delete_object(Bucket=bucket, Key=key)
    return key


async def test_corrupt_patch_is_refetched_then_the_keyframe_route_taken(event_log, settings, tmp_path):
    _, _, roots, events = await _publish_chain(event_log, settings, 5, keyframe_every=3)
    sampler = materializer(event_log, settings, tmp_path)
    await sampler.materialize(1)
    _tamper(settings, events[2].views[0].blobs[0].uri)
    # Cheapest is cache:v1 -> v2 -> v3 -> v4; v2's patch is corrupt, so the keyframe at v3 is used.
    got = await sampler.materialize(4)
    assert got.route == "keyframe:v3 -> patch:v4"
    assert verify_directory(got.path) == roots[4]["bf16"]
    # Where no other route exists, the error names the corrupt blob.
    with pytest.raises(MaterializeError, match="corrupt after a refetch") as info:
        await sampler.materialize(2)
    assert events[2].views[0].blobs[0].uri in str(info.value)


async def test_a_corrupt_patch_is_routed_around_through_a_skip_patch(event_log, settings, tmp_path):
    _, _, roots, events = await _publish_chain(
        event_log, settings, 5, drift=True, keyframe_every=100, skip_distances=[2]
    )
    patch, [skip] = events[4].views[0], events[4].views[0].skip_patches
    assert patch.bytes < skip.bytes  # the ordinary patch is the plan, so it is tried and fails
    sampler = materializer(event_log, settings, tmp_path)
    for v in (1, 2, 3):
        await sampler.materialize(v)
    _tamper(settings, patch.blobs[0].uri)
    got = await sampler.materialize(4)
    assert got.route == "cache:v2 -> skip:v4"
    assert got.root_hash == roots[4]["bf16"] == verify_directory(got.path)
    assert sampler.failures.by_blob == {patch.blobs[0].uri: 1}


async def test_a_corrupt_part_is_set_aside_for_its_backoff_then_a_republished_blob_is_used(
    event_log, settings, tmp_path
):
    _, _, roots, events = await _publish_chain(event_log, settings, 3, keyframe_every=100)
    uri = events[2].views[0].blobs[0].uri
    original = corrupt_object(S3BlobStore(settings.blobs), uri)
    now = [0.0]
    sampler = materializer(event_log, settings, tmp_path)
    sampler.failures = RouteFailures(Backoff(first_s=30.0, max_s=60.0, jitter=0.0), clock=lambda: now[0])
    await sampler.materialize(1)
    for _ in range(3):  # asked again and again within the backoff: the blob is not fetched again
        with pytest.raises(VersionUnbuildable, match="corrupt after a refetch") as info:
            await sampler.materialize(2)
        assert uri in str(info.value) and info.value.retry_in_s == 30.0
    assert sampler.failures.by_blob == {uri: 1}
    now[0] = 30.0  # the backoff has passed: tried again, still corrupt, and set aside for twice as long
    with pytest.raises(VersionUnbuildable):
        await sampler.materialize(2)
    assert sampler.failures.by_blob == {uri: 2} and sampler.failures.retry_in_s() == 60.0
    republish_object(S3BlobStore(settings.blobs), uri, original)
    now[0] = 90.0
    got = await sampler.materialize(2)
    assert got.route == "cache:v1 -> patch:v2" and verify_directory(got.path) == roots[2]["bf16"]
    assert sampler.failures.open() == [] and sampler.failures.total == 2


async def test_the_newest_buildable_version_reaches_back_past_a_corrupt_keyframe(event_log, settings, tmp_path):
    _, _, roots, events = await _publish_chain(event_log, settings, 7, keyframe_every=3)
    shard = next(b for b in events[6].views[0].blobs if b.name.endswith(".safetensors"))
    _tamper(settings, shard.uri)  # v6's keyframe: v6 and v7 cannot be built at all
    _tamper(settings, events[5].views[0].blobs[0].uri)  # and v5's patch: v3 -> v4 is as far as it goes
    fresh = materializer(event_log, settings, tmp_path)
    with pytest.raises(VersionUnbuildable, match="keyframe v6"):
        await fresh.materialize(6)
    got = await fresh.materialize_newest(6)
    assert got.version == 4 and got.route == "keyframe:v3 -> patch:v4"
    assert got.root_hash == roots[4]["bf16"] == verify_directory(got.path)
    assert fresh.failures.by_blob == {shard.uri: 1, events[5].views[0].blobs[0].uri: 1}
    # Nothing newer than what an island already serves: unbuildable, and nothing fetched again.
    with pytest.raises(VersionUnbuildable):
        await fresh.materialize_newest(6, above=4)
    assert fresh.failures.total == 2


async def test_missing_blobs_are_named(event_log, settings, tmp_path):
    _, _, _, events = await _publish_chain(event_log, settings, 5, keyframe_every=3)
    patch_key = _delete(settings, events[2].views[0].blobs[0].uri)
    with pytest.raises(MaterializeError, match=patch_key):
        await materializer(event_log, settings, tmp_path / "a").materialize(2)
    shard = next(b for b in events[3].views[0].blobs if b.name.endswith(".safetensors"))
    keyframe_key = _delete(settings, shard.uri)
    with pytest.raises(MaterializeError, match=keyframe_key):
        await materializer(event_log, settings, tmp_path / "b").materialize(4)


async def test_second_trainer_cannot_fork_the_chain(event_log, settings):
    model = tiny_moe()
    state = model.state_dict()
    first = publisher(event_log, settings, model)
    await first.publish(0, state)
    rival = publisher(event_log, settings, model)
    await rival.open()
    await first.publish(1, state)
    with pytest.raises(AppendConflict, match="second trainer"):
        await rival.publish(1, state)
    with pytest.raises(VersionOutOfOrder, match="head is 1"):
        await first.publish(3, state)


async def test_a_version_not_in_the_log_is_waited_for(event_log, settings, tmp_path):
    model = tiny_moe()
    pub = publisher(event_log, settings, model)
    await pub.publish(0, model.state_dict())
    sampler = materializer(event_log, settings, tmp_path, wait_for_version_s=0.5)
    with pytest.raises(VersionNotAvailable, match="version 1"):
        await sampler.materialize(1)
    patient = materializer(event_log, settings, tmp_path, wait_for_version_s=30)
    waiting = asyncio.create_task(patient.materialize(1))
    await asyncio.sleep(0.3)
    assert not waiting.done()
    await pub.publish(1, model.state_dict())
    assert (await waiting).version == 1


async def test_two_processes_materializing_into_one_cache(event_log, settings, tmp_path):
    _, _, roots, _ = await _publish_chain(event_log, settings, 5, keyframe_every=10)
    env = {
        "SPRAWL_RUN_ID": settings.run_id,
        **connection_env(settings, "sampler"),
    }
    cmd = [sys.executable, "-m", "tests.materialize_proc", str(tmp_path / "shared"), "4"]
    import os

    procs = [subprocess.Popen(cmd, env={**os.environ, **env}, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [json.loads(p.communicate(timeout=120)[0].strip().splitlines()[-1]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert {o["root_hash"] for o in outputs} == {roots[4]["bf16"]}
    assert sorted(o["downloaded_bytes"] == 0 for o in outputs) == [False, True]  # the second found it done
    cache = tmp_path / "shared" / settings.run_id / "bf16"
    assert sorted(p.name for p in cache.iterdir() if not p.name.startswith(".")) == ["current", "v00000004"]
    assert not list(cache.glob(".tmp-*"))  # no half-built directory left behind


async def test_a_cached_base_that_does_not_match_is_refused(event_log, settings, tmp_path):
    from safetensors.torch import load_file, save_file

    _, _, roots, _ = await _publish_chain(event_log, settings, 3, keyframe_every=10)
    cached = await materializer(event_log, settings, tmp_path).materialize(1)
    shard = next(cached.path.glob("*.safetensors"))
    tensors = load_file(shard)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] += 1  # one served value silently different on disk
    save_file(tensors, str(shard), metadata={"format": "pt"})
    # A process that did not build v1 hashes it before using it (a restarted island, another sampler).
    sampler = materializer(event_log, settings, tmp_path)
    got = await sampler.materialize(2)
    assert got.route.startswith("keyframe:v0")
    assert verify_directory(got.path) == roots[2]["bf16"]
    assert sampler.cached_versions() == [2]  # the altered v1 was removed, not kept as a standby

    # The process that built it trusts it (same generation) but not blindly: the bits it gives a patch
    # are checked against the patch's targets, and a mismatch is blamed on the cache, not on the patch.
    builder = materializer(event_log, settings, tmp_path / "builder")
    cached = await builder.materialize(1)
    shard = next(cached.path.glob("*.safetensors"))
    tensors = load_file(shard)
    name = max(tensors, key=lambda n: tensors[n].numel())  # the biggest tensor: changed by the next patch
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] += 1
    save_file(tensors, str(shard), metadata={"format": "pt"})
    got = await builder.materialize(2)
    assert got.route.startswith("keyframe:v0") and verify_directory(got.path) == roots[2]["bf16"]
    assert builder.failures.total == 0  # the good patch to v2 was not set aside

"""A keyframe version also ships a patch from the version before it: a follower never downloads a
whole keyframe just because the trainer wrote one, and its bits are still exactly the keyframe's."""

import pytest
import torch

from pipeline.blobstore import S3BlobStore
from pipeline.materialize import verify_directory
from tests.chain_helpers import CorruptingBlobStore, expected_root, materializer, patch_key, publisher
from tests.tiny_models import adam_like_step, tiny_moe

pytestmark = pytest.mark.integration

VIEWS = ["bf16", "fp8_e4m3"]


async def _publish(pub, state, versions, gen, roots):
    events = []
    for v in versions:
        if v:
            adam_like_step(state, 1e-5, gen)
        events.append(await pub.publish(v, state))
        roots[v] = {view: expected_root(state, view) for view in VIEWS}
    return events


async def test_a_follower_reaches_a_keyframe_through_its_patch_bit_exact(event_log, settings, tmp_path):
    model = tiny_moe()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    pub = publisher(event_log, settings, model, views=VIEWS, keyframe_every=3)
    roots: dict[int, dict[str, str]] = {}
    events = await _publish(pub, state, range(5), torch.Generator().manual_seed(1), roots)
    pub.close()

    for index, view in enumerate(VIEWS):
        keyframe = events[3].views[index]
        assert keyframe.kind == "keyframe" and keyframe.base_version is None
        [patch] = keyframe.skip_patches
        assert patch.base_version == 2 and 0 < patch.changed_elements < keyframe.total_elements
        assert events[0].views[index].skip_patches == []  # nothing before version 0

        follower = materializer(event_log, settings, tmp_path / f"follower-{view}", view=view)
        for v in range(3):
            await follower.materialize(v)
        got = await follower.materialize(3)
        assert got.route.endswith("v2 -> skip:v3") and "keyframe" not in got.route, got.route
        assert got.downloaded_bytes == patch.bytes < 0.2 * keyframe.bytes
        assert got.root_hash == keyframe.root_hash == roots[3][view] == verify_directory(got.path)
        # The version after the keyframe patches on top of what the follower built from the patch.
        after = await follower.materialize(4)
        assert after.route.endswith("skip:v3 -> patch:v4") or after.route.startswith("cache:v3"), after.route
        assert after.root_hash == roots[4][view] == verify_directory(after.path)

        # A fresh island still starts from the keyframe itself.
        fresh = materializer(event_log, settings, tmp_path / f"fresh-{view}", view=view)
        got = await fresh.materialize(3)
        assert (got.route, got.downloaded_bytes) == ("keyframe:v3", keyframe.bytes)
        assert verify_directory(got.path) == roots[3][view]


async def test_a_keyframe_lists_the_skip_distances_too(event_log, settings):
    model = tiny_moe()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    pub = publisher(event_log, settings, model, views=["bf16"], keyframe_every=4, skip_distances=[2, 3])
    events = await _publish(pub, state, range(5), torch.Generator().manual_seed(2), {})
    pub.close()
    assert sorted(s.base_version for s in events[4].views[0].skip_patches) == [1, 2, 3]
    assert sorted(s.base_version for s in events[3].views[0].skip_patches) == [0, 1]  # a patch version: k >= 2


async def test_a_keyframe_after_a_publisher_restart_ships_no_patch(event_log, settings, tmp_path):
    """A new publisher does not hold the previous version's bits: its first version is a keyframe with no
    patch, and a follower takes the keyframe."""
    model = tiny_moe()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(3)
    roots: dict[int, dict[str, str]] = {}
    first = publisher(event_log, settings, model, views=VIEWS, keyframe_every=100)
    await _publish(first, state, range(2), gen, roots)
    first.close()
    second = publisher(event_log, settings, model, views=VIEWS, keyframe_every=100)
    assert await second.open() == 1
    [event] = await _publish(second, state, [2], gen, roots)
    second.close()
    assert [(v.kind, v.skip_patches) for v in event.views] == [("keyframe", []), ("keyframe", [])]
    follower = materializer(event_log, settings, tmp_path)
    await follower.materialize(1)
    got = await follower.materialize(2)
    assert got.route == "keyframe:v2" and verify_directory(got.path) == roots[2]["bf16"]


async def test_a_corrupt_keyframe_patch_falls_back_to_the_keyframe(event_log, settings, tmp_path):
    """The keyframe's patch is corrupted in the store after it was written: the follower refuses it
    (sha256, after one refetch) and downloads the keyframe instead, never serving a wrong bit."""
    model = tiny_moe()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    blobs = CorruptingBlobStore(settings.blobs, patch_key(3, 2))
    pub = publisher(event_log, settings, model, blobs=blobs, views=["bf16"], keyframe_every=3)
    roots: dict[int, dict[str, str]] = {}
    events = await _publish(pub, state, range(4), torch.Generator().manual_seed(4), roots)
    pub.close()
    [corrupt] = blobs.corrupted
    assert corrupt == events[3].views[0].skip_patches[0].blobs[0].uri
    follower = materializer(event_log, settings, tmp_path)
    for v in range(3):
        await follower.materialize(v)
    got = await follower.materialize(3)
    assert got.route == "keyframe:v3"
    assert got.root_hash == roots[3]["bf16"] == verify_directory(got.path)
    assert follower.failures.by_blob == {corrupt: 1}
    assert S3BlobStore(settings.blobs).exists(corrupt)  # refused for its bytes, not for being missing


async def test_keyframe_patches_can_be_turned_off_for_a_baseline(event_log, settings):
    """Benchmarks compare the patch path with keyframes downloaded whole: that baseline turns them off."""
    model = tiny_moe()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    pub = publisher(event_log, settings, model, views=["bf16"], keyframe_every=1, keyframe_patches=False)
    events = await _publish(pub, state, range(3), torch.Generator().manual_seed(2), {})
    pub.close()
    assert [e.views[0].kind for e in events] == ["keyframe"] * 3
    assert all(e.views[0].skip_patches == [] for e in events)

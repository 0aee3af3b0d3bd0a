"""Attacks on the in-place materializer: a cached slot whose files lie (a header whose tensors overlap,
a shard that is a symlink or a hard link to a file elsewhere, bits changed underneath a directory this
process already trusts) must never lead to a wrong bit served or to a write outside the slot being
built. Each served directory is checked with `verify_directory` (the safetensors library's reading)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import resource
import shutil
import signal
import struct
from pathlib import Path

import pytest
import torch

from pipeline.materialize import MaterializeError, verify_directory
from pipeline.safetensors_layout import ShardLayoutError, read_layout
from pipeline.version_slots import IN_USE_FILE, MANIFEST_FILE, in_use
from tests.chain_helpers import materializer
from tests.servers import HANG_GUARD_S
from tests.test_materialize_in_place import Chain, _files, _proc, _report

pytestmark = pytest.mark.integration

TWIN_A = "model.layers.0.input_layernorm.weight"
TWIN_B = "model.layers.0.post_attention_layernorm.weight"
"""Two tensors with equal bits in the tiny model (both all ones): a header can point one at the other's
bytes and still hash to the version."""


def _touch_embedding(state: dict[str, torch.Tensor]) -> None:
    state["model.embed_tokens.weight"][0, :8] += 0.25


def _touch_twin_a(state: dict[str, torch.Tensor]) -> None:
    state[TWIN_A][:16] += 0.5


def _no_change(state: dict[str, torch.Tensor]) -> None:
    pass


def _rewrite_header(shard: Path, edit) -> None:
    """Edit the shard's JSON header in place, keeping its length (padded with spaces, as writers do)."""
    with open(shard, "r+b") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
        edit(header)
        text = json.dumps(header, separators=(",", ":")).encode()
        assert len(text) <= length
        f.seek(8)
        f.write(text.ljust(length, b" "))


def _shard_holding(directory: Path, name: str) -> Path:
    weight_map = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    return directory / weight_map[name]


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


async def test_a_header_whose_tensors_overlap_is_refused_not_patched_through(event_log, settings, tmp_path):
    # v1 changes the embedding, v2 only TWIN_A: building v2 in the standby slot (v0) writes TWIN_A only.
    # One shard, so that the twins share a header.
    chain = Chain(event_log, settings, keyframe_every=100, publish_units=1)
    await chain.publish_to(1, _touch_embedding)
    await chain.publish_to(2, _touch_twin_a)
    cache = tmp_path / "cache"
    builder = materializer(event_log, settings, cache)
    for v in range(2):
        await builder.materialize(v)

    # The standby slot's header points TWIN_B at TWIN_A's bytes: every tensor still hashes to v0.
    shard = _shard_holding(builder.path_of(0), TWIN_B)

    def overlap(header: dict) -> None:
        header[TWIN_B]["data_offsets"] = header[TWIN_A]["data_offsets"]

    _rewrite_header(shard, overlap)
    with pytest.raises(ShardLayoutError, match="overlap"):
        read_layout(shard)

    restarted = materializer(event_log, settings, cache)
    got = await restarted.materialize(2)
    assert got.root_hash == chain.roots[2] == verify_directory(got.path)
    assert got.slot != "recycled v0"


@pytest.mark.parametrize("link", ["symlink", "hardlink"])
async def test_a_shard_linked_to_a_file_elsewhere_is_never_written_through(event_log, settings, tmp_path, link):
    # v1 has v0's bits: a shard of v0 linked to a copy elsewhere still hashes to v0.
    chain = Chain(event_log, settings, keyframe_every=100)
    await chain.publish_to(1, _no_change)
    await chain.publish_to(2, _touch_twin_a)
    cache = tmp_path / "cache"
    builder = materializer(event_log, settings, cache)
    for v in range(2):
        await builder.materialize(v)

    shard = _shard_holding(builder.path_of(0), TWIN_A)
    elsewhere = tmp_path / "elsewhere" / shard.name
    elsewhere.parent.mkdir()
    shutil.copyfile(shard, elsewhere)
    shard.unlink()
    if link == "symlink":
        shard.symlink_to(elsewhere)
    else:
        os.link(elsewhere, shard)
    before = _sha(elsewhere)
    served = _files(builder.path_of(1))

    restarted = materializer(event_log, settings, cache)
    got = await restarted.materialize(2)
    assert got.root_hash == chain.roots[2] == verify_directory(got.path)
    assert _sha(elsewhere) == before, f"building v2 wrote through a {link} into a file outside its slot"
    assert _files(builder.path_of(1)) == served
    assert all(not p.is_symlink() for p in got.path.iterdir())


async def test_bits_changed_under_a_trusted_slot_are_hashed_again_not_trusted(event_log, settings, tmp_path):
    # v1 and v2 change only the embedding: lm_head is never touched by the route, so only hashing it
    # can tell that the standby slot's copy changed after this process verified it.
    chain = Chain(event_log, settings, keyframe_every=100)
    await chain.publish_to(2, _touch_embedding)
    cache = tmp_path / "cache"
    follower = materializer(event_log, settings, cache)
    for v in range(2):
        await follower.materialize(v)  # v0 and v1 built (and so trusted) by this process

    shard = _shard_holding(follower.path_of(0), "lm_head.weight")
    span = read_layout(shard).tensors["lm_head.weight"]
    with open(shard, "r+b") as f:  # another writer, the manifest untouched
        f.seek(span.begin + 10)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))

    got = await follower.materialize(2)
    assert got.root_hash == chain.roots[2] == verify_directory(got.path)


async def test_a_pin_left_by_a_killed_process_does_not_keep_its_slot(event_log, settings, tmp_path):
    chain = Chain(event_log, settings, keyframe_every=100)
    await chain.publish_to(3)
    cache = tmp_path / "shared"
    ours = materializer(event_log, settings, cache)
    await ours.materialize(0)

    holder = await _proc(settings, cache, 1, "--pin")  # another process's engine serves v1 ...
    try:
        pinned = Path((await _report(holder))["path"])
        assert in_use(pinned)
    finally:
        holder.send_signal(signal.SIGKILL)  # ... and dies without releasing it
        await asyncio.wait_for(holder.wait(), HANG_GUARD_S)
    assert (pinned / IN_USE_FILE).exists() and not in_use(pinned)  # the file stays, the lock died with it
    await ours.materialize(2)
    got = await ours.materialize(3)
    assert got.slot == "recycled v1" and got.root_hash == chain.roots[3] == verify_directory(got.path)


async def test_one_kept_version_copies_the_served_one_and_never_touches_it(event_log, settings, tmp_path):
    chain = Chain(event_log, settings, keyframe_every=100)
    await chain.publish_to(4)
    follower = materializer(event_log, settings, tmp_path / "cache", keep_versions=1)
    for v in range(3):  # the one served is the only start: copied, then collected once v is served
        got = await follower.materialize(v)
        assert got.root_hash == chain.roots[v] == verify_directory(got.path)
        assert got.slot == (f"copy of v{v - 1}" if v else "new") and follower.cached_versions() == [v]

    # As an island uses it (the version served stays pinned until the next one is loaded), the one
    # released after the last collection is still there as a standby: recycled, the served one copied never.
    previous = await follower.materialize(2, pin=True)
    for v in (3, 4):
        before = _files(previous.path)
        got = await follower.materialize(v, pin=True)
        assert got.root_hash == chain.roots[v] == verify_directory(got.path)
        assert got.slot in (f"copy of v{v - 1}", f"recycled v{v - 2}") and _files(previous.path) == before
        previous.release()
        previous = got
    previous.release()


@contextlib.contextmanager
def _file_size_limit(limit: int):
    """Writes past `limit` bytes into any file fail with EFBIG (a full disk, as this process sees it)."""
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of being killed
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, old_limit[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)


async def test_a_disk_that_fills_during_a_copy_ends_in_a_clear_error_and_the_served_version_intact(
    event_log, settings, tmp_path
):
    chain = Chain(event_log, settings, keyframe_every=100)
    await chain.publish_to(2)
    follower = materializer(event_log, settings, tmp_path / "cache")
    standby = await follower.materialize(0, pin=True)  # pinned: v2 can only start from a copy of v1
    await follower.materialize(1)
    served = _files(follower.path_of(1))
    with _file_size_limit(64 * 1024), pytest.raises(MaterializeError, match="local disk") as failed:
        await follower.materialize(2)
    assert "File too large" in str(failed.value) and failed.value.hint
    assert follower.current() == follower.path_of(1) and _files(follower.path_of(1)) == served
    assert follower.cached_versions() == [0, 1] and not list(follower.root.glob(".tmp-*"))
    got = await follower.materialize(2)  # room again: built
    assert got.slot == "copy of v1" and got.root_hash == chain.roots[2] == verify_directory(got.path)
    standby.release()


async def test_a_stored_patch_rewritten_with_its_mtime_restored_is_hashed_again(event_log, settings, tmp_path):
    chain = Chain(event_log, settings, keyframe_every=100)
    await chain.publish_to(2)
    follower = materializer(event_log, settings, tmp_path / "cache")
    for v in range(2):
        await follower.materialize(v)  # the patch to v1 is in the store, written (so trusted) by this process
    blob = follower.view_entry(chain.events[1]).blobs[0]  # one shard's patch is enough
    stored = follower.patches.path(blob)
    info = stored.stat()
    data = bytearray(stored.read_bytes())
    data[len(data) // 2] ^= 0xFF
    stored.write_bytes(bytes(data))  # same size, same inode ...
    os.utime(stored, ns=(info.st_atime_ns, info.st_mtime_ns))  # ... and the mtime put back

    got = await follower.materialize(2)
    # hashed before the standby slot was taken apart: downloaded again, and the slot used as planned
    assert got.slot == "recycled v0" and got.root_hash == chain.roots[2] == verify_directory(got.path)


async def test_current_pointing_outside_the_cache_is_never_written_through(event_log, settings, tmp_path):
    chain = Chain(event_log, settings, keyframe_every=100)
    await chain.publish_to(2)
    follower = materializer(event_log, settings, tmp_path / "cache")
    for v in range(2):
        await follower.materialize(v)
    outside = tmp_path / "outside" / "v00000001"
    shutil.copytree(follower.path_of(1), outside)
    before = _files(outside)
    link = follower.root / "current"
    link.unlink()
    link.symlink_to(outside)

    got = await follower.materialize(2)
    assert got.root_hash == chain.roots[2] == verify_directory(got.path)
    assert follower.current() == follower.path_of(2) and _files(outside) == before


async def test_an_index_naming_a_shard_outside_its_directory_is_a_damaged_cache_entry(event_log, settings, tmp_path):
    # v1 has v0's bits: v0's index pointing at v1's shard still hashes to v0.
    chain = Chain(event_log, settings, keyframe_every=100)
    await chain.publish_to(1, _no_change)
    await chain.publish_to(2)
    cache = tmp_path / "cache"
    builder = materializer(event_log, settings, cache)
    for v in range(2):
        await builder.materialize(v)
    index = builder.path_of(0) / "model.safetensors.index.json"
    content = json.loads(index.read_text())
    content["weight_map"] = {n: f"../{builder.path_of(1).name}/{s}" for n, s in content["weight_map"].items()}
    index.write_text(json.dumps(content))
    served = _files(builder.path_of(1))

    restarted = materializer(event_log, settings, cache)
    got = await restarted.materialize(2)
    assert got.root_hash == chain.roots[2] == verify_directory(got.path)
    assert _files(builder.path_of(1)) == served
    # the cache entry is what is wrong, not the signed patch to v1: that stays usable
    assert restarted.failures.usable(("patch", 0, 1))


async def test_a_version_directory_whose_manifest_was_torn_is_collected_not_left_to_fill_the_disk(
    event_log, settings, tmp_path
):
    chain = Chain(event_log, settings, keyframe_every=100)
    await chain.publish_to(3)
    cache = tmp_path / "cache"
    builder = materializer(event_log, settings, cache)
    for v in range(2):
        await builder.materialize(v)
    (builder.path_of(0) / MANIFEST_FILE).unlink()  # lost to a power loss: no version any more
    stray = builder.root / "vintage"  # not a version's name, manifest or not: never parsed as one
    stray.mkdir()
    (stray / MANIFEST_FILE).write_text("{}")

    restarted = materializer(event_log, settings, cache)
    for v in (2, 3):
        got = await restarted.materialize(v)
        assert got.root_hash == chain.roots[v] == verify_directory(got.path)
    assert sorted(p.name for p in restarted.root.glob("v0*")) == [f"v{v:08d}" for v in (2, 3)]


async def test_two_processes_building_the_same_version_at_once_share_one_build(event_log, settings, tmp_path):
    chain = Chain(event_log, settings, keyframe_every=100)
    await chain.publish_to(3)
    cache = tmp_path / "shared"
    ours = materializer(event_log, settings, cache)
    for v in range(3):
        await ours.materialize(v)
    served = _files(ours.path_of(2))

    procs = [await _proc(settings, cache, 3) for _ in range(2)]
    try:
        reports = [await _report(proc) for proc in procs]
    finally:
        for proc in procs:
            await asyncio.wait_for(proc.wait(), HANG_GUARD_S)
    assert [r["root_hash"] for r in reports] == [chain.roots[3]] * 2
    assert "cache:v3" in [r["route"] for r in reports]  # the second waited for the first's build
    assert verify_directory(ours.path_of(3)) == chain.roots[3] and _files(ours.path_of(2)) == served
    assert not list(ours.root.glob(".tmp-*"))

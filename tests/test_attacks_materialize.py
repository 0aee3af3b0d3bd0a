"""Attacks on the in-place materializer: a cached slot whose files lie (a header whose tensors overlap,
a shard that is a symlink or a hard link to a file elsewhere, bits changed underneath a directory this
process already trusts) must never lead to a wrong bit served or to a write outside the slot being
built. Each served directory is checked with `verify_directory` (the safetensors library's reading)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch

from pipeline.materialize import verify_directory
from pipeline.safetensors_layout import ShardLayoutError, read_layout
from tests.chain_helpers import materializer
from tests.test_materialize_in_place import Chain, _files

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
    chain = Chain(event_log, settings, keyframe_every=100)
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

"""Versions materialized in place, into recycled slots (A/B): bit-exact, the served version untouched, a
crash or a torn slot never served, a pinned directory never recycled, and disk writes that follow what
changed. Every served directory is checked with `verify_directory` (the safetensors library's reading of
the files, independent of the in-place layout code) against the version's root hash."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import sys
from pathlib import Path

import pytest
import structlog
import torch

from pipeline.materialize import verify_directory
from pipeline.safetensors_layout import read_layout
from pipeline.version_slots import MANIFEST_FILE, VersionPin, in_use
from tests.chain_helpers import expected_root, materializer, publisher
from tests.servers import HANG_GUARD_S, connection_env
from tests.tiny_models import adam_like_step, tiny_moe
from workers.bench.sync_bench import adam_sized_step

pytestmark = pytest.mark.integration


class Chain:
    """A tiny model's chain, published version by version; `roots[v]` is what v must hash to."""

    def __init__(self, event_log, settings, model=None, **chain):
        model = model or tiny_moe(seed=3)
        self.state = {k: v.clone() for k, v in model.state_dict().items()}
        self.pub = publisher(event_log, settings, model, **chain)
        self.events, self.roots = [], []
        self.gen = torch.Generator().manual_seed(5)

    async def publish_to(self, version: int, step=None) -> None:
        for v in range(len(self.events), version + 1):
            if v:
                (step or (lambda state: adam_like_step(state, 1e-5, self.gen)))(self.state)
            self.events.append(await self.pub.publish(v, self.state))
            self.roots.append(expected_root(self.state, "bf16"))


def _files(directory: Path) -> dict[str, str]:
    """Every file's sha256: a directory's exact bytes."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir()) if p.is_file()}


def _flip_a_byte(directory: Path) -> str:
    """Flip one byte in the middle of the largest tensor's data, keeping the file's header and the
    manifest: only hashing the bits can tell. Returns the tensor's name."""
    shard = next(directory.glob("*.safetensors"))
    span = max(read_layout(shard).tensors.values(), key=lambda s: s.nbytes)
    with open(shard, "r+b") as f:
        f.seek((span.begin + span.end) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x5A]))
    return span.name


def _proc_env(settings) -> dict[str, str]:
    return {**os.environ, "SPRAWL_RUN_ID": settings.run_id, **connection_env(settings, "sampler")}


async def _proc(settings, cache: Path, version: int, *flags: str) -> asyncio.subprocess.Process:
    cmd = [sys.executable, "-m", "tests.materialize_proc", str(cache), str(version), *flags]
    return await asyncio.create_subprocess_exec(
        *cmd, env=_proc_env(settings), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
    )


async def _report(proc: asyncio.subprocess.Process) -> dict:
    """The next JSON line the process prints; fails the test (not hangs it) if none comes."""
    assert proc.stdout is not None
    while True:
        line = await asyncio.wait_for(proc.stdout.readline(), HANG_GUARD_S)
        if not line:
            raise AssertionError(f"the process ended (exit {await proc.wait()}) without a report")
        if line.startswith(b"{"):
            return json.loads(line)


async def test_a_chain_applied_in_place_is_bit_exact_and_the_served_version_stays_untouched(
    event_log, settings, tmp_path
):
    chain = Chain(event_log, settings, keyframe_every=5, skip_distances=[2])
    await chain.publish_to(13)
    follower = materializer(event_log, settings, tmp_path / "follower")
    served = None
    for v in range(14):
        before = _files(served) if served is not None else None
        got = await follower.materialize(v)
        assert got.root_hash == chain.roots[v] == verify_directory(got.path)
        if v % 5 >= 2:
            assert got.slot == f"recycled v{v - 2}"  # the standby slot, patched in place
        if before is not None:
            assert _files(served) == before, f"building v{v} changed the directory of v{v - 1}, served meanwhile"
        served = got.path
    assert follower.cached_versions() == [12, 13]

    # A laggard catches up through skip patches (random-sign steps cancel: a skip is smaller than two
    # patches), each applied in place into the copy of the version it serves.
    laggard = materializer(event_log, settings, tmp_path / "laggard")
    await laggard.materialize(10)
    got = await laggard.materialize(13)
    assert "skip:" in got.route and got.root_hash == chain.roots[13] == verify_directory(got.path)


async def test_a_crash_mid_apply_leaves_a_staging_directory_that_is_never_served(event_log, settings, tmp_path):
    chain = Chain(event_log, settings, keyframe_every=100)
    await chain.publish_to(3)
    cache = tmp_path / "cache"
    follower = materializer(event_log, settings, cache)
    for v in range(3):
        await follower.materialize(v)
    assert follower.cached_versions() == [1, 2]
    served = _files(follower.path_of(2))

    # Another process builds v3 into the standby slot (v1) and is killed in the middle of writing into it.
    proc = await _proc(settings, cache, 3, "--halt-after-first-apply")
    try:
        assert await _report(proc) == {"halted": True}
    finally:
        proc.send_signal(signal.SIGKILL)
        await asyncio.wait_for(proc.wait(), HANG_GUARD_S)
    root = follower.root
    [staging] = root.glob(".tmp-v3-*")
    assert not (staging / MANIFEST_FILE).exists()
    assert follower.cached_versions() == [2]  # v1's slot is gone from the cache: nothing can serve it
    assert follower.current() == follower.path_of(2) and _files(follower.path_of(2)) == served

    # The next build (any process) removes the half-built directory and makes a correct v3.
    fresh = materializer(event_log, settings, cache)
    got = await fresh.materialize(3)
    assert got.root_hash == chain.roots[3] == verify_directory(got.path)
    assert not list(root.glob(".tmp-*"))
    assert _files(follower.path_of(2)) == served
    # and v1 is built again from the log, never taken from the slot the crash left
    got = await fresh.materialize(1)
    assert got.route == "keyframe:v0 -> patch:v1" and verify_directory(got.path) == chain.roots[1]


async def test_a_torn_slot_is_detected_on_first_use_never_served_and_rebuilt(event_log, settings, tmp_path):
    chain = Chain(event_log, settings, keyframe_every=100)
    await chain.publish_to(3)
    cache = tmp_path / "cache"
    builder = materializer(event_log, settings, cache)
    for v in range(3):
        await builder.materialize(v)

    # The standby slot, torn (as by a power loss after the rename): a process that has not hashed it
    # (a restarted island) finds out before patching it, drops it and builds v3 another way.
    torn = _flip_a_byte(builder.path_of(1))
    restarted = materializer(event_log, settings, cache)
    with structlog.testing.capture_logs() as logs:
        got = await restarted.materialize(3)
    assert got.root_hash == chain.roots[3] == verify_directory(got.path)
    assert got.slot == "copy of v2" and 1 not in restarted.cached_versions()
    [error] = [e for e in logs if e["log_level"] == "error"]
    assert error["version"] == 1 and torn in error["problem"]

    # The served version itself, torn: never served from the cache, rebuilt.
    torn = _flip_a_byte(builder.path_of(3))
    again = materializer(event_log, settings, cache)
    with structlog.testing.capture_logs() as logs:
        got = await again.materialize(3)
    assert got.route != "cache:v3" and got.root_hash == chain.roots[3] == verify_directory(got.path)
    assert any(e["log_level"] == "error" and e.get("version") == 3 for e in logs)
    assert (await again.materialize(3)).route == "cache:v3"  # rebuilt by this process: trusted from now on


async def test_a_version_pinned_by_another_process_is_not_recycled(event_log, settings, tmp_path):
    chain = Chain(event_log, settings, keyframe_every=100)
    await chain.publish_to(4)
    cache = tmp_path / "shared"
    ours = materializer(event_log, settings, cache)
    await ours.materialize(0)

    # Another process's engine serves v1 from this cache (it holds the pin until we close its stdin).
    holder = await _proc(settings, cache, 1, "--pin")
    try:
        pinned = Path((await _report(holder))["path"])
        assert pinned == ours.path_of(1) and in_use(pinned)
        pinned_bytes = _files(pinned)
        await ours.materialize(2)
        got = await ours.materialize(3)  # v2 is current, v1 pinned: nothing to recycle, v2 is copied
        assert got.slot == "copy of v2" and got.root_hash == chain.roots[3] == verify_directory(got.path)
        assert 1 in ours.cached_versions() and _files(pinned) == pinned_bytes  # kept past keep_versions
    finally:
        await asyncio.wait_for(holder.communicate(b""), HANG_GUARD_S)  # its stdin closed: it lets go
    assert holder.returncode == 0 and not in_use(pinned)
    got = await ours.materialize(4)  # unpinned: the older slots are recycled and collected again
    assert got.slot == "recycled v2" and got.root_hash == chain.roots[4] == verify_directory(got.path)
    assert ours.cached_versions() == [3, 4]


async def test_an_island_pin_is_held_until_the_engine_has_a_newer_version(event_log, settings, tmp_path):
    chain = Chain(event_log, settings, keyframe_every=100)
    await chain.publish_to(2)
    m = materializer(event_log, settings, tmp_path)
    first = await m.materialize(1, pin=True)
    assert isinstance(first.pin, VersionPin) and in_use(first.path)
    second = await m.materialize(2, pin=True)
    assert in_use(first.path) and in_use(second.path)
    first.release()
    assert not in_use(first.path) and in_use(second.path)
    second.release()


def _sync_cache(root: Path) -> None:
    """Write back the cache's dirty pages (the test's doing, not the materializer's), so the next build's
    `written_bytes` counts every page it dirties, not only those not dirty already."""
    for path in root.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())


async def test_disk_writes_follow_the_changed_tensors_not_the_model(event_log, settings, tmp_path):
    # Big enough that changed tensors span many pages: the page cache dirties whole folios (up to 2 MiB
    # on this kernel), so a few changed kilobytes next to unchanged ones can cost a folio each.
    model = tiny_moe(
        seed=4, vocab_size=16384, hidden_size=512, intermediate_size=512, moe_intermediate_size=384, num_experts=8
    )
    chain = Chain(event_log, settings, model, keyframe_every=100)
    generator = torch.Generator().manual_seed(2)
    # Every weight nudged by an Adam-sized step (about 1% of the served bits change), as the sync
    # benchmark does.
    await chain.publish_to(3, lambda state: adam_sized_step(state, generator))
    follower = materializer(event_log, settings, tmp_path)
    model_bytes = sum(t.numel() * 2 for t in chain.state.values())
    for v in range(4):
        _sync_cache(follower.root)
        got = await follower.materialize(v)
        assert got.root_hash == chain.roots[v] == verify_directory(got.path)
        if v >= 2:  # steady state: the standby slot
            assert got.slot == f"recycled v{v - 2}"
            assert got.changed_tensor_bytes > 0.9 * model_bytes  # every tensor changed a little
            assert got.written_bytes <= 2 * got.changed_tensor_bytes, (got.written_bytes, got.changed_tensor_bytes)

    # Embeddings frozen, the layers trained: what is written follows them, not the model's size.
    def layers_only(state):
        adam_sized_step({k: t for k, t in state.items() if ".layers." in k}, generator)

    await chain.publish_to(7, layers_only)
    for v in range(4, 8):
        _sync_cache(follower.root)
        got = await follower.materialize(v)
        assert got.root_hash == chain.roots[v] == verify_directory(got.path)
        if v >= 5:
            assert got.changed_tensor_bytes < 0.5 * model_bytes
            assert got.written_bytes <= 2 * got.changed_tensor_bytes, (got.written_bytes, got.changed_tensor_bytes)

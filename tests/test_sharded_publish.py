"""Sharded publishing: N ranks each publish the units of the publish layout they own, rank 0 appends one
event, and the chain is the one a single process would have published: same kinds, digests, root
hashes, blob names/sha256/bytes and skip patches (only URIs differ), materialized bit-exact."""

import asyncio
import math
import pickle

import msgspec
import pytest
import torch
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from infra.streams import apply
from pipeline.blobstore import S3BlobStore
from pipeline.chain_publish import ChainPublisher, KeyframeRequired
from pipeline.config import ChainSettings
from pipeline.materialize import verify_directory
from pipeline.publish_layout import LayoutMismatch, PublishLayout
from pipeline.version_log import chain_head
from pipeline.version_parts import PartsInconsistent
from pipeline.views import get_view
from tests.chain_helpers import TEST_SIGNING_KEY, expected_root, materializer
from tests.servers import new_run_id
from tests.tiny_models import tiny_moe

VIEWS = ["bf16", "fp8_e4m3", "mxfp4"]
CHAIN = dict(views=VIEWS, keyframe_every=4, skip_distances=[2], publish_units=4)


def _publisher(event_log, settings, model, *, source_shapes=None, writer_id=None, **chain) -> ChainPublisher:
    return ChainPublisher(
        event_log,
        S3BlobStore(settings.blobs),
        run_id=settings.run_id,
        model_config=model.config.to_dict(),
        settings=ChainSettings(**{**CHAIN, **chain}),
        extra_files={"generation_config.json": b"{}"},
        signing_key=TEST_SIGNING_KEY,
        source_shapes=source_shapes,
        writer_id=writer_id,
    )


def _ranks(event_log, settings, model, world_size: int, **chain) -> list[ChainPublisher]:
    """One publisher per rank, as a sharded trainer makes them: rank 0's writer id broadcast, every
    parameter's global shape known up front."""
    shapes = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    first = _publisher(event_log, settings, model, source_shapes=shapes, **chain)
    rest = [
        _publisher(event_log, settings, model, source_shapes=shapes, writer_id=first.writer_id, **chain)
        for _ in range(world_size - 1)
    ]
    return [first, *rest]


async def _parts(pubs, version, state, *, keyframe=None):
    """What each rank does for one version: the agreed keyframe decision (any rank's True wins), then
    its part from the parameters it owns."""
    world = len(pubs)
    if keyframe is None:
        keyframe = any(p.needs_keyframe(version) for p in pubs)
    return list(
        await asyncio.gather(
            *(
                pub.publish_part(
                    version,
                    {n: state[n] for n in pub.layout.owned(rank, world)},
                    rank=rank,
                    world_size=world,
                    keyframe=keyframe,
                )
                for rank, pub in enumerate(pubs)
            )
        )
    )


async def _publish_sharded(pubs, version, state):
    parts = await _parts(pubs, version, state)
    event = await pubs[0].append_parts(version, parts)
    for pub in pubs[1:]:
        pub.advance(version)
    return parts, event


def _sparse_step(state: dict[str, torch.Tensor], gen: torch.Generator) -> None:
    """Move ~1% of the elements of every other tensor by 0.01 (a served bit changes), leave the rest."""
    for i, name in enumerate(sorted(state)):
        if i % 2:
            continue
        flat = state[name].view(-1)
        picked = torch.randint(0, flat.numel(), (max(1, flat.numel() // 100),), generator=gen)
        flat[picked] += 0.01


def _without_uris(value):
    """An event's view as plain data, every blob's URI left out (it carries the writer's key prefix)."""
    if isinstance(value, dict):
        return {k: _without_uris(v) for k, v in value.items() if k != "uri"}
    if isinstance(value, list):
        return [_without_uris(v) for v in value]
    return value


@pytest.mark.integration
async def test_two_ranks_publish_the_chain_one_process_publishes(event_log, settings, tmp_path):
    model = tiny_moe()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    single_settings = settings.model_copy(update={"run_id": new_run_id()})
    await apply(event_log.js, settings.streams, single_settings.run_id)
    pubs = _ranks(event_log, settings, model, 2)
    single = _publisher(event_log, single_settings, model)
    assert pubs[0].layout.count >= CHAIN["publish_units"]
    gen = torch.Generator().manual_seed(7)
    roots = []
    try:
        for version in range(6):  # keyframes at 0 and 4, patches between, skip patches from v-2
            if version:
                _sparse_step(state, gen)
            parts, sharded = await _publish_sharded(pubs, version, state)
            alone = await single.publish(version, state)
            roots.append({view: expected_root(state, view) for view in VIEWS})

            assert [v.kind for v in sharded.views] == ["keyframe" if version % 4 == 0 else "patch"] * len(VIEWS)
            assert sharded.parent_version == alone.parent_version == (version - 1 if version else None)
            for mine, theirs in zip(sharded.views, alone.views, strict=True):
                assert mine.root_hash == theirs.root_hash == roots[version][mine.view]
                assert _without_uris(msgspec.to_builtins(mine)) == _without_uris(msgspec.to_builtins(theirs))
            # one version's blobs under one prefix, whichever rank wrote them
            uris = [b.uri for v in sharded.views for b in [*v.blobs, *(b for s in v.skip_patches for b in s.blobs)]]
            assert all(f"/v{version:08d}-{pubs[0].writer_id}/" in uri for uri in uris)
            expected_skips = sorted({version - 2} | ({version - 1} if version == 4 else set()), reverse=True)
            assert [s.base_version for s in sharded.views[0].skip_patches] == [b for b in expected_skips if b >= 0]

            # each part holds the served tensors of its own source parameters, nothing else
            for view_index, view in enumerate(VIEWS):
                held = []
                for rank, part in enumerate(parts):
                    owned = {n: state[n] for n in pubs[rank].layout.owned(rank, 2)}
                    names = [t.name for u in part.views[view_index].units for t in u.tensors]
                    assert sorted(names) == sorted(get_view(view).compute(owned))
                    held.append(set(names))
                assert held[0] and held[1] and not held[0] & held[1]
            assert all(pickle.loads(pickle.dumps(part)) == part for part in parts)  # all_gather_object pickles
    finally:
        for pub in [*pubs, single]:
            pub.close()

    # An island follows the 2-rank chain version by version (keyframe, patches, a keyframe's patch) in the
    # view with the most tensors; fresh islands build the newest version in the others.
    follower = materializer(event_log, settings, tmp_path / "follower", view="mxfp4")
    for version in range(6):
        got = await follower.materialize(version)
        assert got.root_hash == roots[version]["mxfp4"] == verify_directory(got.path)
    assert "keyframe" not in got.route
    for view in ("bf16", "fp8_e4m3"):
        got = await materializer(event_log, settings, tmp_path / view, view=view).materialize(5)
        assert got.root_hash == roots[5][view] == verify_directory(got.path)


@pytest.mark.integration
async def test_parts_that_do_not_make_one_version_append_nothing(event_log, settings):
    model = tiny_moe(tie_word_embeddings=True)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    pubs = _ranks(event_log, settings, model, 2, keyframe_every=2)
    try:
        assert "lm_head.weight" not in pubs[0].layout.shapes  # tied: not served, so not planned
        v0_parts, _ = await _publish_sharded(pubs, 0, state)
        state["model.norm.weight"] += 0.5
        good = await _parts(pubs, 1, state)
        duplicated = msgspec.structs.replace(good[1], units=[*good[1].units, good[0].units[0]])
        forged = [
            ([good[0]], "ranks \\[0\\] are not each of 0..1"),
            ([good[0], duplicated], "duplicated \\[" + str(good[0].units[0]) + "\\]"),
            ([good[0], v0_parts[1]], "version 0, 1"),
            ([good[0], msgspec.structs.replace(good[1], writer_id="someone-else")], "writer_id"),
        ]
        for parts, reason in forged:
            with pytest.raises(PartsInconsistent, match=reason):
                await pubs[0].append_parts(1, parts)
        # the ranks disagree on the kind: one publishes a keyframe, the other a patch
        owned = {n: state[n] for n in pubs[0].layout.owned(0, 2)}
        keyframe = await pubs[0].publish_part(1, owned, rank=0, world_size=2, keyframe=True)
        with pytest.raises(PartsInconsistent, match="is a keyframe and a patch"):
            await pubs[0].append_parts(1, [keyframe, good[1]])
        head = await chain_head(event_log, settings.run_id)
        assert head is not None and head.version == 0 and pubs[0].head == 0  # nothing was appended

        # a rank handed the wrong parameters, or asked for a patch it has no base for, refuses
        with pytest.raises(LayoutMismatch, match="not this rank's"):
            await pubs[1].publish_part(1, state, rank=1, world_size=2, keyframe=False)
        restarted = _publisher(event_log, settings, model, source_shapes={n: t.shape for n, t in state.items()})
        with pytest.raises(KeyframeRequired, match="rule says keyframe"):  # no history: it has nothing to patch
            owned = {n: state[n] for n in restarted.layout.owned(1, 2)}
            await restarted.publish_part(1, owned, rank=1, world_size=2, keyframe=False)
        restarted.close()

        # the publishers are still usable: the right parts append
        event = await pubs[0].append_parts(1, await _parts(pubs, 1, state))
        pubs[1].advance(1)
        assert [v.kind for v in event.views] == ["patch"] * len(VIEWS) and pubs[1].head == 1
        assert all("lm_head.weight" not in {t.name for t in v.tensors} for v in event.views)
        with pytest.raises(KeyframeRequired, match="rule says keyframe"):  # every K versions, whatever the history
            owned = {n: state[n] for n in pubs[1].layout.owned(1, 2)}
            await pubs[1].publish_part(2, owned, rank=1, world_size=2, keyframe=False)
    finally:
        for pub in pubs:
            pub.close()


@pytest.mark.integration
async def test_more_ranks_than_units_leave_some_ranks_idle_and_the_chain_unchanged(event_log, settings, tmp_path):
    model = tiny_moe()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    pubs = _ranks(event_log, settings, model, 4, views=["bf16"], publish_units=2, max_shard_bytes=1 << 20)
    assert pubs[0].layout.count == 3  # the tiny model's 0.6 MB in 2 units of 1/2 and a rest: rank 3 is idle
    try:
        for version in range(2):
            state["model.norm.weight"] += 0.25
            parts, event = await _publish_sharded(pubs, version, state)
            assert [len(p.units) for p in parts] == [1, 1, 1, 0] and parts[3].views[0].units == []
            assert event.views[0].root_hash == expected_root(state, "bf16")
    finally:
        for pub in pubs:
            pub.close()
    got = await materializer(event_log, settings, tmp_path).materialize(1)
    assert got.root_hash == expected_root(state, "bf16") == verify_directory(got.path)


# ---------------------------------------------------------------- the layout alone

SHAPES = {n: tuple(t.shape) for n, t in tiny_moe().state_dict().items()}


def test_the_layout_is_the_same_for_any_number_of_ranks_and_shares_every_unit_once():
    layout = PublishLayout.plan(SHAPES, max_shard_bytes=1 << 30, min_units=4)
    assert layout.count >= 4
    assert [n for unit in layout.units for n in unit] == sorted(SHAPES)  # name order, each parameter once
    for world in (1, 2, 3):
        assert PublishLayout.plan(SHAPES, max_shard_bytes=1 << 30, min_units=4) == layout
        units = [layout.units_of(rank, world) for rank in range(world)]
        assert sorted(u for r in units for u in r) == list(range(layout.count))
        owned = [layout.owned(rank, world) for rank in range(world)]
        assert sorted(n for o in owned for n in o) == sorted(SHAPES)
        loads = [sum(layout.unit_bytes[u] for u in r) for r in units]
        assert max(loads) - min(loads) <= max(layout.unit_bytes)  # balanced to within one unit
    assert layout.units_of(0, 1) == list(range(layout.count))
    # a small max_shard_bytes cuts finer; a parameter bigger than it gets a unit of its own
    fine = PublishLayout.plan(SHAPES, max_shard_bytes=40_000, min_units=1)
    assert all(b <= 40_000 or len(u) == 1 for u, b in zip(fine.units, fine.unit_bytes, strict=True))
    # the id changes with any shape
    grown = PublishLayout.plan({**SHAPES, "model.norm.weight": (129,)}, max_shard_bytes=1 << 30, min_units=4)
    assert grown.layout_id != layout.layout_id
    for bad in ((-1, 2), (2, 2), (0, 0)):
        with pytest.raises(LayoutMismatch):
            layout.units_of(*bad)


@hypothesis_settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 5000), min_size=1, max_size=40),
    min_units=st.integers(1, 8),
    max_shard=st.integers(1, 20_000),
    world=st.integers(1, 6),
)
def test_any_plan_keeps_its_promises(sizes, min_units, max_shard, world):
    shapes = {f"p.{i:03d}": (s,) for i, s in enumerate(sizes)}
    layout = PublishLayout.plan(shapes, max_shard_bytes=max_shard, min_units=min_units)
    assert [n for u in layout.units for n in u] == sorted(shapes)
    target = max(1, min(max_shard, sum(sizes) * 2 // min_units))
    assert all(len(u) == 1 or b <= target for u, b in zip(layout.units, layout.unit_bytes, strict=True))
    if max(sizes) * 2 <= target and sum(sizes) * 2 >= min_units:  # no parameter outweighs a unit
        assert layout.count >= min_units
    assigned = sorted(u for rank in range(world) for u in layout.units_of(rank, world))
    assert assigned == list(range(layout.count))
    assert math.isclose(sum(layout.unit_bytes), 2 * sum(sizes))

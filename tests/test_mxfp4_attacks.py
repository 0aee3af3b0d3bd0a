"""Attacks on the mxfp4 served view: hostile or unlucky checkpoints must end in a clear SprawlError,
never a wrong bit or a NaN computed with; the fault injection stays on the reference engine; mxfp4
patches stay bit-exact across a keyframe boundary. And three MX blocks computed by hand, independently
of the view's own test table, against OCP MX v1.0 §6.3."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeline.errors import SprawlError
from pipeline.keyframe import write_checkpoint
from pipeline.materialize import verify_directory
from pipeline.views import dequantize_mxfp4, get_view, quantize_mxfp4
from pipeline.views.mxfp4 import unpack_nibbles
from tests.chain_helpers import expected_root, materializer, publisher
from tests.tiny_models import adam_like_step, tiny_moe
from workers.sampler.engines.factory import create_engine
from workers.sampler.engines.reference import ReferenceEngine
from workers.sampler.engines.weights import CheckpointLayoutError, UnservableWeights

# ----------------------------------------------------------------------------- §6.3 by hand
# shared_exp = floor(log2(max|V|)) - 2 (emax of E2M1), X = 2^shared_exp, byte = shared_exp + 127,
# P = V / X to the nearest of 0, .5, 1, 1.5, 2, 3, 4, 6, ties to the even mantissa, |P| > 6 -> 6.
# Block A, amax 2.6: log2 2.6 = 1.38 -> 1, shared -1, X = 0.5, byte 126.
#   0.3 -> 0.6 -> 0.5 (code 1); -1.1 -> -2.2 -> -2 (8|4 = 12); 2.6 -> 5.2 -> 6 (7); 0.09 -> 0.18 -> 0 (0);
#   dequantized code x X: 0.25, -1, 3, 0.
# Block B, amax 3*2^-6 = 0.046875: log2 = -4.4 -> -5, shared -7, X = 2^-7, byte 120.
#   -3*2^-6 -> -6 (15); 2^-6 -> 2 (4); 1.5*2^-6 -> 3 (5); 0.625*2^-7 -> 0.625 -> 0.5 (1);
#   2^-9 -> 0.25, a tie between 0 and 0.5 -> 0 (even, code 0); 0.75*2^-7 -> 0.75, tie 0.5|1 -> 1 (2).
# Block C, amax 1000: log2 = 9.97 -> 9, shared 7, X = 128, byte 134.
#   1000 -> 7.8125 -> 6, saturated (7); 300 -> 2.34 -> 2 (4); -448 -> -3.5, tie 3|4 -> -4 (14);
#   64 -> 0.5 (1); 96 -> 0.75, tie -> 1 (2); -20 -> -0.156 -> -0 (8).
BY_HAND = [
    ([0.3, -1.1, 2.6, 0.09], 126, [1, 12, 7, 0], [0.25, -1.0, 3.0, 0.0]),
    (
        [-3 * 2.0**-6, 2.0**-6, 1.5 * 2.0**-6, 0.625 * 2.0**-7, 2.0**-9, 0.75 * 2.0**-7],
        120,
        [15, 4, 5, 1, 0, 2],
        [-6 * 2.0**-7, 2 * 2.0**-7, 3 * 2.0**-7, 0.5 * 2.0**-7, 0.0, 2.0**-7],
    ),
    ([1000.0, 300.0, -448.0, 64.0, 96.0, -20.0], 134, [7, 4, 14, 1, 2, 8], [768.0, 256.0, -512.0, 64.0, 128.0, -0.0]),
]


@pytest.mark.parametrize(("values", "byte", "codes", "dequantized"), BY_HAND)
def test_blocks_computed_by_hand(values, byte, codes, dequantized):
    pad = 32 - len(values)
    packed, scale = quantize_mxfp4(torch.tensor([values + [0.0] * pad]))
    assert scale.tolist() == [[byte]]
    assert unpack_nibbles(packed)[0].tolist() == codes + [0] * pad
    back = dequantize_mxfp4(packed, scale)[0, : len(values)]
    assert back.tolist() == dequantized
    assert torch.signbit(back).tolist() == [v < 0 or str(v) == "-0.0" for v in dequantized]


# ----------------------------------------------------------------------------- hostile checkpoints

Q = "model.layers.0.self_attn.q_proj.weight"
ROUTER = "model.layers.0.mlp.gate.weight"


@pytest.fixture(scope="module")
def served():
    model = tiny_moe(seed=5)
    view = get_view("mxfp4")
    config = {**model.config.to_dict(), **view.config_overrides()}
    return view.compute(model.state_dict()), config


def _replace(name: str, tensor: torch.Tensor):
    return lambda t: t.__setitem__(name, tensor(t[name]) if callable(tensor) else tensor)


def _set_byte(name: str, index: tuple[int, int], value: int):
    def mutate(t):
        changed = t[name].clone()
        changed[index] = value
        t[name] = changed

    return mutate


def _overflowing_block(t):
    """E8M0 byte 254 (2^127, a valid scale our quantizer never writes) times code 7 (6.0): beyond fp32."""
    _set_byte(Q + "_scale", (0, 0), 254)(t)
    _set_byte(Q, (0, 0), 0x07)(t)


HOSTILE = {
    "a NaN scale byte (0xFF)": (_set_byte(Q + "_scale", (3, 1), 0xFF), UnservableWeights, "0xFF"),
    "a scale overflowing fp32": (_overflowing_block, UnservableWeights, "non-finite"),
    "a scale of the wrong shape": (
        _replace(Q + "_scale", lambda s: s[:, :1].contiguous()),
        CheckpointLayoutError,
        "needs",
    ),
    "a scale transposed": (_replace(Q + "_scale", lambda s: s.T.contiguous()), CheckpointLayoutError, "needs"),
    "a float scale": (_replace(Q + "_scale", lambda s: s.float()), CheckpointLayoutError, "float32"),
    "a weight without its scale": (lambda t: t.pop(Q + "_scale"), CheckpointLayoutError, "scale is missing"),
    "a scale without its weight": (lambda t: t.pop(Q), CheckpointLayoutError, "without its weight"),
    "a scale next to a bf16 weight": (
        _replace(ROUTER + "_scale", torch.zeros(1, dtype=torch.uint8)),
        CheckpointLayoutError,
        "not quantized",
    ),
    "odd input dims": (_replace(Q, lambda w: w[:, :-1].contiguous()), CheckpointLayoutError, "whole MX blocks"),
    "a packed weight of the wrong shape": (
        lambda t: (
            _replace(Q, lambda w: w[:1].contiguous())(t),
            _replace(Q + "_scale", lambda s: s[:1].contiguous())(t),
        ),
        CheckpointLayoutError,
        "does not fit",
    ),
}


def _write(served, directory: Path, mutate=None) -> Path:
    tensors, config = served
    tensors = dict(tensors)
    if mutate is not None:
        mutate(tensors)
    write_checkpoint(directory, tensors, config)
    return directory


@pytest.mark.parametrize("attack", list(HOSTILE))
async def test_a_hostile_checkpoint_is_refused_on_the_first_load(served, tmp_path, attack):
    mutate, error, match = HOSTILE[attack]
    engine = ReferenceEngine(dtype=torch.float32)
    await engine.start()
    with pytest.raises(error, match=match):
        await engine.load_weights(_write(served, tmp_path / "v0", mutate), 0)
    assert engine.model is None and engine.weight_version() is None


@pytest.mark.parametrize("fault", ["none", "wrong_dequant"])
async def test_a_nan_scale_is_refused_whatever_the_fault_injection(served, tmp_path, fault):
    engine = ReferenceEngine(dtype=torch.bfloat16, fault=fault)
    await engine.start()
    with pytest.raises(UnservableWeights, match="0xFF"):
        await engine.load_weights(_write(served, tmp_path / "v0", HOSTILE["a NaN scale byte (0xFF)"][0]), 0)


async def test_a_later_version_that_does_not_fit_leaves_the_served_one_untouched(served, tmp_path):
    """On an engine already serving, a whole version is copied into the built model: `copy_` would
    broadcast a [1, in] weight over every row, and a tensor left out would keep the old version's bits."""
    engine = ReferenceEngine(dtype=torch.float32)
    await engine.start()
    await engine.load_weights(_write(served, tmp_path / "v0"), 0)
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    one_row = HOSTILE["a packed weight of the wrong shape"][0]
    with pytest.raises(CheckpointLayoutError, match=r"\(1, 128\), the served model's is \(128, 128\)"):
        await engine.load_weights(_write(served, tmp_path / "one-row", one_row), 1)
    with pytest.raises(CheckpointLayoutError, match=r"whole version without model\.norm\.weight"):
        await engine.load_weights(_write(served, tmp_path / "no-norm", lambda t: t.pop("model.norm.weight")), 1)
    with pytest.raises(CheckpointLayoutError, match="not a parameter"):
        engine.stage_for_next_step({"model.layers.0.self_attn.q_proj.weight_scale": torch.zeros(128, 4)}, 1)
    # A partial load (what a patch changed) is checked the same way.
    with pytest.raises(CheckpointLayoutError, match="served model's"):
        await engine.load_weights(_write(served, tmp_path / "one-row-patch", one_row), 1, [Q])
    assert engine.weight_version() == 0
    assert all(torch.equal(p, before[n]) for n, p in engine.model.named_parameters())


async def test_a_non_finite_fp8_or_bf16_value_is_refused(tmp_path):
    model = tiny_moe(seed=6)
    for view_name, name, bits in (("fp8_e4m3", Q, 0x7F), ("bf16", "model.norm.weight", 0x7FC0)):
        view = get_view(view_name)
        tensors = dict(view.compute(model.state_dict()))
        raw = tensors[name].view(torch.uint8 if view_name == "fp8_e4m3" else torch.int16).clone()
        raw.view(-1)[5] = bits  # fp8 e4m3fn 0x7F and bf16 0x7FC0 are NaN
        tensors[name] = raw.view(tensors[name].dtype)
        write_checkpoint(tmp_path / view_name, tensors, {**model.config.to_dict(), **view.config_overrides()})
        engine = ReferenceEngine(dtype=torch.bfloat16)
        await engine.start()
        with pytest.raises(UnservableWeights, match=name):
            await engine.load_weights(tmp_path / view_name, 0)


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_the_fault_injection_is_refused_on_an_http_engine(kind):
    with pytest.raises(SprawlError, match="has no fault injection"):
        create_engine(kind, url="http://127.0.0.1:9", fault="wrong_dequant")
    assert create_engine(kind, url="http://127.0.0.1:9") is not None  # the refusal is the fault's alone


# ----------------------------------------------------------------------------- across a keyframe


@pytest.mark.integration
async def test_mxfp4_patches_across_a_keyframe_boundary_stay_bit_exact(event_log, settings, tmp_path):
    """v0 keyframe, v1 patch, v2 keyframe (with its skip patch from v1), v3 patch: a follower that walks
    the chain and one that jumps from v1 to v3 build the publisher's bits, and an engine that loads only
    what changed from v1 to v3 ends where a fresh engine at v3 does."""
    model = tiny_moe(seed=7)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    pub = publisher(event_log, settings, model, views=["mxfp4"], keyframe_every=2)
    gen = torch.Generator().manual_seed(2)
    roots, events, masters = [], [], []
    for v in range(4):
        if v:
            adam_like_step(state, 1e-3, gen)
        events.append(await pub.publish(v, state))
        roots.append(expected_root(state, "mxfp4"))
        masters.append({k: t.clone() for k, t in state.items()})
    pub.close()
    assert [e.views[0].kind for e in events] == ["keyframe", "patch", "keyframe", "patch"]
    walker = materializer(event_log, settings, tmp_path / "walker", view="mxfp4")
    late = materializer(event_log, settings, tmp_path / "late", view="mxfp4")
    for v in range(4):  # verified as built: the walker recycles the directories it no longer serves
        m = await walker.materialize(v)
        assert m.root_hash == roots[v] == verify_directory(m.path), m.route
    late1 = await late.materialize(1, pin=True)
    late3 = await late.materialize(3, pin=True)
    assert late3.root_hash == roots[3] == verify_directory(late3.path)
    assert late1.root_hash == roots[1] == verify_directory(late1.path)

    engine = ReferenceEngine(dtype=torch.float32)
    await engine.start()
    await engine.load_weights(late1.path, 1)
    view = get_view("mxfp4")
    before, after = view.compute(masters[1]), view.compute(masters[3])
    changed = [n for n in after if not torch.equal(before[n], after[n])]
    assert changed
    await engine.load_weights(late3.path, 3, changed)
    fresh = ReferenceEngine(dtype=torch.float32)
    await fresh.start()
    await fresh.load_weights(late3.path, 3)
    assert all(torch.equal(a, b) for a, b in zip(engine.model.parameters(), fresh.model.parameters(), strict=True))

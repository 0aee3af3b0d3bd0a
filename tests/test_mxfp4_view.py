"""The mxfp4 view: OCP MX v1.0 §6.3 rounding checked against hand-computed blocks, its on-disk layout,
bit-exact patches through the chain, and the reference engine computing in its numerics (and, with the
test-only `wrong_dequant` fault, visibly not)."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.bits import dtype_name
from pipeline.keyframe import write_checkpoint
from pipeline.materialize import VersionUnbuildable, verify_directory
from pipeline.sampling import process_logits
from pipeline.views import dequantize_mxfp4, get_view, quantize_mxfp4
from pipeline.views.mxfp4 import E2M1_VALUES, MX_BLOCK, decode_e2m1, e8m0_to_float, unpack_nibbles
from schemas import SamplingParams
from tests.chain_helpers import CorruptingBlobStore, expected_root, materializer, patch_key, publisher
from tests.tiny_models import adam_like_step, tiny_moe
from workers.sampler.engines.base import GenerateRequest
from workers.sampler.engines.reference import ReferenceEngine
from workers.sampler.engines.weights import FaultNotApplicable, affected_disk_tensors
from workers.sampler.settings import IslandSection, SamplerSettings

NAN = float("nan")


def _block(values: list[float]) -> list[float]:
    return values + [0.0] * (MX_BLOCK - len(values))


def _codes(codes: list[int]) -> list[int]:
    return codes + [0] * (MX_BLOCK - len(codes))


# Each row is one block of 32 with its hand-computed E8M0 byte and E2M1 codes (0..7 = 0, 0.5, 1, 1.5,
# 2, 3, 4, 6; +8 = negative). shared_exp = floor(log2 amax) - 2, X = 2^shared_exp, P = V / X rounded
# to nearest, ties to the even mantissa (codes 0, 2, 4, 6), |P| > 6 saturating to 6.
TIES = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]  # -> 0, 1, 1, 2, 2, 4, 4
TIE_CODES = [0, 2, 2, 4, 4, 6, 6]
GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
NEAR = [0.1, 0.26, 2.75, 4.9, 5.1, 6.5, 7.0, 7.9]  # -> 0, 0.5, 3, 4, 6, 6, 6 (saturated), 6 (saturated)
NEAR_CODES = [0, 1, 5, 6, 7, 7, 7, 7]
HAND_BLOCKS = [
    # amax 7.9: floor(log2) 2, shared 0, X = 1, byte 127. Every tie both signs, the grid, saturation.
    (
        _block(TIES + [-t for t in TIES] + GRID + NEAR + [-7.0, -0.1]),
        127,
        _codes(TIE_CODES + [c + 8 for c in TIE_CODES] + list(range(8)) + NEAR_CODES + [15, 8]),  # -0.1 -> -0
    ),
    # The same block times 2^-5: amax 0.246875, floor(log2) -3, shared -5, byte 122, the same codes.
    (
        [v * 2.0**-5 for v in _block(TIES + [-t for t in TIES] + GRID + NEAR + [-7.0, -0.1])],
        122,
        _codes(TIE_CODES + [c + 8 for c in TIE_CODES] + list(range(8)) + NEAR_CODES + [15, 8]),
    ),
    # amax exactly a power of two (8): floor(log2) 3, shared 1, X = 2, byte 128.
    # 8 -> 4, -8 -> -4, 5 -> 2.5 -> 2 (tie), 3 -> 1.5, 1 -> 0.5, 0.5 -> 0.25 -> 0 (tie), 0.4 -> 0, 0.6 -> 0.5
    (_block([8.0, -8.0, 5.0, 3.0, 1.0, 0.5, 0.4, 0.6]), 128, _codes([6, 14, 4, 3, 1, 0, 0, 1])),
    # amax 4 (a power of two at the bottom of the X = 1 range): 4 -> code 6, 6.0 never reached.
    (_block([4.0, -4.0, 3.9, 0.75]), 127, _codes([6, 14, 6, 2])),
    # All zero: byte 0 (2^-127), zero codes.
    (_block([]), 0, _codes([])),
    # A subnormal (fp32) amax 3*2^-128: floor(log2) -127, shared -129 clamped to -127, byte 0, X = 2^-127:
    # P = 1.5, 0.5, 0.25 -> 0 (tie), 0.75 -> 1 (tie), -0.5.
    (_block([3 * 2.0**-128, 2.0**-128, 2.0**-129, 3 * 2.0**-129, -(2.0**-128)]), 0, _codes([3, 1, 0, 2, 9])),
    # The smallest fp32 normal 2^-126: shared -128 clamped to -127, P = 2 -> code 4.
    (_block([2.0**-126, -(2.0**-127)]), 0, _codes([4, 10])),
    # A large amax 2^100 * 1.5: floor(log2) 100, shared 98, byte 225; P = 6, 4 * 0.75 = 3 -> codes 7, 5.
    (_block([1.5 * 2.0**100, 0.75 * 2.0**100]), 225, _codes([7, 5])),
    # NaN or inf in a block: byte 0xFF (X = NaN), zero codes.
    (_block([1.0, NAN, 2.0]), 0xFF, _codes([])),
    (_block([1.0, -math.inf]), 0xFF, _codes([])),
]


def test_hand_computed_blocks():
    weight = torch.tensor([values for values, _, _ in HAND_BLOCKS], dtype=torch.float32)
    assert weight[5, 0] != 0 and weight[5, 0] < torch.finfo(torch.float32).tiny  # really subnormal
    packed, scale = quantize_mxfp4(weight)
    assert packed.dtype == scale.dtype == torch.uint8
    assert packed.shape == (len(HAND_BLOCKS), MX_BLOCK // 2) and scale.shape == (len(HAND_BLOCKS), 1)
    assert scale.flatten().tolist() == [byte for _, byte, _ in HAND_BLOCKS]
    assert unpack_nibbles(packed).tolist() == [codes for _, _, codes in HAND_BLOCKS]


def test_dequantized_hand_blocks_are_code_times_scale():
    weight = torch.tensor([values for values, _, _ in HAND_BLOCKS], dtype=torch.float32)
    got = dequantize_mxfp4(*quantize_mxfp4(weight))
    assert got.dtype == torch.float32
    first = [0, 1, 1, 2, 2, 4, 4, -0.0, -1, -1, -2, -2, -4, -4, *GRID, 0, 0.5, 3, 4, 6, 6, 6, 6, -6, -0.0]
    assert got[0].tolist() == _block(first)
    assert torch.signbit(got[0, 31]) and torch.signbit(got[0, 7])  # -0.1 is served as -0.0, the sign kept
    assert got[1].tolist() == [v * 2.0**-5 for v in _block(first)]  # exact: powers of two
    assert got[2].tolist() == _block([8.0, -8.0, 4.0, 3.0, 1.0, 0.0, 0.0, 1.0])
    assert got[5].tolist() == _block([3 * 2.0**-128, 2.0**-128, 0.0, 2.0**-127, -(2.0**-128)])
    assert got[7].tolist() == _block([1.5 * 2.0**100, 0.75 * 2.0**100])
    assert got[8].isnan().all() and got[9].isnan().all()


def test_nibble_order_element_2j_in_the_low_nibble():
    weight = torch.tensor([_block([0.5, 6.0, -1.0, 0.0])])  # codes 1, 7, 10, 0; amax 6 -> X = 1
    packed, scale = quantize_mxfp4(weight)
    assert packed[0, :2].tolist() == [0x71, 0x0A] and scale.tolist() == [[127]]
    assert unpack_nibbles(torch.tensor([[0x71, 0x0A]], dtype=torch.uint8)).tolist() == [[1, 7, 10, 0]]


def test_every_e8m0_byte_and_e2m1_code_decodes_to_its_value():
    values = e8m0_to_float(torch.arange(256, dtype=torch.uint8))
    assert values[:255].tolist() == [math.ldexp(1.0, b - 127) for b in range(255)] and values[255].isnan()
    signed = decode_e2m1(torch.arange(16, dtype=torch.uint8)).tolist()
    assert signed == GRID + [-v for v in GRID] and math.copysign(1, signed[8]) == -1


def _nearest_e2m1(p: torch.Tensor) -> torch.Tensor:
    """An independent oracle: the nearest grid value to clamp(|P|, 6), ties to the even code, signed."""
    grid = E2M1_VALUES.double()
    distance = (p.abs().clamp(max=6.0)[..., None] - grid).abs()
    best = distance.min(-1, keepdim=True).values
    candidates = torch.where(distance == best, torch.arange(8), torch.tensor(99))
    even_first = torch.where(candidates % 2 == 0, candidates, candidates + 100)  # among ties, the even code
    code = torch.where(even_first.min(-1).values >= 100, even_first.min(-1).values - 100, even_first.min(-1).values)
    return torch.where(torch.signbit(p), -grid[code], grid[code])


@pytest.mark.parametrize("seed", [0, 1])
def test_round_trip_is_the_nearest_grid_point_within_the_e2m1_bound(seed):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(64, 256, generator=gen) * torch.logspace(-6, 2, 64)[:, None]
    weight[:, ::7] *= 20  # outliers: the amax of a block lands anywhere in [4, 8) * X
    ties = (torch.randint(-32, 33, (16, 256), generator=gen) * 0.25).float()  # many exact ties at X = 1, 2
    weight = torch.cat([weight, ties])
    packed, scale = quantize_mxfp4(weight)
    got = dequantize_mxfp4(packed, scale).double()
    x = torch.pow(2.0, scale.double() - 127).repeat_interleave(MX_BLOCK, 1)
    p = weight.double() / x
    assert torch.equal(got / x, _nearest_e2m1(p))
    spacing_half = torch.where(p.abs() < 2, 0.25, torch.where(p.abs() < 4, 0.5, 1.0))
    bound = torch.maximum(spacing_half, p.abs() - 6.0) * x  # above 6 X: saturation
    assert ((got - weight.double()).abs() <= bound).all()
    amax = weight.view(weight.shape[0], -1, MX_BLOCK).abs().amax(-1).double()
    assert (
        (amax / torch.pow(2.0, scale.double() - 127) >= 4) & (amax / torch.pow(2.0, scale.double() - 127) < 8)
    ).all()


def test_a_weight_without_whole_blocks_is_refused_by_the_quantizer_and_kept_bf16_by_the_view():
    with pytest.raises(ValueError, match="multiple of the MX block"):
        quantize_mxfp4(torch.ones(4, 48))
    served = get_view("mxfp4").compute(
        {"x.odd_proj.weight": torch.ones(4, 48), "x.even_proj.weight": torch.ones(4, 64)}
    )
    assert served["x.odd_proj.weight"].dtype == torch.bfloat16 and "x.odd_proj.weight_scale" not in served
    assert served["x.even_proj.weight"].dtype == torch.uint8 and served["x.even_proj.weight_scale"].shape == (4, 2)


def test_the_view_on_a_tiny_moe_quantizes_linears_and_keeps_the_rest_bf16():
    model = tiny_moe(seed=1)
    state = model.state_dict()
    view = get_view("mxfp4")
    served = view.compute(state)
    linears = [n for n in served if n.endswith("_proj.weight")]
    assert len(linears) == 2 * (4 + 4 * 3)  # 2 layers: q, k, v, o; 4 experts x gate, up, down
    for name in linears:
        out, cols = served[name].shape[0], served[name].shape[1] * 2
        assert served[name].dtype == torch.uint8
        assert served[name + "_scale"].dtype == torch.uint8 and served[name + "_scale"].shape == (out, cols // 32)
    rest = {n: t for n, t in served.items() if n not in linears and not n.endswith("_scale")}
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= set(rest)
    assert "model.layers.0.mlp.gate.weight" in rest and "model.layers.1.input_layernorm.weight" in rest
    assert all(t.dtype == torch.bfloat16 for t in rest.values())
    assert set(served) == set(linears) | {n + "_scale" for n in linears} | set(rest)
    # Same names as the bf16 view, plus one scale per linear; the expert shapes are the disk layout's.
    assert set(get_view("bf16").compute(state)) == set(linears) | set(rest)
    assert served["model.layers.0.mlp.experts.3.down_proj.weight"].shape == (128, 32)
    config = view.config_overrides()["quantization_config"]
    assert config["quant_method"] == "quark"
    weight = config["global_quant_config"]["weight"]
    assert weight.items() >= {"dtype": "fp4", "group_size": 32, "scale_format": "e8m0", "is_dynamic": False}.items()
    assert all(dtype_name(t.dtype) for t in served.values())  # every served dtype has a bit representation


def test_the_view_is_deterministic():
    state = tiny_moe(seed=2).state_dict()
    a, b = get_view("mxfp4").compute(state), get_view("mxfp4").compute(state)
    assert a.keys() == b.keys() and all(torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a)


# ----------------------------------------------------------------------------- the chain


@pytest.mark.integration
async def test_mxfp4_patches_materialize_bit_exact_and_a_corrupt_one_is_refused(event_log, settings, tmp_path):
    model = tiny_moe()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    blobs = CorruptingBlobStore(settings.blobs, patch_key(3, 2))
    pub = publisher(event_log, settings, model, blobs=blobs, views=["mxfp4"], keyframe_every=100)
    gen = torch.Generator().manual_seed(1)
    roots, events = [], []
    for v in range(4):
        if v:
            adam_like_step(state, 1e-3, gen)  # enough to cross E2M1 rounding boundaries
        events.append(await pub.publish(v, state))
        roots.append(expected_root(state, "mxfp4"))
    pub.close()
    for v in (1, 2):
        [entry] = events[v].views
        assert entry.kind == "patch" and 0 < entry.changed_elements < entry.total_elements
    follower = materializer(event_log, settings, tmp_path / "follower", view="mxfp4")
    for v in range(3):
        got = await follower.materialize(v)
        assert got.root_hash == roots[v] == events[v].views[0].root_hash == verify_directory(got.path)
    with pytest.raises(VersionUnbuildable, match="corrupt"):
        await follower.materialize(3)
    assert len(blobs.corrupted) == 1 and follower.failures.by_blob.keys() == blobs.corrupted.keys()


# ----------------------------------------------------------------------------- the reference engine

SAMPLING = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=16, logprobs_top_k=8)
PROMPTS = [[1, 5, 9, 17, 33, 2], [3, 3, 40, 7], [60, 12, 8, 90, 4, 4, 11], [2, 71, 19]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny MoE (the demo model's sizes) written in three views, two versions each."""
    model = tiny_moe(seed=3)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["lm_head.weight"] *= 30  # a peaked next-token distribution, like a trained model's
    root = tmp_path_factory.mktemp("mxfp4-views")
    paths, states = {}, {}
    for version in (0, 1):
        if version:
            adam_like_step(state, 2e-2, torch.Generator().manual_seed(0))
        states[version] = {k: v.clone() for k, v in state.items()}
        for name in ("bf16", "fp8_e4m3", "mxfp4"):
            view = get_view(name)
            paths[name, version] = root / f"{name}-v{version}"
            write_checkpoint(
                paths[name, version], view.compute(state), {**model.config.to_dict(), **view.config_overrides()}
            )
    return model.config, states, paths


async def _engine(path, dtype=torch.float32, fault="none") -> ReferenceEngine:
    engine = ReferenceEngine(dtype=dtype, fault=fault)
    await engine.start()
    await engine.load_weights(path, 0)
    return engine


def _dequantized_master(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """What an mxfp4 island must compute with, built here from the master weights in memory layout
    (fused experts quantized per expert: MX blocks run along rows, so slicing changes nothing)."""
    out = {}
    for name, tensor in state.items():
        if name.endswith(("gate_up_proj", "down_proj")) and tensor.dim() == 3:
            out[name] = torch.stack([dequantize_mxfp4(*quantize_mxfp4(t)) for t in tensor]).to(dtype)
        elif name.endswith("_proj.weight"):
            out[name] = dequantize_mxfp4(*quantize_mxfp4(tensor)).to(dtype)
        else:
            out[name] = tensor.to(torch.bfloat16).to(dtype)
    return out


def _logprobs(model, sample) -> torch.Tensor:
    """Teacher-forced log-distributions [output tokens, vocab] under SAMPLING (temperature 1: raw)."""
    tokens = torch.tensor([sample.prompt_token_ids + sample.output_token_ids])
    with torch.no_grad():
        logits = model(input_ids=tokens).logits[0].float()
    start = len(sample.prompt_token_ids) - 1
    return process_logits(logits[start : start + len(sample.output_token_ids)], 1.0, 0, 1.0).logprobs


async def test_the_engine_computes_with_the_dequantized_weights(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    config, states, paths = tiny
    engine = await _engine(paths["mxfp4", 0])
    expected = _dequantized_master(states[0], torch.float32)
    params = dict(engine.model.named_parameters())
    assert params.keys() == expected.keys()
    assert all(torch.equal(params[n], expected[n]) for n in expected)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.load_state_dict(expected, strict=True)
    for sample in await engine.generate(GenerateRequest(PROMPTS[0], 2, SAMPLING, seed=4)):
        recomputed = _logprobs(model, sample).gather(1, torch.tensor(sample.output_token_ids)[:, None]).squeeze(1)
        assert (torch.tensor(sample.logprobs) - recomputed).abs().max() < 1e-4

    # A partial load (only what changed) leaves the engine where a full load does.
    changed = ["model.layers.0.self_attn.q_proj.weight_scale", "model.layers.1.mlp.experts.2.up_proj.weight"]
    assert {
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.mlp.experts.0.gate_proj.weight_scale",
    } <= affected_disk_tensors(paths["mxfp4", 1], changed)
    moved = {k: v.clone() for k, v in states[0].items()}
    moved["model.layers.0.self_attn.q_proj.weight"] *= 2  # every scale byte +1, the codes unchanged
    moved["model.layers.1.mlp.experts.gate_up_proj"][2, 64:] += 0.05  # expert 2's up_proj
    view = get_view("mxfp4")
    before, after = view.compute(states[0]), view.compute(moved)
    differ = [n for n in after if not torch.equal(before[n], after[n])]
    assert set(differ) == {
        "model.layers.0.self_attn.q_proj.weight_scale",  # its weight comes along (affected_disk_tensors)
        "model.layers.1.mlp.experts.2.up_proj.weight",
        "model.layers.1.mlp.experts.2.up_proj.weight_scale",
    }
    write_checkpoint(tmp_path / "moved", after, {**config.to_dict(), **view.config_overrides()})
    await engine.load_weights(tmp_path / "moved", 1, differ)
    fresh = await _engine(tmp_path / "moved")
    assert all(torch.equal(a, b) for a, b in zip(engine.model.parameters(), fresh.model.parameters(), strict=True))


def _kl(p_logprobs: torch.Tensor, q_logprobs: torch.Tensor) -> float:
    """Mean over positions of KL(p || q), exact over the vocabulary."""
    return float((p_logprobs.exp() * (p_logprobs - q_logprobs)).sum(-1).mean())


async def test_wrong_dequant_is_a_broken_island_not_a_different_one(tiny):
    """The fault the drift guard must catch: the KL it causes against a healthy island of the same view
    dwarfs the KL between healthy islands of different views. The figures are printed (`-s`)."""
    _, _, paths = tiny
    engines = {view: await _engine(paths[view, 0], torch.bfloat16) for view in ("bf16", "fp8_e4m3", "mxfp4")} | {
        f"{view}+wrong_dequant": await _engine(paths[view, 0], torch.bfloat16, "wrong_dequant")
        for view in ("fp8_e4m3", "mxfp4")
    }
    per_prompt: dict[str, list[float]] = {name: [] for name in engines if name != "bf16"}
    for i, prompt in enumerate(PROMPTS):
        [sample] = await engines["bf16"].generate(GenerateRequest(prompt, 1, SAMPLING, seed=i))
        reference = _logprobs(engines["bf16"].model, sample)
        for name in per_prompt:
            healthy = reference if "+" not in name else _logprobs(engines[name.split("+")[0]].model, sample)
            per_prompt[name].append(_kl(healthy, _logprobs(engines[name].model, sample)))
    kl = {name: sum(v) / len(v) for name, v in per_prompt.items()}
    print("\nmean per-token KL, teacher-forced on bf16 samples (vs bf16; faults vs the healthy same view):")
    for name, value in kl.items():
        print(f"  {name:24s} {value:.5f}")
    assert 0 < kl["fp8_e4m3"] < kl["mxfp4"]  # 4 bits are further from bf16 than 8
    assert kl["mxfp4+wrong_dequant"] > 10 * kl["mxfp4"]
    assert kl["fp8_e4m3+wrong_dequant"] > 10 * kl["fp8_e4m3"]


async def test_wrong_dequant_on_a_bf16_island_refuses_to_start(tiny, monkeypatch):
    _, _, paths = tiny
    with pytest.raises(FaultNotApplicable, match="no quantized weights"):
        await _engine(paths["bf16", 0], fault="wrong_dequant")
    with pytest.raises(ValueError, match="needs a quantized view"):
        IslandSection(view="bf16", fault="wrong_dequant")
    monkeypatch.setenv("SPRAWL_ISLAND__FAULT", "wrong_dequant")
    monkeypatch.setenv("SPRAWL_ISLAND__VIEW", "mxfp4")
    assert SamplerSettings().island.fault == "wrong_dequant"
    assert IslandSection().fault == "none"

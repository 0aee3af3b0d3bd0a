"""Served views follow the model's family: every view writes the names the family's own checkpoints
use (`save_pretrained` for bf16; block-FP8 `weight_scale_inv` and Quark `weight_scale` next to them),
quantizes the family's linears within the format's error and keeps routers, norms and embeddings
bf16; its quantization config excludes exactly the modules it keeps bf16. A Mixtral model goes through
the chain bit-exactly and the reference engine serves what an island materialized. HTTP engines count
MoE layers and k by the family."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from pipeline.bits import checksum, dtype_name, root_hash, to_bits
from pipeline.materialize import verify_directory
from pipeline.moe_families import MOE_FAMILIES, UnsupportedMoeFamily, routing_shape
from pipeline.views import cast_bf16, dequantize_fp8_block, dequantize_mxfp4, disk_layout, get_view
from pipeline.views.mxfp4 import e8m0_to_float
from schemas import SamplingParams
from tests.chain_helpers import materializer, publisher
from tests.tiny_models import adam_like_step, tiny_model
from workers.sampler.engines.base import GenerateRequest
from workers.sampler.engines.http_base import HTTPEngine
from workers.sampler.engines.reference import ReferenceEngine
from workers.sampler.engines.weights import CheckpointLayoutError, read_served_tensors
from workers.trainer.recovery import root_hashes

MODEL_TYPES = [*sorted(MOE_FAMILIES), "qwen3"]
SCALES = {"fp8_e4m3": ".weight_scale_inv", "mxfp4": ".weight_scale"}
ROUTERS = {
    "qwen3_moe": "mlp.gate",
    "deepseek_v3": "mlp.gate",
    "mixtral": "block_sparse_moe.gate",
    "gpt_oss": "mlp.router",
}
"""Each family's router module on disk, spelled out here (tests/test_moe_families.py checks the
registry's against `save_pretrained`)."""


def _scrambled(model_type: str, seed: int = 0) -> torch.nn.Module:
    """A tiny model whose every tensor is random (biases and norms too), so a misplaced tensor shows."""
    model = tiny_model(model_type, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in model.state_dict().values():
            tensor.add_(torch.randn(tensor.shape, generator=generator) * 0.05)
    return model


def _kept_bf16(model_type: str, name: str, tensor: torch.Tensor) -> bool:
    """What the family's quantized checkpoints keep unquantized, spelled out per family: every tensor
    but a 2-D linear weight; of those, embeddings, lm_head and routers."""
    if tensor.dim() != 2 or not name.endswith(".weight"):
        return True
    router = ROUTERS.get(model_type)
    return name in ("model.embed_tokens.weight", "lm_head.weight") or (
        router is not None and name.endswith(f".{router}.weight")
    )


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_every_view_writes_the_familys_names_and_quantizes_its_linears(model_type, tmp_path):
    model = _scrambled(model_type)
    state = model.state_dict()
    model.save_pretrained(tmp_path)
    saved = load_file(next(tmp_path.glob("*.safetensors")))
    masters = dict(disk_layout(state, model_type=model_type))  # fp32, on-disk names

    bf16 = get_view("bf16").compute(state, model_type=model_type)
    assert sorted(bf16) == sorted(saved) == sorted(masters)
    assert all(torch.equal(bf16[n], cast_bf16(masters[n])) for n in bf16)

    quantized = sorted(n for n, t in masters.items() if not _kept_bf16(model_type, n, t))
    for view_name, suffix in SCALES.items():
        served = get_view(view_name).compute(state, model_type=model_type)
        scales = [n.removesuffix(suffix) + ".weight" for n in served if n.endswith(suffix)]
        assert sorted(scales) == quantized  # the tiny widths are multiples of 32: mxfp4 quantizes them all
        assert sorted(served) == sorted([*masters, *(n.removesuffix(".weight") + suffix for n in quantized)])
        for name in set(masters) - set(quantized):  # routers, norms, embeddings, biases, fused experts
            assert served[name].dtype == torch.bfloat16 and torch.equal(served[name], bf16[name]), name
        for name in quantized:
            weight, scale, master = served[name], served[name.removesuffix(".weight") + suffix], masters[name]
            if view_name == "fp8_e4m3":  # e4m3: 3 mantissa bits, subnormals below 2^-6 of the block scale
                assert weight.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
                error = (dequantize_fp8_block(weight, scale) - master).abs()
                block_scale = dequantize_fp8_block(torch.ones_like(weight), scale)  # each element's block scale
                assert (error <= master.abs() / 16 + block_scale / 2**10).all(), name
            else:  # E2M1 on X = 2^(floor(log2 amax) - 2): half a step is at most X, saturation below 2X
                assert weight.dtype == torch.uint8 and scale.dtype == torch.uint8
                error = (dequantize_mxfp4(weight, scale) - master).abs()
                assert (error <= 2 * e8m0_to_float(scale).repeat_interleave(32, 1)).all(), name
    if model_type == "mixtral":  # the experts under Mixtral's own names are linears like any other
        assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in quantized
    if model_type == "deepseek_v3":  # fused with q_a_proj by vLLM and SGLang: quantized alike
        assert "model.layers.0.self_attn.kv_a_proj_with_mqa.weight" in quantized
    if model_type == "gpt_oss":  # no quantized layout of its fused 3-D experts is established
        assert "model.layers.0.mlp.experts.gate_up_proj" not in quantized


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_the_quantization_config_excludes_exactly_the_linear_modules_kept_bf16(model_type):
    model = tiny_model(model_type)
    config = model.config.to_dict()
    modules = dict(model.named_modules())
    served = get_view("fp8_e4m3").compute(model.state_dict(), model_type=model_type)
    fp8 = get_view("fp8_e4m3").config_overrides(config)["quantization_config"]
    mxfp4 = get_view("mxfp4").config_overrides(config)["quantization_config"]
    assert fp8["modules_to_not_convert"] == mxfp4["exclude"]
    excluded = fp8["modules_to_not_convert"]
    router = ROUTERS.get(model_type)
    routers = [n.removesuffix(".weight") for n in served if router and n.endswith(f".{router}.weight")]
    experts = [f"model.layers.{i}.mlp.experts" for i in range(2)] if model_type == "gpt_oss" else []
    assert sorted(excluded) == sorted(["lm_head", *routers, *experts])
    assert len(routers) == routing_shape(model.config).layers
    for module in excluded:  # exact module names (what vLLM compares with), none of them quantized
        in_memory = module.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's router, as transformers names it
        assert in_memory in modules, module
        assert not any(n.startswith(module + ".") and n.endswith("_scale_inv") for n in served), module
    # A caller that gives no config still gets what it always did.
    assert get_view("mxfp4").config_overrides()["quantization_config"]["exclude"] == ["lm_head", "*mlp.gate"]
    assert "modules_to_not_convert" not in get_view("fp8_e4m3").config_overrides()["quantization_config"]


# ---------------------------------------------------------------- through the chain to an engine


def _served_root(state: dict[str, torch.Tensor], view: str, model_type: str) -> str:
    tensors = get_view(view).compute(state, model_type=model_type)
    return root_hash([(n, dtype_name(t.dtype), tuple(t.shape), checksum(to_bits(t))) for n, t in tensors.items()])


@pytest.mark.integration
async def test_a_mixtral_goes_through_the_chain_bit_exactly_and_the_reference_engine_serves_it(
    event_log, settings, tmp_path
):
    model = _scrambled("mixtral", seed=1)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    views = ["bf16", "fp8_e4m3"]
    pub = publisher(event_log, settings, model, views=views, keyframe_every=2, publish_units=3)
    generator = torch.Generator().manual_seed(2)
    events, states = [], []
    for version in range(3):  # a keyframe, a patch, a keyframe
        if version:
            adam_like_step(state, 1e-3, generator)
        states.append({k: v.clone() for k, v in state.items()})
        events.append(await pub.publish(version, state))
    pub.close()
    assert [e.views[0].kind for e in events] == ["keyframe", "patch", "keyframe"]
    model.load_state_dict(states[-1])
    assert root_hashes(model, views) == {v.view: v.root_hash for v in events[-1].views}  # the trainer's own check

    got = {}
    for view in views:
        island = materializer(event_log, settings, tmp_path / view, view=view)
        for version in range(3):
            got[view, version] = await island.materialize(version)
            expected = _served_root(states[version], view, "mixtral")
            assert got[view, version].root_hash == expected == verify_directory(got[view, version].path)
    directory = got["fp8_e4m3", 2].path
    config = json.loads((directory / "config.json").read_text())
    weight_map = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    assert config["model_type"] == "mixtral"
    assert "model.layers.0.block_sparse_moe.experts.1.w3.weight_scale_inv" in weight_map
    assert not any(".mlp." in n for n in weight_map)  # no tensor under Qwen's names

    engine = ReferenceEngine(dtype=torch.float32)
    await engine.start()
    await engine.load_weights(got["bf16", 2].path, 2)
    for name, tensor in engine.model.state_dict().items():
        assert torch.equal(tensor, states[2][name].to(torch.bfloat16).float()), name
    sampling = SamplingParams(temperature=1.0, max_new_tokens=4, logprobs_top_k=2)
    [sample] = await engine.generate(GenerateRequest([1, 5, 9], 1, sampling, seed=3))
    assert len(sample.output_token_ids) == 4
    assert torch.tensor(sample.routed_experts).shape == (3 + 4 - 1, 2, 2)
    # The fp8 version: the engine computes with exactly the served experts' dequantized bits.
    fp8 = ReferenceEngine(dtype=torch.float32)
    await fp8.start()
    await fp8.load_weights(got["fp8_e4m3", 2].path, 2)
    served = read_served_tensors(got["fp8_e4m3", 2].path)
    expert = "model.layers.0.block_sparse_moe.experts.2.w2"
    down = dequantize_fp8_block(served[expert + ".weight"], served[expert + ".weight_scale_inv"])
    assert torch.equal(fp8.model.state_dict()["model.layers.0.mlp.experts.down_proj"][2], down)
    router = "model.layers.0.block_sparse_moe.gate.weight"  # bf16 on disk, no scale
    assert served[router].dtype == torch.bfloat16 and router + "_scale_inv" not in served
    assert torch.equal(fp8.model.state_dict()["model.layers.0.mlp.gate.weight"], served[router].float())
    await engine.shutdown()
    await fp8.shutdown()


async def test_a_version_whose_tensors_are_not_its_configs_family_is_refused(tmp_path):
    """A Mixtral checkpoint whose config.json claims Qwen3-MoE (a forged or mixed-up config) is refused
    by name, never loaded with its experts left out or misplaced."""
    from pipeline.keyframe import write_checkpoint

    model = tiny_model("mixtral")
    served = get_view("bf16").compute(model.state_dict(), model_type="mixtral")
    write_checkpoint(tmp_path / "v0", served, {**model.config.to_dict(), "model_type": "qwen3_moe"})
    engine = ReferenceEngine()
    await engine.start()
    with pytest.raises(CheckpointLayoutError, match="block_sparse_moe"):
        await engine.load_weights(tmp_path / "v0", 0)


# ---------------------------------------------------------------- HTTP engines' routing shape


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_http_engines_count_moe_layers_and_k_by_the_family(model_type, tmp_path):
    config = tiny_model(model_type).config
    if model_type == "qwen3_moe":
        config = tiny_model(model_type, num_hidden_layers=4, mlp_only_layers=[1]).config
    (tmp_path / "config.json").write_text(
        json.dumps({**config.to_dict(), **get_view("fp8_e4m3").config_overrides(config.to_dict())})
    )
    engine = HTTPEngine("http://127.0.0.1:1")
    engine._read_shape(tmp_path)
    shape = routing_shape(config)
    assert engine._model_shape == (shape.layers, shape.top_k)
    expected_layers = {"qwen3_moe": 3, "deepseek_v3": 2, "mixtral": 2, "gpt_oss": 2, "qwen3": 0}
    assert shape.layers == expected_layers[model_type]  # Qwen3-MoE's mlp_only layer, DeepSeek's dense first


def test_http_engines_refuse_an_moe_model_of_no_registered_family(tmp_path):
    from transformers import AutoConfig

    config = AutoConfig.for_model("olmoe", num_hidden_layers=2, num_experts=4, num_experts_per_tok=2)
    (tmp_path / "config.json").write_text(config.to_json_string())
    with pytest.raises(UnsupportedMoeFamily, match="olmoe"):
        HTTPEngine("http://127.0.0.1:1")._read_shape(tmp_path)

"""MoE families (pipeline/moe_families.py): each registered family, and a dense model, through the
on-disk layout, routing replay, the reference engine's routing record and the trainer's admission;
hostile routes and unregistered MoE models end in a clear error, never a silent wrong route."""

from __future__ import annotations

import json

import msgspec
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from pipeline.keyframe import write_checkpoint
from pipeline.moe_families import (
    DENSE,
    MOE_FAMILIES,
    UnsupportedMoeFamily,
    expert_layout,
    model_routers,
    routing_shape,
)
from pipeline.routing_replay import RoutingRecordRefused, moe_gates, replay_routing
from pipeline.views import cast_bf16, disk_layout
from schemas import SamplingParams
from tests.events import trajectory
from tests.tiny_models import tiny_model
from workers.sampler.engines.base import GenerateRequest
from workers.sampler.engines.reference import ReferenceEngine
from workers.sampler.engines.weights import fuse_experts, model_state_dict
from workers.trainer.admission import refusal

FAMILIES = sorted(MOE_FAMILIES)
DENSE_TYPE = "qwen3"
TOKENS = torch.tensor([[1, 5, 9, 17, 33, 2], [3, 8, 13, 21, 34, 55]])


def _scrambled(model_type: str, seed: int = 0) -> torch.nn.Module:
    """A tiny model in which every tensor is random, so a tensor written under the wrong name or taken
    from the wrong expert shows: routers' biases and DeepSeek's correction bias included (zero at init)."""
    model = tiny_model(model_type, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if tensor.is_floating_point():
                tensor.add_(torch.randn(tensor.shape, generator=generator) * 0.05)
    return model


def _choices(model: torch.nn.Module, tokens: torch.Tensor = TOKENS) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The experts every router picked ([tokens, k] per MoE layer) and the logits, in one forward pass."""
    family, routers = model_routers(model)
    assert family is not None
    seen: list[torch.Tensor] = []
    handles = [r.register_forward_hook(lambda _m, _i, out: seen.append(family.chosen(out))) for r in routers]
    try:
        logits = model(input_ids=tokens).logits
    finally:
        for handle in handles:
            handle.remove()
    return seen, logits


# ---------------------------------------------------------------- the on-disk layout


@pytest.mark.parametrize("model_type", [*FAMILIES, DENSE_TYPE])
def test_disk_layout_writes_transformers_own_checkpoint_names_and_loads_back_identically(model_type, tmp_path):
    model = _scrambled(model_type)
    state = model.state_dict()
    ours = dict(disk_layout(state, model_type=model_type))
    assert sum(t.numel() for t in ours.values()) == sum(t.numel() for t in state.values())  # each weight once

    model.save_pretrained(tmp_path / "saved")  # transformers' own conversion mapping, reversed
    [saved_file] = (tmp_path / "saved").glob("*.safetensors")
    saved = load_file(saved_file)
    assert sorted(ours) == sorted(saved)
    assert all(torch.equal(ours[name], saved[name]) for name in saved)
    if model_type in MOE_FAMILIES:  # what a quantization config must exclude to keep routers bf16
        router = MOE_FAMILIES[model_type].disk_router + ".weight"
        assert sum(name.endswith(router) for name in ours) == routing_shape(model.config).layers
    if model_type == "mixtral":
        assert "model.layers.0.block_sparse_moe.experts.3.w3.weight" in ours
        assert "model.layers.1.block_sparse_moe.gate.weight" in ours
    if model_type == "gpt_oss":
        assert "model.layers.0.mlp.experts.gate_up_proj_bias" in ours and "model.layers.1.mlp.router.bias" in ours

    write_checkpoint(tmp_path / "ours", {n: t.contiguous() for n, t in ours.items()}, model.config.to_dict())
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32)
    assert loaded.state_dict().keys() == state.keys()
    assert all(torch.equal(loaded.state_dict()[n], t) for n, t in state.items())
    # and the reference engine's loader maps the names back the same way
    engine_state = model_state_dict(tmp_path / "ours", torch.float32)
    assert engine_state.keys() == state.keys()
    assert all(torch.equal(engine_state[n], t) for n, t in state.items())


def test_fusing_a_families_experts_refuses_a_missing_projection():
    from workers.sampler.engines.weights import CheckpointLayoutError

    state = _scrambled("mixtral").state_dict()
    ours = dict(disk_layout(state, model_type="mixtral"))
    del ours["model.layers.1.block_sparse_moe.experts.2.w3.weight"]  # an up projection, under Mixtral's name
    with pytest.raises(CheckpointLayoutError, match=r"experts\.: an expert has no up projection"):
        fuse_experts(ours, expert_layout("mixtral"))


def test_a_gpt_oss_state_dict_without_a_model_type_is_refused_not_split_as_qwens():
    with pytest.raises(Exception, match="GPT-OSS-style router"):
        dict(disk_layout(tiny_model("gpt_oss").state_dict()))


# ---------------------------------------------------------------- routing replay


@pytest.mark.parametrize("model_type", FAMILIES)
def test_replaying_the_models_own_routes_changes_nothing(model_type):
    """The replayed weights are the family's own formula: forcing the experts the model picks itself
    gives bit-identical logits (a wrong softmax, normalization, bias or scale would not)."""
    model = _scrambled(model_type, seed=1)
    with torch.no_grad():
        own, own_logits = _choices(model)
        routed = torch.stack(own, dim=1).view(*TOKENS.shape, len(own), -1)
        with replay_routing(model, routed, torch.ones(TOKENS.shape, dtype=torch.bool)):
            replayed, replayed_logits = _choices(model)
    assert all(torch.equal(a, b) for a, b in zip(own, replayed, strict=True))
    assert torch.equal(own_logits, replayed_logits)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_replay_forces_recorded_experts_that_differ_from_the_models_and_the_router_learns(model_type):
    model = _scrambled(model_type, seed=2)
    family, routers = model_routers(model)
    experts = family.expert_count(model.config)
    with torch.no_grad():
        own, own_logits = _choices(model)
    recorded = (torch.stack(own, dim=1) + 1) % experts  # another expert everywhere, still k distinct ones
    routed = recorded.view(*TOKENS.shape, len(own), -1)
    valid = torch.ones(TOKENS.shape, dtype=torch.bool)
    valid[1, -1] = False  # an unrecorded position keeps the model's own choice

    model.train()
    with replay_routing(model, routed, valid):
        replayed, logits = _choices(model)
    flat_valid = valid.reshape(-1)
    for layer, chosen in enumerate(replayed):
        assert torch.equal(chosen[flat_valid], recorded[flat_valid, layer])
        assert torch.equal(chosen[~flat_valid], own[layer][~flat_valid])
        assert not torch.equal(chosen, own[layer])
    assert not torch.allclose(logits, own_logits)
    logits.float().logsumexp(-1).sum().backward()
    for router in routers:
        assert router.weight.grad is not None and bool(router.weight.grad.abs().sum() > 0)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_a_hostile_record_is_refused_before_any_forward(model_type):
    model = tiny_model(model_type, seed=3)
    shape = routing_shape(model.config)
    valid = torch.ones(TOKENS.shape, dtype=torch.bool)
    good = torch.arange(shape.top_k).expand(*TOKENS.shape, shape.layers, shape.top_k).clone()
    sentinel = good.clone()
    sentinel[0, 2, -1, 0] = shape.experts  # transformers' expert-parallel sentinel: dropped without a word
    negative = good.clone()
    negative[1, 0, 0, 1] = -1
    twice = good.clone()
    twice[0, 0, 0, :] = 1
    hostile_records = [
        ("MoE layers", torch.cat([good, good[:, :, :1]], dim=2)),
        ("experts a token", good[..., :1]),
        (f"expert id {shape.experts} is outside", sentinel),
        ("expert id -1 is outside", negative),
        ("same expert twice", twice),
    ]
    calls = []
    handles = [r.register_forward_hook(lambda *_: calls.append(1)) for r in moe_gates(model)]
    for reason, routed in hostile_records:
        with pytest.raises(RoutingRecordRefused, match=reason), replay_routing(model, routed, valid):
            model(input_ids=TOKENS)
    for handle in handles:
        handle.remove()
    assert calls == []


def test_a_sentinel_id_at_an_unrecorded_position_is_ignored_not_refused():
    model = tiny_model("qwen3_moe", seed=3)
    shape = routing_shape(model.config)
    routed = torch.zeros(*TOKENS.shape, shape.layers, shape.top_k, dtype=torch.long)
    routed[..., 1] = 1
    routed[1, -1] = shape.experts  # padding: whatever it holds, the model's own choice is kept there
    valid = torch.ones(TOKENS.shape, dtype=torch.bool)
    valid[1, -1] = False
    with torch.no_grad(), replay_routing(model, routed, valid):
        model(input_ids=TOKENS)


# ---------------------------------------------------------------- unregistered and dense models


def _olmoe():
    """A real MoE architecture with no entry in MOE_FAMILIES."""
    config = AutoConfig.for_model(
        "olmoe",
        vocab_size=96,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


async def test_an_unregistered_moe_family_is_refused_naming_the_supported_ones(tmp_path):
    model = _olmoe()
    supported = "deepseek_v3, gpt_oss, mixtral, qwen3_moe"
    with pytest.raises(UnsupportedMoeFamily, match=f"'olmoe' is a mixture-of-experts.*{supported}") as refused:
        moe_gates(model)
    assert refused.value.hint
    routed = torch.zeros(*TOKENS.shape, 1, 2, dtype=torch.long)
    with pytest.raises(UnsupportedMoeFamily), replay_routing(model, routed, torch.ones(TOKENS.shape, dtype=torch.bool)):
        pass
    with pytest.raises(UnsupportedMoeFamily):
        routing_shape(model.config)
    with pytest.raises(UnsupportedMoeFamily, match="on-disk names"):
        dict(disk_layout(model.state_dict(), model_type="olmoe"))
    # a keyframe written under the (Qwen-style) names OLMoE checkpoints use: the engine refuses the model
    write_checkpoint(tmp_path / "v0", dict(disk_layout(model.state_dict())), model.config.to_dict())
    engine = ReferenceEngine(dtype=torch.float32)
    await engine.start()
    with pytest.raises(UnsupportedMoeFamily, match="routes cannot be recorded"):
        await engine.load_weights(tmp_path / "v0", 0)


def test_a_dense_model_needs_no_family():
    model = tiny_model(DENSE_TYPE)
    assert model_routers(model) == (None, [])
    assert routing_shape(model.config) == DENSE
    nothing = torch.zeros(*TOKENS.shape, 0, 0, dtype=torch.long)
    with (
        pytest.raises(RoutingRecordRefused, match="dense model"),
        replay_routing(model, nothing, torch.ones(TOKENS.shape)),
    ):
        pass


# ---------------------------------------------------------------- the reference engine's routing record


@pytest.mark.parametrize("model_type", [*FAMILIES, DENSE_TYPE])
async def test_the_reference_engine_serves_each_family_and_records_its_routes(model_type, tmp_path):
    model = _scrambled(model_type, seed=4)
    state = model.state_dict()
    served = {n: cast_bf16(t) for n, t in disk_layout(state, model_type=model_type)}
    write_checkpoint(tmp_path / "v0", served, {**model.config.to_dict(), "dtype": "bfloat16"})
    engine = ReferenceEngine(dtype=torch.float32)  # fp32 compute on the bf16 weights: routes comparable exactly
    await engine.start()
    await engine.load_weights(tmp_path / "v0", 0)
    for name, tensor in engine.model.state_dict().items():  # every tensor arrived, buffers included
        assert torch.equal(tensor.float(), state[name].to(torch.bfloat16).float()), name

    prompt = [1, 5, 9, 17]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=5, logprobs_top_k=4)
    samples = await engine.generate(GenerateRequest(prompt, 2, sampling, seed=7))
    shape = routing_shape(model.config)
    for sample in samples:
        if shape == DENSE:
            assert sample.routed_experts is None
            continue
        routes = torch.tensor(sample.routed_experts)
        assert tuple(routes.shape) == (len(prompt) + len(sample.output_token_ids) - 1, shape.layers, shape.top_k)
        assert int(routes.min()) >= 0 and int(routes.max()) < shape.experts
        assert bool((routes.sort(-1).values.diff(dim=-1) > 0).all())  # k distinct experts
        assert refusal(_trajectory_with(sample.routed_experts), 96, routing=shape) is None
        # the record is what the routers pick in a teacher-forced pass over the same tokens
        tokens = torch.tensor([sample.prompt_token_ids + sample.output_token_ids])
        with torch.no_grad():
            seen, _ = _choices(engine.model, tokens)
        assert torch.equal(torch.stack(seen, dim=1)[: len(routes)].sort(-1).values, routes.sort(-1).values)


# ---------------------------------------------------------------- admission


def _trajectory_with(routed):
    return msgspec.structs.replace(trajectory("r", "t-0", 3), routed_experts=routed)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_admission_checks_routes_against_the_family(model_type):
    config = tiny_model(model_type).config
    shape = routing_shape(config)
    assert shape.layers == len(moe_gates(tiny_model(model_type)))
    position = [list(range(shape.top_k))] * shape.layers
    good = [position] * 18  # 16 prompt + 3 output tokens - 1
    assert refusal(_trajectory_with(good), config.vocab_size, routing=shape) is None

    def refused(routes):
        return refusal(_trajectory_with(routes), config.vocab_size, routing=shape) or ""

    out_of_range = [[[*layer[:-1], shape.experts] for layer in position], *good[1:]]
    assert f"not all within the model's {shape.experts} experts" in refused(out_of_range)
    assert "not all within" in refused([[[-1, *layer[1:]] for layer in position], *good[1:]])
    assert "MoE layers" in refused([[*position, position[0]], *good[1:]])
    assert "picks 1 experts" in refused([[layer[:1] for layer in position], *good[1:]])
    assert "names an expert twice" in refused([[[0] * shape.top_k for _ in position], *good[1:]])
    assert "no MoE layer" in (refusal(_trajectory_with(good), config.vocab_size, routing=DENSE) or "")
    # the old call (`num_experts` from the config) still refuses an id out of range, where the config
    # has a `num_experts` at all (DeepSeek-V3's is `n_routed_experts`: the routing shape covers it)
    num_experts = getattr(config, "num_experts", None)
    if num_experts is not None:
        assert "outside the model's" in (refusal(_trajectory_with(out_of_range), config.vocab_size, num_experts) or "")


def test_routing_shape_counts_only_the_sparse_layers():
    deepseek = tiny_model("deepseek_v3").config
    assert routing_shape(deepseek).layers == deepseek.num_hidden_layers - deepseek.first_k_dense_replace
    qwen = tiny_model("qwen3_moe", num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3])
    assert routing_shape(qwen.config).layers == len(moe_gates(qwen)) == 1  # layer 1 only
    assert json.loads(qwen.config.to_json_string())["model_type"] == "qwen3_moe"


async def test_a_dense_model_with_tied_embeddings_is_served_and_an_incomplete_one_refused(tmp_path):
    """Small dense checkpoints (Qwen3 up to 4B) tie lm_head to the embedding: stored once, loaded once."""
    from workers.sampler.engines.weights import CheckpointLayoutError

    model = _scrambled(DENSE_TYPE, seed=5)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    served = {n: cast_bf16(t) for n, t in disk_layout(model.state_dict(), tie_word_embeddings=True)}
    assert "lm_head.weight" not in served
    write_checkpoint(tmp_path / "v0", served, {**model.config.to_dict(), "dtype": "bfloat16"})
    engine = ReferenceEngine()
    await engine.start()
    await engine.load_weights(tmp_path / "v0", 0)
    assert engine.model.lm_head.weight.data_ptr() == engine.model.model.embed_tokens.weight.data_ptr()
    assert torch.equal(engine.model.lm_head.weight, served["model.embed_tokens.weight"])
    [sample] = await engine.generate(GenerateRequest([1, 2, 3], 1, SamplingParams(max_new_tokens=3), seed=1))
    assert len(sample.output_token_ids) == 3 and sample.routed_experts is None

    del served["model.norm.weight"]
    write_checkpoint(tmp_path / "v1", served, {**model.config.to_dict(), "dtype": "bfloat16"})
    with pytest.raises(CheckpointLayoutError, match=r"missing \['model.norm.weight'\]"):
        await ReferenceEngine().load_weights(tmp_path / "v1", 0)

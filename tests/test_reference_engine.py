"""The reference engine returns exactly what it sampled from, in its view's numerics."""

import asyncio
import inspect
import threading

import msgspec
import pytest
import torch

from pipeline.keyframe import write_checkpoint
from pipeline.off_policy import processed_logprobs
from pipeline.sampling import process_logits
from pipeline.views import get_view
from schemas import SamplingParams
from tests.tiny_models import adam_like_step, tiny_moe
from workers.sampler.engines.base import GenerateRequest
from workers.sampler.engines.reference import ReferenceEngine, UnsupportedModelForward, cache_keyword
from workers.sampler.engines.weights import model_state_dict

SAMPLING = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_new_tokens=12, logprobs_top_k=8)
PROMPT = [1, 5, 9, 17, 33, 2]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    model = tiny_moe(seed=3)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["lm_head.weight"] *= 30  # a peaked next-token distribution, like a trained model's, not a flat one
    root = tmp_path_factory.mktemp("views")
    paths = {}
    for version in (0, 1):
        if version:
            adam_like_step(state, 2e-2, torch.Generator().manual_seed(0))  # a visibly different version
        for name in ("bf16", "fp8_e4m3"):
            view = get_view(name)
            path = root / f"{name}-v{version}"
            write_checkpoint(path, view.compute(state), {**model.config.to_dict(), **view.config_overrides()})
            paths[name, version] = path
    return paths


async def _engine(path, dtype=torch.bfloat16) -> ReferenceEngine:
    engine = ReferenceEngine(dtype=dtype)
    await engine.start()
    await engine.load_weights(path, 0)
    return engine


def _teacher_forced(engine: ReferenceEngine, sample, sampling: SamplingParams = SAMPLING):
    """The processed distribution recomputed in one full pass, the trainer's mask replay of the
    sampler's recorded kept set on the same logits, and the routing."""
    tokens = torch.tensor([sample.prompt_token_ids + sample.output_token_ids])
    routing = []
    hooks = [
        m.register_forward_hook(lambda _m, _i, out: routing.append(out[2]))
        for n, m in engine.model.named_modules()
        if n.endswith("mlp.gate")
    ]
    with torch.no_grad():
        logits = engine.model(input_ids=tokens).logits[0].float()
    for hook in hooks:
        hook.remove()
    start = len(sample.prompt_token_ids) - 1
    logits = logits[start : start + len(sample.output_token_ids)]
    processed = process_logits(logits, sampling.temperature, sampling.top_k, sampling.top_p)
    out = torch.tensor(sample.output_token_ids)
    replayed = None
    if sample.kept_ids is not None:
        kept = torch.zeros_like(logits, dtype=torch.bool)
        for t, ids in enumerate(sample.kept_ids):
            kept[t, ids] = True  # as workers/trainer/update.py builds it from top_p_kept_ids
        replayed = processed_logprobs(logits, sampling.temperature, kept).gather(1, out[:, None]).squeeze(1)
    return processed, processed.logprobs.gather(1, out[:, None]).squeeze(1), replayed, torch.stack(routing, dim=1)


# In float32 compute the incremental (KV-cache) decode and a full teacher-forced pass agree to float
# rounding, so everything must match exactly; in bf16 compute the two paths round differently (the
# very sampler/trainer mismatch the trainer corrects for), so logprobs agree to bf16 precision and a
# recomputed kept set can differ at its edge. What must hold in every dtype: the sampled token is in
# the recorded kept set, so the trainer's mask replay gives it a finite logprob close to the sampler's.
# top_p 0.1 keeps one or two tokens, mostly exact bf16 ties at the top.
@pytest.mark.parametrize("top_p", [0.9, 0.1])
@pytest.mark.parametrize(
    ("view", "dtype", "atol"),
    [
        ("bf16", torch.float32, 1e-4),
        ("fp8_e4m3", torch.float32, 1e-4),
        ("bf16", torch.bfloat16, 0.1),
        ("fp8_e4m3", torch.bfloat16, 0.1),
    ],
)
async def test_logprobs_equal_teacher_forced_recomputation(checkpoints, view, dtype, atol, top_p):
    sampling = msgspec.structs.replace(SAMPLING, top_p=top_p)
    engine = await _engine(checkpoints[view, 0], dtype)
    samples = await engine.generate(GenerateRequest(PROMPT, 3, sampling, seed=11))
    exact = dtype == torch.float32
    for sample in samples:
        processed, recomputed, replayed, routing = _teacher_forced(engine, sample, sampling)
        assert all(token in kept for token, kept in zip(sample.output_token_ids, sample.kept_ids, strict=True))
        replay_diff = (torch.tensor(sample.logprobs) - replayed).abs()
        if exact:
            assert (torch.tensor(sample.logprobs) - recomputed).abs().max() < atol, (sample.logprobs, recomputed)
            assert replay_diff.max() < atol, (sample.logprobs, replayed)
        else:  # a routing flip can move one token's logprob more; on average they agree to bf16 precision
            assert replay_diff.mean() < atol / 2 and replay_diff.max() < 5 * atol, (sample.logprobs, replayed)
        agree = [
            set(sample.kept_ids[t]) == set(torch.nonzero(processed.kept[t]).flatten().tolist())
            for t in range(len(sample.output_token_ids))
        ]
        assert all(agree) if exact else sum(agree) >= len(agree) * 0.75
        assert all(len(ids) <= sampling.logprobs_top_k for ids in sample.top_ids)
        assert all(sample.top_logprobs[t][0] >= sample.logprobs[t] - 1e-6 for t in range(len(sample.logprobs)))
        recorded = torch.tensor(sample.routed_experts)
        assert recorded.shape == routing[: len(recorded)].shape
        same_route = (recorded.sort(-1).values == routing[: len(recorded)].sort(-1).values).float().mean()
        assert same_route == 1.0 if exact else same_route > 0.9
        assert sample.version_spans[0].version == 0 and sample.version_spans[-1].end == len(sample.output_token_ids)


async def test_views_are_numerically_different_islands(checkpoints):
    bf16, fp8 = await _engine(checkpoints["bf16", 0]), await _engine(checkpoints["fp8_e4m3", 0])
    sample = (await bf16.generate(GenerateRequest(PROMPT, 1, SAMPLING, seed=5)))[0]
    _, on_bf16, _, _ = _teacher_forced(bf16, sample)
    _, on_fp8, _, _ = _teacher_forced(fp8, sample)
    assert not torch.allclose(on_bf16, on_fp8, atol=1e-3)
    assert (on_bf16 - on_fp8).abs().max() < 1.0  # same policy, different numerics


async def test_seeds_reproduce_samples(checkpoints):
    engine = await _engine(checkpoints["bf16", 0])
    a = await engine.generate(GenerateRequest(PROMPT, 2, SAMPLING, seed=3))
    b = await engine.generate(GenerateRequest(PROMPT, 2, SAMPLING, seed=3))
    assert [s.output_token_ids for s in a] == [s.output_token_ids for s in b]
    assert a[0].output_token_ids != a[1].output_token_ids


async def test_weights_committed_mid_generation_open_a_new_span(checkpoints):
    engine = await _engine(checkpoints["bf16", 0])
    v1 = model_state_dict(checkpoints["bf16", 1])
    long = SamplingParams(temperature=1.0, max_new_tokens=40)
    gate = threading.Event()
    original = engine._step
    calls = []

    def step_then_hold(*args):
        calls.append(1)
        if len(calls) == 2:  # the first decode step, right after the prefill
            engine._resumed.clear()  # what pause() does
            gate.set()
        return original(*args)

    engine._step = step_then_hold
    task = asyncio.create_task(engine.generate(GenerateRequest(PROMPT, 2, long, seed=1)))
    await asyncio.to_thread(gate.wait)
    engine.stage_for_next_step(v1, 1)  # staged while paused, committed when the step proceeds
    await engine.resume()
    samples = await task
    for sample in samples:
        spans = [(s.version, s.start, s.end) for s in sample.version_spans]
        assert spans == [(0, 0, 1), (1, 1, 40)]
    assert engine.weight_version() == 1


@pytest.mark.parametrize("view", ["bf16", "fp8_e4m3"])
async def test_loading_only_changed_tensors_equals_a_full_load(checkpoints, view):
    from pipeline.bits import checksum, to_bits
    from workers.sampler.engines.weights import read_served_tensors

    old, new = read_served_tensors(checkpoints[view, 0]), read_served_tensors(checkpoints[view, 1])
    changed = sorted(n for n in new if checksum(to_bits(new[n])) != checksum(to_bits(old[n])))
    some = [n for n in changed if ".experts.1." in n or "q_proj" in n]
    assert some
    partial = await _engine(checkpoints[view, 0])
    await partial.load_weights(checkpoints[view, 1], 1, changed=changed)
    full = await _engine(checkpoints[view, 1])
    for name, tensor in full.model.state_dict().items():
        assert torch.equal(tensor, partial.model.state_dict()[name]), name
    untouched = await _engine(checkpoints[view, 0])
    reference = {k: v.clone() for k, v in untouched.model.state_dict().items()}
    await untouched.load_weights(checkpoints[view, 1], 1, changed=[])
    assert untouched.weight_version() == 1
    assert all(torch.equal(v, untouched.model.state_dict()[k]) for k, v in reference.items())


async def test_a_forward_that_ignores_the_kv_cache_is_refused_not_decoded_without_context(checkpoints):
    # what passing the cache under a name the installed transformers does not know did (5.17 took
    # `cache=` into **kwargs): every decode step would see one token and no context
    engine = await _engine(checkpoints["bf16", 0])
    assert cache_keyword(engine.model) in inspect.signature(engine.model.forward).parameters
    engine._cache_keyword = "kv_cache_under_an_unknown_name"
    with pytest.raises(UnsupportedModelForward, match="KV cache passed in was not filled"):
        await engine.generate(GenerateRequest(PROMPT, 1, SAMPLING, seed=1))


def test_experts_that_are_not_numbered_from_zero_are_refused_with_a_hint():
    from workers.sampler.engines.weights import CheckpointLayoutError, fuse_experts

    w = torch.zeros(2, 2)
    tensors = {f"model.layers.0.mlp.experts.{e}.{p}.weight": w for e in (0, 2) for p in ("gate_proj", "up_proj")}
    tensors |= {f"model.layers.0.mlp.experts.{e}.down_proj.weight": w for e in (0, 2)}
    with pytest.raises(CheckpointLayoutError, match=r"experts \[0, 2\]") as refused:
        fuse_experts(tensors)
    assert refused.value.hint


def test_an_expert_of_a_shape_that_would_broadcast_is_refused_not_fused():
    from workers.sampler.engines.weights import CheckpointLayoutError, fuse_experts

    tensors = {
        f"model.layers.0.mlp.experts.{e}.{p}.weight": torch.ones(4, 3) for e in (0, 1) for p in ("gate_proj", "up_proj")
    }
    tensors |= {f"model.layers.0.mlp.experts.{e}.down_proj.weight": torch.ones(3, 4) for e in (0, 1)}
    fused = fuse_experts(tensors)
    assert fused["model.layers.0.mlp.experts.gate_up_proj"].shape == (2, 8, 3)
    tensors["model.layers.0.mlp.experts.1.up_proj.weight"] = torch.ones(1, 3)  # copy_ would broadcast it
    with pytest.raises(CheckpointLayoutError, match="shapes differ"):
        fuse_experts(tensors)


@pytest.mark.parametrize(
    ("stored", "value", "compute", "refused"),
    [
        (torch.bfloat16, float("inf"), torch.float32, True),  # widening: checked on the stored bits
        (torch.bfloat16, float("nan"), torch.float64, True),
        (torch.float32, 3.4e38, torch.bfloat16, True),  # finite when stored, inf once narrowed
        (torch.float32, 70000.0, torch.float16, True),
        (torch.float16, 65504.0, torch.bfloat16, False),  # finite either way: served, exactly
    ],
)
def test_a_value_that_is_not_finite_as_served_is_refused_whichever_side_of_the_cast(stored, value, compute, refused):
    from workers.sampler.engines.weights import UnservableWeights, to_compute_dtype

    tensors = {"model.norm.weight": torch.tensor([1.0, value, -2.0]).to(stored)}
    assert refused == (not torch.isfinite(tensors["model.norm.weight"].to(compute)).all())
    if refused:
        with pytest.raises(UnservableWeights, match=r"model\.norm\.weight holds a non-finite value"):
            to_compute_dtype(tensors, compute)
    else:
        served = to_compute_dtype(tensors, compute)["model.norm.weight"]
        assert torch.equal(served, tensors["model.norm.weight"].to(compute))

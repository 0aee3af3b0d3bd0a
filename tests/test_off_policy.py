"""The correction formulas of OFF_POLICY.md, checked against closed forms and each other."""

import pytest
import torch

from pipeline.off_policy import LossConfig, full_vocab_centering_loss, grpo_advantages, policy_loss
from pipeline.routing_replay import moe_gates, replay_routing
from tests.tiny_models import tiny_moe

torch.manual_seed(0)
B, T, V = 3, 5, 11


def _setup(seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g, requires_grad=True)
    targets = torch.randint(0, V, (B, T), generator=g)
    adv = torch.randn(B, generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, -1] = False
    return logits, targets, adv, mask


def _top(mu_logp_all: torch.Tensor, k: int):
    values, ids = torch.topk(mu_logp_all, k, dim=-1)
    return ids, values, torch.isfinite(values)


PLAIN = LossConfig(importance="none", score_centering=False, mask_replay=False)


def test_score_centering_logit_gradient_is_minus_a_times_onehot_minus_mu():
    logits, targets, adv, _ = _setup()
    mu = torch.softmax(torch.randn(B, T, V), dim=-1)
    loss = full_vocab_centering_loss(logits, targets, adv, mu)
    (grad,) = torch.autograd.grad(loss, logits)
    onehot = torch.nn.functional.one_hot(targets, V).float()
    assert torch.allclose(grad, -adv[:, None, None] * (onehot - mu), atol=1e-6)


def test_top_k_centering_equals_full_vocabulary_when_k_covers_the_support():
    logits, targets, adv, _ = _setup(1)
    mask = torch.ones(B, T, dtype=torch.bool)
    mu_logp = torch.log_softmax(torch.randn(B, T, V), dim=-1)
    ids, values, valid = _top(mu_logp, V)
    cfg = LossConfig(importance="none", score_centering=True, mask_replay=False)
    ours = (
        policy_loss(
            logits,
            targets,
            adv,
            mask,
            mu_logp.gather(-1, targets[..., None]).squeeze(-1),
            cfg,
            top_ids=ids,
            top_logp=values,
            top_valid=valid,
        ).loss
        * mask.sum()
    )
    reference = full_vocab_centering_loss(logits, targets, adv, mu_logp.exp())
    g1 = torch.autograd.grad(ours, logits, retain_graph=True)[0]
    g2 = torch.autograd.grad(reference, logits)[0]
    assert torch.allclose(ours, reference, atol=1e-5) and torch.allclose(g1, g2, atol=1e-6)


@pytest.mark.parametrize(
    "cfg",
    [
        LossConfig(importance="tis", score_centering=True, mask_replay=False),
        LossConfig(importance="mis", score_centering=True, mask_replay=False),
        LossConfig(importance="mis", importance_level="sequence", score_centering=False, mask_replay=False),
        LossConfig(
            importance="tis",
            importance_level="sequence",
            geometric_rejection=True,
            score_centering=True,
            mask_replay=False,
        ),
        LossConfig(importance="mis", surrogate="ppo", score_centering=True, mask_replay=False),
    ],
)
def test_with_mu_equal_pi_every_correction_reduces_to_plain_pg(cfg):
    logits, targets, adv, mask = _setup(2)
    pi_logp = torch.log_softmax(logits.detach(), dim=-1)
    ids, values, valid = _top(pi_logp, 4)
    sampled = pi_logp.gather(-1, targets[..., None]).squeeze(-1)
    ours = policy_loss(logits, targets, adv, mask, sampled, cfg, top_ids=ids, top_logp=values, top_valid=valid)
    plain = policy_loss(logits, targets, adv, mask, sampled, PLAIN)
    g1 = torch.autograd.grad(ours.loss, logits)[0]
    g2 = torch.autograd.grad(plain.loss, logits)[0]
    assert torch.allclose(g1, g2, atol=1e-5)


def test_mis_masks_exactly_the_out_of_range_tokens():
    logits, targets, adv, mask = _setup(3)
    pi = torch.log_softmax(logits.detach(), dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    log_rho = torch.tensor([0.0, -1.0, 2.0, 0.3, -0.5]).repeat(B, 1)  # rho = 1, .37, 7.4, 1.35, .61
    out = policy_loss(
        logits, targets, adv, mask, pi - log_rho, LossConfig(importance="mis", score_centering=False, mask_replay=False)
    )
    expected_low = (log_rho.exp() < 0.5) & mask
    expected_high = (log_rho.exp() > 5.0) & mask
    assert torch.equal(out.masked_low, expected_low) and torch.equal(out.masked_high, expected_high)
    assert torch.all(out.weight[expected_low | expected_high] == 0)
    kept = mask & ~expected_low & ~expected_high
    assert torch.allclose(out.weight[kept], log_rho.exp()[kept], atol=1e-5)
    # masked tokens leave the numerator only: the denominator is every loss token
    manual = (-adv[:, None] * out.weight * out.logp)[mask].sum() / mask.sum()
    assert torch.allclose(out.loss, manual, atol=1e-6)


def test_mask_replay_gives_the_samplers_renormalized_logprob():
    logits, targets, adv, mask = _setup(4)
    kept = torch.rand(B, T, V) < 0.5
    kept.scatter_(-1, targets[..., None], True)
    temperature = 0.7
    mu = torch.log_softmax((logits.detach() / temperature).masked_fill(~kept, float("-inf")), dim=-1)
    sampled = mu.gather(-1, targets[..., None]).squeeze(-1)
    out = policy_loss(
        logits,
        targets,
        adv,
        mask,
        sampled,
        LossConfig(importance="mis", score_centering=False),
        temperature=temperature,
        kept=kept,
    )
    assert torch.allclose(out.logp[mask], sampled[mask], atol=1e-6)
    assert torch.allclose(out.rho[mask], torch.ones_like(out.rho[mask]), atol=1e-5)


def test_grpo_advantages():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    adv = grpo_advantages(rewards)
    assert torch.allclose(adv[0], torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-4)
    assert torch.all(adv[1] == 0)
    assert torch.allclose(grpo_advantages(rewards, normalize_std=False)[0], torch.tensor([0.5, -0.5, -0.5, 0.5]))


def test_routing_replay_selects_the_given_experts():
    model = tiny_moe(seed=1)
    tokens = torch.tensor([[1, 2, 3, 4, 5, 6]])
    gates = moe_gates(model)
    k = model.config.num_experts_per_tok
    forced = torch.zeros(1, 6, len(gates), k, dtype=torch.long)
    forced[..., 0], forced[..., 1] = 2, 3
    valid = torch.ones(1, 6, dtype=torch.bool)
    valid[0, -1] = False  # the last position keeps the model's own choice

    def capture():
        seen = []
        handles = [g.register_forward_hook(lambda _m, _i, out: seen.append(out)) for g in gates]
        with torch.no_grad():
            logits = model(input_ids=tokens).logits
        for h in handles:
            h.remove()
        return seen, logits

    own, own_logits = capture()
    with replay_routing(model, forced, valid):
        replayed, replayed_logits = capture()  # these hooks run after the replay hook: they see its output
    for own_out, out in zip(own, replayed, strict=True):
        router_logits, weights, indices = out
        assert torch.equal(indices[:5], torch.tensor([[2, 3]] * 5))
        assert torch.equal(indices[5], own_out[2][5])
        expected = torch.softmax(router_logits.float(), -1).gather(-1, indices)
        if getattr(gates[0], "norm_topk_prob", False):
            expected = expected / expected.sum(-1, keepdim=True)
        assert torch.allclose(weights.float(), expected, atol=1e-6)
    assert not torch.allclose(own_logits, replayed_logits)

"""The correction formulas of OFF_POLICY.md, checked against closed forms and each other."""

import pytest
import torch

from pipeline.off_policy import LossSection, full_vocab_centering_loss, grpo_advantages, policy_loss
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


PLAIN = LossSection(importance="none", score_centering=False, mask_replay=False)


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
    cfg = LossSection(importance="none", score_centering=True, mask_replay=False)
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
        LossSection(importance="tis", score_centering=True, mask_replay=False),
        LossSection(importance="mis", score_centering=True, mask_replay=False),
        LossSection(importance="mis", importance_level="sequence", score_centering=False, mask_replay=False),
        LossSection(
            importance="tis",
            importance_level="sequence",
            geometric_rejection=True,
            score_centering=True,
            mask_replay=False,
        ),
        LossSection(importance="mis", surrogate="ppo", score_centering=True, mask_replay=False),
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
        logits,
        targets,
        adv,
        mask,
        pi - log_rho,
        LossSection(importance="mis", score_centering=False, mask_replay=False),
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
        LossSection(importance="mis", score_centering=False),
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


# ---------------------------------------------------------------- the registry of corrections


def test_correction_specs_map_through_the_registry():
    from pipeline.off_policy import CORRECTIONS, apply_spec, correction_spec, loss_fields

    assert loss_fields("sc+mis+mask") == {
        "score_centering": True,
        "importance": "mis",
        "mask_replay": True,
        "geometric_rejection": False,
        "importance_level": "token",
        "surrogate": "pg",
    }
    assert loss_fields("none") == loss_fields("") == {c.field: c.off for c in CORRECTIONS.values()}
    assert loss_fields("tis,seq,ppo")["importance_level"] == "sequence"
    assert correction_spec(LossSection()) == "sc+mis+mask"  # the trainer's default loss
    for spec in ("none", "sc", "mis+seq", "sc+tis+mask+geo+ppo", "mis+mask"):
        assert correction_spec(apply_spec(LossSection(), spec)) == spec
    with pytest.raises(ValueError, match=r"unknown correction 'magic': combine sc, mis, tis, mask, geo, seq, ppo"):
        loss_fields("sc+magic")
    with pytest.raises(ValueError, match="'tis' and 'mis' both set `importance`"):
        loss_fields("tis+mis")
    with pytest.raises(ValueError, match="'sequence' needs importance 'tis' or 'mis'"):
        apply_spec(LossSection(), "seq")  # a sequence level without a weight would change nothing


def test_bad_loss_settings_fail_naming_the_field():
    from pydantic import ValidationError

    from pipeline.config import validation_lines

    for bad, field in (
        ({"importance_level": "Token"}, "importance_level"),
        ({"importance": "MIS"}, "importance"),
        ({"mis_low": 5.0, "mis_high": 0.5}, "mis_high: must be above mis_low (5.0)"),
        ({"geometric_low": 3.0}, "geometric_high"),
        ({"tis_cap": 0}, "tis_cap"),
        ({"ppo_clip": 1.5}, "ppo_clip"),
    ):
        with pytest.raises(ValidationError) as caught:
            LossSection(**bad)
        assert field in "\n".join(validation_lines(caught.value)), bad


def _zero_term_hook():
    """A correction module's hook class, as a new correction file would define it."""
    from pipeline.off_policy.hooks import ScoreTerm

    class ZeroTerm(ScoreTerm):
        calls = 0

        def per_token(self, logp_all, cfg, top_ids, top_logp, top_valid, token_weight):
            ZeroTerm.calls += 1
            return logp_all.sum(-1) * 0.0

    return ZeroTerm


ZeroTerm = _zero_term_hook()


def test_a_new_correction_is_one_hook_class_and_one_registry_entry(monkeypatch):
    from pipeline.off_policy import CORRECTIONS, Correction, loss_fields
    from pipeline.off_policy.loss import loss_plan

    entry = Correction("lnorm", "length normalization", "length_normalization", True, False, f"{__name__}:ZeroTerm")
    monkeypatch.setitem(CORRECTIONS, "lnorm", entry)
    loss_plan.cache_clear()
    try:
        cfg = LossSection(**loss_fields("lnorm"))
        assert cfg.length_normalization and not cfg.score_centering
        logits, targets, adv, mask = _setup(5)
        sampled = torch.log_softmax(logits.detach(), -1).gather(-1, targets[..., None]).squeeze(-1)
        before = ZeroTerm.calls
        plain = policy_loss(logits, targets, adv, mask, sampled, cfg.model_copy(update={"length_normalization": False}))
        out = policy_loss(logits, targets, adv, mask, sampled, cfg)
        assert ZeroTerm.calls == before + 1 and torch.isfinite(out.loss) and not torch.equal(out.loss, plain.loss)
    finally:
        loss_plan.cache_clear()


def test_the_package_imports_without_torch():
    import subprocess
    import sys

    code = (
        "import sys, pipeline.off_policy as o, workers.trainer.settings; "
        "o.loss_fields('sc+mis+mask'); assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)

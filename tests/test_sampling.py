"""The sampler side: the processed distribution's kept set is a function of the logits' values, and
the sampled token always lies in the set the trainer replays."""

import pytest
import torch

from pipeline.off_policy import processed_logprobs
from pipeline.sampling import draw, process_logits


def _kept(logits: list[float], *, top_k: int = 0, top_p: float = 1.0) -> list[int]:
    processed = process_logits(torch.tensor(logits), 1.0, top_k, top_p)
    return torch.nonzero(processed.kept).flatten().tolist()


def _bf16_rows(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Peaked logits rounded through bf16, as a bf16 model computes them: many exact ties."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=generator) * 8).bfloat16()


def test_tokens_tied_at_the_top_p_cut_are_kept_together():
    # three equal tokens of ~1/3 each: the second one crosses 0.5, so its tie (the third) stays too
    assert _kept([3.0, 3.0, 3.0, -9.0, -9.0], top_p=0.5) == [0, 1, 2]
    assert _kept([-9.0, 3.0, -9.0, 3.0, 3.0], top_p=0.5) == [1, 3, 4]


def test_tokens_tied_at_the_top_k_cut_are_kept_together():
    assert _kept([5.0, 4.0, 1.0, 4.0], top_k=2) == [0, 1, 3]
    assert _kept([5.0, 4.0, 1.0, 3.0], top_k=2) == [0, 1]


@pytest.mark.parametrize(("top_k", "top_p"), [(0, 0.1), (0, 0.5), (0, 0.9), (20, 0.9), (5, 1.0)])
def test_the_kept_set_depends_on_values_not_on_token_ids(top_k, top_p):
    logits = _bf16_rows(64, 200, seed=top_k * 10 + int(top_p * 10))
    assert (logits[:, :, None] == logits[:, None, :]).sum() > logits.numel()  # the rows do tie
    kept = process_logits(logits, 0.8, top_k, top_p).kept
    permutation = torch.randperm(logits.shape[-1], generator=torch.Generator().manual_seed(1))
    relabeled = process_logits(logits[:, permutation], 0.8, top_k, top_p).kept
    assert torch.equal(relabeled, kept[:, permutation])


def test_the_token_that_crosses_top_p_is_kept():
    """The mass before a token is the running sum of the tokens above it; when it is below top_p
    by the least amount a float can be, the token is kept, and at top_p exactly it is not."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(300):
        logits = torch.randn(8, generator=generator) * 2
        ordered = torch.sort(torch.softmax(logits, dim=-1), descending=True).values
        running = torch.cumsum(ordered, dim=-1)
        for j in range(1, 7):
            just_above = float(torch.nextafter(running[j - 1], torch.tensor(1.0)))
            assert len(_kept(logits.tolist(), top_p=just_above)) == j + 1, (logits, j)
            assert len(_kept(logits.tolist(), top_p=float(running[j - 1]))) == j, (logits, j)


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(0.8, 0, 0.1), (1.0, 20, 0.9), (0.7, 0, 1.0), (0.0, 0, 1.0)]
)
def test_drawn_tokens_lie_in_the_set_the_trainer_replays(temperature, top_k, top_p):
    logits = _bf16_rows(32, 200, seed=7)
    processed = process_logits(logits, temperature, top_k, top_p)
    generator = torch.Generator().manual_seed(3)
    for row in range(logits.shape[0]):
        for _ in range(20):
            token, ids = draw(processed, row, generator)
            assert token in ids.tolist()
        recorded = processed.logprobs[row, ids]
        assert torch.all(recorded[:-1] >= recorded[1:])  # recorded by descending probability
        mask = torch.zeros(logits.shape[-1], dtype=torch.bool)
        mask[ids] = True  # what the trainer builds from top_p_kept_ids
        replayed = processed_logprobs(logits[row], temperature, mask)
        if temperature > 0:
            assert torch.equal(replayed[ids], processed.logprobs[row, ids])
        else:
            assert ids.tolist() == [int(logits[row].argmax())]  # greedy: the first of tied maxima
            assert float(replayed[token]) == 0.0

"""Two real gloo ranks (forked processes) against one process: FSDP2 updates, the canonical gradient
norm and the publish gather give the same bits as a single process computing the same slices.

No log and no store here: the ranks and the single process run `run_update` on the same batch and
compare every master weight, the metrics and what each rank gathers for publishing."""

from __future__ import annotations

import multiprocessing
import traceback

import pytest
import torch

from pipeline.publish_layout import PublishLayout
from tests.trainer_data import make_groups, write_initial_model
from workers.trainer.settings import TrainerSection

TIMING = ("update_s", "tokens_per_s")


def _batch(model_dir, groups: int):
    from pipeline.batching import GroupBatchItem

    return [GroupBatchItem(f"g{i}", t, r, [], []) for i, (t, r) in enumerate(make_groups(model_dir, "r", groups))]


def _section(model_dir, **extra) -> TrainerSection:
    return TrainerSection(model_dir=model_dir, groups_per_batch=4, max_grad_norm=0.05, **extra)


def _load(model_dir):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def _rank_main(rank: int, store_path: str, model_dir, batches, out_path: str, errors) -> None:
    import torch.distributed as dist

    from workers.trainer.distributed import RankContext, gather_owned, shard_model
    from workers.trainer.update import run_update

    try:
        torch.use_deterministic_algorithms(True)
        torch.set_num_threads(1)
        store = dist.FileStore(store_path, 2)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
        ctx = RankContext(rank=rank, world_size=2, publish_group=dist.new_group(backend="gloo"))
        model = shard_model(_load(model_dir), ctx)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        metrics = [
            run_update(model, optimizer, batch, _section(model_dir), v, frozenset(), ctx)
            for v, batch in enumerate(batches)
        ]
        state = model.state_dict()
        layout = PublishLayout.plan({n: tuple(t.shape) for n, t in state.items()}, max_shard_bytes=1 << 30, min_units=4)
        owner_of = {n: r for r in range(2) for n in layout.owned(r, 2)}
        owned = gather_owned(list(state.items()), owner_of, ctx)
        torch.save({"owned": owned, "metrics": metrics}, out_path)
        dist.destroy_process_group()
    except BaseException:
        errors.put(f"rank {rank}: {traceback.format_exc()}")
        raise


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_initial_model(tmp_path_factory.mktemp("initial"))


def test_two_ranks_train_and_gather_the_same_bits_as_one_process(model_dir, tmp_path):
    from workers.trainer.update import run_update

    batches = [_batch(model_dir, 4), _batch(model_dir, 4)[::-1]]
    context = multiprocessing.get_context("fork")
    errors = context.Queue()
    outs = [str(tmp_path / f"rank{r}.pt") for r in range(2)]
    ranks = [
        context.Process(target=_rank_main, args=(r, str(tmp_path / "store"), model_dir, batches, outs[r], errors))
        for r in range(2)
    ]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join()
    assert errors.empty(), errors.get()
    assert [p.exitcode for p in ranks] == [0, 0]

    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    model = _load(model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    single = [run_update(model, optimizer, b, _section(model_dir, micro_batches=2), v) for v, b in enumerate(batches)]
    results = [torch.load(o, weights_only=False) for o in outs]

    # Every parameter is gathered by exactly one rank, whole, and equals the single process's bits.
    expected = model.state_dict()
    owned = [set(r["owned"]) for r in results]
    assert owned[0].isdisjoint(owned[1]) and owned[0] | owned[1] == set(expected)
    assert owned[0] and owned[1]
    for r in results:
        for name, tensor in r["owned"].items():
            assert torch.equal(tensor, expected[name]), name
    # Clipping was active (max_grad_norm 0.05), so the canonical norm decided every step's scale.
    ranked = results[0]["metrics"]
    assert results[1]["metrics"] == [None, None]
    for one, two in zip(single, ranked, strict=True):
        assert one.overall["grad_norm"] > 0.05
        assert {k: v for k, v in one.overall.items() if k not in TIMING} == {
            k: v for k, v in two.overall.items() if k not in TIMING
        }
        assert one.per_island == two.per_island and one.per_group == two.per_group


def test_one_process_with_one_slice_differs_from_two_slices_only_in_the_last_bits(model_dir):
    """The slices are part of the computation (why `micro_batches` is a setting): one slice and two give
    the same update up to rounding, not bit for bit (so the test above could fail)."""
    from workers.trainer.update import run_update

    batch = _batch(model_dir, 4)
    weights = []
    for slices in (1, 2):
        torch.use_deterministic_algorithms(True)
        torch.set_num_threads(1)
        model = _load(model_dir)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        run_update(model, optimizer, batch, _section(model_dir, micro_batches=slices), 0)
        weights.append(model.state_dict())
    close = all(torch.allclose(weights[0][n], weights[1][n], atol=1e-5) for n in weights[0])
    exact = all(torch.equal(weights[0][n], weights[1][n]) for n in weights[0])
    assert close and not exact


def test_micro_batches_that_do_not_fit_the_ranks_are_refused():
    with pytest.raises(ValueError, match="multiple of ranks"):
        TrainerSection(ranks=2, micro_batches=3, groups_per_batch=4)
    with pytest.raises(ValueError, match="a slice holds whole groups"):
        TrainerSection(micro_batches=8, groups_per_batch=4)
    with pytest.raises(ValueError, match="a rank needs a group"):
        TrainerSection(ranks=4, groups_per_batch=2)


@pytest.mark.parametrize(
    ("recorded", "now", "refused"),
    [
        ((2, 2), (2, 1), None),  # two terms sum alike on one rank or two
        ((1, None), (1, 1), None),
        ((4, 2), (4, 2), None),
        ((4, 2), (4, 1), "summed its 4 slices' gradients on 2 rank(s); this trainer has 1 rank(s)"),
        ((4, None), (4, 2), "on 1 rank(s); this trainer has 2 rank(s)"),
        ((3, None), (2, 2), "computed in 3 slice(s); this trainer cuts batches into 2"),
        ((None, None), (2, 2), "computed in 1 slice(s)"),
    ],
)
def test_a_version_summed_in_another_order_is_refused_naming_slices_and_ranks(recorded, now, refused):
    """With three or more slices the order of the gradient sum depends on the number of ranks (2 ranks x
    4 slices: (s0+s2)+(s1+s3); one process: ((s0+s1)+s2)+s3): a re-derivation on another count would
    be refused only at its root hash, naming nothing. The lineage records both; the check names them."""
    from schemas.lineage import Lineage
    from workers.trainer.recovery import RecoveryMismatch, check_same_summation

    lineage = Lineage(version=7, groups=[], slices=recorded[0], ranks=recorded[1])
    if refused is None:
        check_same_summation(lineage, *now)
        return
    with pytest.raises(RecoveryMismatch) as failure:
        check_same_summation(lineage, *now)
    assert refused in failure.value.message and "version 7" in failure.value.message
    assert "trainer.ranks" in str(failure.value.hint) or "trainer.micro_batches" in str(failure.value.hint)


def test_lineage_of_one_process_is_byte_identical_to_one_written_before_the_ranks_field():
    from schemas.lineage import Lineage, encode_lineage

    assert b"ranks" not in encode_lineage(Lineage(version=1, groups=[], slices=2))
    assert b'"ranks":2' in encode_lineage(Lineage(version=1, groups=[], slices=2, ranks=2))

"""Attacks on the sharded trainer (issue 19): two torchrun ranks (gloo, CPU) on a real stack, killed,
stopped, starved, misconfigured, their checkpoints tampered with. Every case must end retried, refused
or in a loud exit, with nothing lost, nothing counted twice and no wrong bit served; a job alive and
doing nothing is the worst outcome.

Two harnesses: the real `sprawl trainer` (`python -m workers.cli trainer`, torchrun under it) for the
job's behaviour, and forked gloo ranks running `RankTraining`, `run_update` and `restore_any_checkpoint`
against the real SeaweedFS for the checkpoint and collective attacks (seconds instead of a job's start-up
per case). A kill at an exact instruction (between a checkpoint's files and its event) is a SIGKILL the
rank sends itself right after the store stored a chosen blob (`tests/rank_fault_hooks/sitecustomize.py`).
Every process a test starts is killed on the way out: a job's processes are found by their environment,
since torchrun starts each rank in a session of its own.

Holes this found, each first committed as an xfail(strict) test naming it and since fixed, are noted in
the test that covers them ("Was: ...")."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from pipeline.blobstore import S3BlobStore
from pipeline.eventlog import EventLog
from pipeline.replay import replay
from pipeline.subjects import trainer_checkpoint_subject, trainer_lease_subject
from pipeline.topology import policy_filter
from pipeline.version_log import chain_head, fetch_version
from tests.chain_helpers import corrupt_object, signed_trust
from tests.servers import HANG_GUARD_S, connection_env, new_run_id
from tests.tiny_models import tiny_moe
from tests.trainer_data import make_groups, publish_groups, write_initial_model

pytestmark = pytest.mark.integration

VERSIONS = 5
CMD = [sys.executable, "-m", "workers.cli", "trainer"]
HOOKS = Path(__file__).parent / "rank_fault_hooks"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_initial_model(tmp_path_factory.mktemp("initial"))


@pytest.fixture(scope="module")
def six_expert_model_dir(tmp_path_factory):
    """The tiny MoE with 6 experts: every parameter's dim 0 gives each of 2 or 3 ranks at least one row
    (with 4 experts a third rank holds no expert row: see the empty-shard test below)."""
    directory = tmp_path_factory.mktemp("six-experts")
    tiny_moe(seed=11, num_experts=6).save_pretrained(directory)
    return directory


# ---------------------------------------------------------------- a job and its processes


def _env(
    settings, run_id, model_dir, *, kill_after_put: str | None = None, kill_after_append: str | None = None, **trainer
) -> dict:
    """The job's environment. `kill_after_put` / `kill_after_append`: "RANK:TEXT", a SIGKILL of that rank
    at that instruction of the first attempt (`tests/rank_fault_hooks/sitecustomize.py`)."""
    env = {
        **os.environ,
        "SPRAWL_RUN_ID": run_id,
        **connection_env(settings, "trainer", run_id),
        "SPRAWL_LOG_FORMAT": "json",
        "SPRAWL_TRAINER__MODEL_DIR": str(model_dir),
        "SPRAWL_TRAINER__GROUPS_PER_BATCH": "2",
        "SPRAWL_TRAINER__MICRO_BATCHES": "2",
        "SPRAWL_TRAINER__TRAINER_ID": "t-ranks",
        "SPRAWL_TRAINER__CHECKPOINT_EVERY": "2",
        "SPRAWL_TRAINER__MAX_VERSIONS": str(VERSIONS),
        "SPRAWL_CHAIN__VIEWS": '["bf16", "fp8_e4m3"]',
        "SPRAWL_TRUST__SIGNING_KEY_FILE": str(signed_trust().signing_key_file),
    }
    for key, value in trainer.items():  # None: the setting left to its default
        name = f"SPRAWL_TRAINER__{key.upper()}"
        if value is None:
            env.pop(name, None)
        else:
            env[name] = str(value)
    hooks = {"SPRAWL_TEST_KILL_AFTER_PUT": kill_after_put, "SPRAWL_TEST_KILL_AFTER_APPEND": kill_after_append}
    if any(hooks.values()):
        env.update({k: v for k, v in hooks.items() if v})
        env["PYTHONPATH"] = os.pathsep.join([str(HOOKS), *filter(None, [env.get("PYTHONPATH")])])
    return env


@dataclass(frozen=True)
class JobProcess:
    pid: int
    rank: str | None
    """torchrun's RANK (None: the launcher or torchrun itself)."""
    attempt: str | None
    """torchrun's TORCHELASTIC_RESTART_COUNT."""


def _processes(run_id: str) -> list[JobProcess]:
    """Every live process of this run's job (launcher, torchrun, ranks), from their environment."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = dict(e.split(b"=", 1) for e in (proc / "environ").read_bytes().split(b"\0") if b"=" in e)
        except OSError:
            continue
        if environ.get(b"SPRAWL_RUN_ID") == run_id.encode():
            rank, attempt = environ.get(b"RANK"), environ.get(b"TORCHELASTIC_RESTART_COUNT")
            found.append(JobProcess(int(proc.name), rank and rank.decode(), attempt and attempt.decode()))
    return found


def _rank_pids(run_id: str, rank: int) -> list[int]:
    return [p.pid for p in _processes(run_id) if p.rank == str(rank)]


def _kill_all(run_id: str) -> None:
    for process in _processes(run_id):
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGCONT)  # a SIGSTOPped rank dies as well, but never hangs a wait
            os.kill(process.pid, signal.SIGKILL)


class Job:
    """A trainer job (`sprawl trainer`, or torchrun by hand) in a session of its own, output to a file."""

    def __init__(self, command: list[str], env: dict, run_id: str, log_file: Path):
        self.run_id = run_id
        self.log_file = log_file
        with open(log_file, "wb") as out:
            self.process = subprocess.Popen(
                command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        _kill_all(self.run_id)

    def wait(self) -> int:
        return self.process.wait(timeout=HANG_GUARD_S)

    @property
    def output(self) -> str:
        return self.log_file.read_text(errors="replace")

    def lines(self) -> list[dict]:
        """The JSON log lines of every process of the job."""
        out = []
        for line in self.output.splitlines():
            if line.startswith("{"):
                with contextlib.suppress(json.JSONDecodeError):
                    out.append(json.loads(line))
        return out

    def errors(self) -> str:
        return "\n".join(ln for ln in self.output.splitlines() if "error" in ln.lower())[-6000:]


async def _until(condition, what: str, job: Job | None = None):
    """Await `condition()` until truthy (returned); the job exiting first fails the test."""
    deadline = time.monotonic() + HANG_GUARD_S
    while not (result := await condition()):
        if job is not None:
            assert job.process.poll() is None, f"{what}: the job exited {job.process.returncode} first\n{job.errors()}"
        assert time.monotonic() < deadline, f"{what}: not within the hang guard ({HANG_GUARD_S:g}s)"
        await asyncio.sleep(0.05)
    return result


async def _new_run(event_log, settings, model_dir, groups: int) -> str:
    from infra.streams import apply

    run_id = new_run_id()
    await apply(event_log.js, settings.streams, run_id)
    if groups:
        await publish_groups(event_log, make_groups(model_dir, run_id, groups))
    return run_id


async def _version_published(event_log, run_id, version: int):
    return await fetch_version(event_log, run_id, version)


async def _served(event_log, run_id: str, versions: int) -> list[dict[str, str]]:
    """Per version, each view's root hash: what an island serves."""
    out = []
    for v in range(versions + 1):
        event = await fetch_version(event_log, run_id, v)
        assert event is not None, f"version {v} missing"
        out.append({view.view: view.root_hash for view in event.views})
    return out


async def _policy_versions(event_log, run_id: str) -> list[int]:
    """The version of every event on the run's policy subjects, in log order (a duplicate shows twice)."""
    return [r.event.version async for r in replay(event_log, "POLICY", policy_filter(run_id))]


async def _checkpoints(event_log, run_id: str) -> list:
    return [r.event async for r in replay(event_log, "TRAINER", trainer_checkpoint_subject(run_id))]


@pytest.fixture(scope="module")
def reference(stack_session, model_dir, tmp_path_factory) -> list[dict[str, str]]:
    """The chain one uninterrupted process publishes with the same data and the same two slices."""

    async def run() -> list[dict[str, str]]:
        event_log = await EventLog.connect(stack_session, worker="test")
        try:
            run_id = await _new_run(event_log, stack_session, model_dir, 2 * VERSIONS)
            env = _env(stack_session, run_id, model_dir)
            one = await asyncio.to_thread(
                subprocess.run, CMD, env=env, timeout=HANG_GUARD_S, capture_output=True, text=True
            )
            assert one.returncode == 0, one.stderr[-3000:]
            return await _served(event_log, run_id, VERSIONS)
        finally:
            await event_log.close()

    return asyncio.run(run())


# ---------------------------------------------------------------- two forked ranks, real S3


def _section(model_dir, **extra):
    from workers.trainer.settings import TrainerSection

    return TrainerSection(
        **{"model_dir": model_dir, "groups_per_batch": 2, "micro_batches": 2, "learning_rate": 1e-3, **extra}
    )


def _rank_state(training) -> dict[str, torch.Tensor]:
    """This rank's shards of the masters and of Adam's moments, as plain tensors."""
    from workers.trainer.distributed import local_tensor

    out = {}
    for name, p in training.model.named_parameters():
        out[name] = local_tensor(p).detach().clone()
        for key, value in training.optimizer.state.get(p, {}).items():
            out[f"{name}:{key}"] = local_tensor(value).detach().clone() if torch.is_tensor(value) else value
    return out


def _obey(training) -> None:
    """What `follow_leader` does with one command of rank 0 (kept to the one call under test)."""
    import torch.distributed as dist

    received = [None]
    dist.broadcast_object_list(received, src=0)
    getattr(training, received[0].kind)(*received[0].args)


def _checkpoint_rank(rank, world, store, settings, work, tmpdir, out) -> None:
    """One of `world` gloo ranks: `work` is ("save", batch) -> train one update and write a sharded
    checkpoint; ("restore", checkpoint) -> restore it. Writes {"outcome": ..., "state": ...} to `out`:
    the outcome, and the state this rank holds afterwards (None after an error)."""
    import torch.distributed as dist

    from pipeline.blobstore import open_blob_store
    from workers.trainer.checkpoint import restore_any_checkpoint
    from workers.trainer.distributed import RankContext
    from workers.trainer.ranks import RankTraining, checkpoint_manifest

    try:
        torch.use_deterministic_algorithms(True)
        torch.set_num_threads(1)
        tempfile.tempdir = str(tmpdir)  # where restore_sharded makes its temp folder: watched by the test
        timeout = datetime.timedelta(seconds=120)
        dist.init_process_group(
            "gloo", store=dist.FileStore(store, world), rank=rank, world_size=world, timeout=timeout
        )
        ctx = RankContext(rank=rank, world_size=world, publish_group=dist.new_group(backend="gloo", timeout=timeout))
        blobs = open_blob_store(settings.blobs)
        training = RankTraining(settings, ctx, blobs)
        kind, arg = work
        if kind == "save":
            if rank == 0:
                training.update(arg, 0, frozenset())
                files = training.save_sharded(settings.run_id, "t-faults", 1)
                manifest = checkpoint_manifest(files, version=1, step=1, used=set(), world_size=2)
                ref = blobs.put_bytes(manifest, f"runs/{settings.run_id}/trainer/ckpt-v00000001-t-faults/manifest.json")
                outcome = ("saved", ref.uri, ref.checksum, ref.bytes)
            else:
                _obey(training)  # update
                _obey(training)  # save_sharded
                outcome = ("saved",)
        else:
            if rank == 0:
                state = asyncio.run(restore_any_checkpoint(blobs, arg, training))
                outcome = ("restored", state.version, state.step)
            else:
                _obey(training)
                outcome = ("restored",)
        torch.save({"outcome": outcome, "state": _rank_state(training)}, out)
        dist.destroy_process_group()
    except BaseException as exc:
        from pipeline.errors import SprawlError

        sprawl = isinstance(exc, SprawlError)
        outcome = ("error", type(exc).__name__, str(exc) if sprawl else f"{type(exc).__name__}: {exc}", sprawl)
        torch.save({"outcome": outcome, "traceback": traceback.format_exc(), "state": None}, out)


def _ranks(tmp_path, settings, work, name: str, world: int = 2) -> list[dict]:
    """Run `_checkpoint_rank` on `world` forked ranks; what each wrote (its outcome and state), by rank."""
    from tests.servers import HANG_GUARD_S

    context = multiprocessing.get_context("fork")
    folder = tmp_path / name
    (folder / "tmp").mkdir(parents=True)
    outs = [folder / f"rank{r}.pt" for r in range(world)]
    ranks = [
        context.Process(
            target=_checkpoint_rank,
            args=(r, world, str(folder / "store"), settings, work, folder / "tmp", outs[r]),
        )
        for r in range(world)
    ]
    for p in ranks:
        p.start()
    try:
        for p in ranks:
            p.join(HANG_GUARD_S)
            assert p.exitcode is not None, f"{name}: a rank hung"
    finally:
        for p in ranks:
            if p.is_alive():
                p.kill()
    return [torch.load(o, weights_only=False) for o in outs]


def _trainer_settings(settings, model_dir, **section):
    from workers.trainer.settings import TrainerSettings

    return TrainerSettings(run_id=settings.run_id, blobs=settings.blobs, trainer=_section(model_dir, **section))


def _batch(model_dir, run_id):
    from pipeline.batching import GroupBatchItem

    return [GroupBatchItem(f"g{i}", t, r, [], []) for i, (t, r) in enumerate(make_groups(model_dir, run_id, 2))]


def _checkpoint_event(run_id, uri, sha256, size):
    from schemas import TrainerCheckpoint

    return TrainerCheckpoint(
        run_id=run_id, version=1, step=1, uri=uri, sha256=sha256, bytes=size, trajectory_position=1, reward_position=1
    )


# ---------------------------------------------------------------- 3. tampered sharded checkpoints

FORGED_NAMES = {
    "name_traversal": lambda folder: "../../escaped-by-traversal",
    "name_absolute": lambda folder: str(folder / "escaped-by-absolute-name"),
    "name_dotdot": lambda folder: "..",
}
"""A manifest naming its `.metadata` file so: where a name used as a path would write (relative names
resolve from the restore's temp folder, two levels under the case's folder)."""
OVERWRITTEN = ("distcp_overwritten", "metadata_overwritten")
CORRUPTED = (*OVERWRITTEN, "blob_missing")
FORGED = (*FORGED_NAMES, "file_left_out")


@dataclass
class Restore:
    ranks: list[dict]
    """What each rank wrote: its outcome, and the state it holds afterwards (None after an error)."""
    left_in_temp: list[str]
    """What the restore left in its temp root (its temp folders must be gone, whatever happened)."""
    escaped: list[str]
    """Files that exist where a forged name, used as a path, would have written."""


@pytest.fixture(scope="module")
def tampered(stack_session, model_dir, tmp_path_factory) -> dict[str, Restore]:
    """One sharded checkpoint written by two ranks (after one real update), restored by two fresh ranks
    as it is and under every tampering: its blobs overwritten in the bucket (the sha256 in their metadata
    kept, so only the manifest's digests can tell), a blob missing, and manifests forged (an event naming
    a manifest of the right digest: whoever can append the trainer's events) whose file names are paths,
    or which leave a rank's file out."""
    settings = stack_session.model_copy(update={"run_id": new_run_id()})
    trainer_settings = _trainer_settings(settings, model_dir)
    root = tmp_path_factory.mktemp("tampered")
    saved = _ranks(root, trainer_settings, ("save", _batch(model_dir, settings.run_id)), "save")
    assert [r["outcome"][0] for r in saved] == ["saved", "saved"], saved[0].get("traceback")
    _, uri, sha256, size = saved[0]["outcome"]
    blobs = S3BlobStore(settings.blobs)
    manifest = json.loads(blobs.get_bytes(uri, expected=sha256))
    files = {f["name"]: f for f in manifest["files"]}
    assert set(files) == {".metadata", "__0_0.distcp", "__1_0.distcp"}, files

    def forged(case: str, entries: list[dict]):
        body = json.dumps({**manifest, "files": entries}, sort_keys=True).encode()
        ref = blobs.put_bytes(body, f"runs/{settings.run_id}/trainer/forged-{case}/manifest.json")
        return _checkpoint_event(settings.run_id, ref.uri, ref.checksum, ref.bytes)

    # Three ranks need slices they can share (checked as a rank starts); restoring uses none of them.
    three_rank_settings = _trainer_settings(settings, model_dir, groups_per_batch=3, micro_batches=3)

    def restore(case: str, checkpoint, world: int = 2) -> Restore:
        ranks = _ranks(
            root, three_rank_settings if world == 3 else trainer_settings, ("restore", checkpoint), case, world
        )
        folder = root / case
        targets = [folder / "escaped-by-traversal", folder / "escaped-by-absolute-name"]
        return Restore(
            ranks,
            sorted(str(p.relative_to(folder / "tmp")) for p in (folder / "tmp").rglob("*")),
            [str(t) for t in targets if t.exists()],
        )

    intact = _checkpoint_event(settings.run_id, uri, sha256, size)
    results = {"intact": restore("intact", intact)}
    results["intact"].ranks.append(saved)  # the state each rank saved, for the comparison
    results["three_ranks"] = restore("three_ranks", intact, world=3)
    for case, name in FORGED_NAMES.items():
        entries = [{**f, "name": name(root / case)} if f["name"] == ".metadata" else f for f in files.values()]
        results[case] = restore(case, forged(case, entries))
    results["file_left_out"] = restore(
        "file_left_out", forged("file_left_out", [f for n, f in files.items() if n != "__1_0.distcp"])
    )
    never_written = {**files["__1_0.distcp"], "uri": blobs.uri(f"runs/{settings.run_id}/trainer/never-written")}
    results["blob_missing"] = restore(
        "blob_missing", forged("blob_missing", [files[".metadata"], files["__0_0.distcp"], never_written])
    )
    for case, name in zip(OVERWRITTEN, ("__1_0.distcp", ".metadata"), strict=True):
        corrupt_object(blobs, files[name]["uri"])  # the event and manifest intact, the blob not
        results[case] = restore(case, intact)
    return results


def test_an_intact_sharded_checkpoint_restores_every_rank_bit_for_bit(tampered):
    """The control for the tampering below: masters and Adam's moments come back exactly, on each rank."""
    intact = tampered["intact"]
    restored, saved = intact.ranks[:2], intact.ranks[2]
    assert [r["outcome"] for r in restored] == [("restored", 1, 1), ("restored",)], restored[0].get("traceback")
    for mine, before in zip(restored, saved, strict=True):
        assert set(mine["state"]) == set(before["state"]) and any(":exp_avg" in k for k in mine["state"])
        for key, value in before["state"].items():
            assert torch.equal(mine["state"][key], value) if torch.is_tensor(value) else mine["state"][key] == value
    assert intact.left_in_temp == []


def _whole(states: list[dict]) -> dict:
    """The whole tensors from every rank's dim-0 shards (FSDP2 cuts torch.chunk-wise, in rank order)."""
    out = {}
    for key, value in states[0].items():
        parts = [s[key] for s in states]
        out[key] = torch.cat(parts) if torch.is_tensor(value) and value.dim() else value
    return out


def test_a_two_rank_sharded_checkpoint_restores_on_three_ranks_bit_for_bit(tampered):
    """torch.distributed.checkpoint reshards: three ranks restore the masters and moments two wrote,
    exactly (the third rank holds no row of the experts: 4 rows are chunked 2, 2, 0). Whether the job can
    then re-derive later versions is another matter: see the slice-count test below."""
    three = tampered["three_ranks"]
    assert [r["outcome"] for r in three.ranks] == [("restored", 1, 1), ("restored",), ("restored",)], [
        r.get("traceback", "")[-1500:] for r in three.ranks
    ]
    restored, saved = (
        _whole([r["state"] for r in three.ranks]),
        _whole([r["state"] for r in tampered["intact"].ranks[2]]),
    )
    assert set(restored) == set(saved)
    for key, value in saved.items():
        assert torch.equal(restored[key], value) if torch.is_tensor(value) else restored[key] == value, key
    assert three.left_in_temp == []


@pytest.mark.parametrize("case", [*CORRUPTED, *FORGED])
def test_a_tampered_sharded_checkpoint_restores_nothing_and_writes_nothing_outside_its_temp_folder(tampered, case):
    """Every case fails on both ranks before any state is loaded (a digest: BlobIntegrityError or
    BlobNotFound on every rank; a forged manifest: refused by rank 0 before it tells the others, whose wait
    then fails on the closed connection), and the temp folders are removed."""
    result = tampered[case]
    assert [r["outcome"][0] for r in result.ranks] == ["error", "error"], [r["outcome"] for r in result.ranks]
    assert all(r["state"] is None for r in result.ranks)
    assert result.escaped == [], f"{case}: a manifest name wrote outside the restore's temp folder"
    assert result.left_in_temp == [], f"{case}: the restore left files behind"


EXPECTED_IN_ERROR = {
    "distcp_overwritten": "__1_0.distcp",
    "metadata_overwritten": ".metadata",
    "blob_missing": "never-written",
    "name_traversal": "../../escaped-by-traversal",
    "name_absolute": "escaped-by-absolute-name",
    "name_dotdot": "'..'",
    "file_left_out": "__1_0.distcp",
}


@pytest.mark.parametrize("case", [*CORRUPTED, *FORGED])
def test_a_tampered_sharded_checkpoint_is_refused_with_an_error_naming_what_is_wrong(tampered, case):
    """The refusal is a SprawlError (one `sprawl: error:` line with a hint, not a torch traceback) that
    names the blob or the manifest entry at fault. Was, for forged manifests: names cut to their last
    component (`../../x` and `/abs/x` downloaded as `x`, then a torch CheckpointException on a missing
    .metadata), `..` an `OSError: [Errno 16] Device or resource busy`, a missing rank's file a
    FileNotFoundError inside dcp.load; now the manifest is checked before any download."""
    outcome = tampered[case].ranks[0]["outcome"]
    assert outcome[0] == "error"
    _, kind, message, sprawl = outcome
    assert sprawl, f"{case}: {kind}: {message[-400:]}"
    assert EXPECTED_IN_ERROR[case] in message, message


# ---------------------------------------------------------------- 6. more ranks than some parameter has rows


def _three_rank_update(rank, store, model_dir, batch, out) -> None:
    """One of three gloo ranks: one update of the FSDP2-sharded tiny MoE in 3 slices, then the publish
    gather; writes what this rank gathered (or its error) to `out`."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from pipeline.publish_layout import PublishLayout
    from workers.trainer.distributed import RankContext, gather_owned, shard_model
    from workers.trainer.update import run_update

    try:
        torch.use_deterministic_algorithms(True)
        torch.set_num_threads(1)
        timeout = datetime.timedelta(seconds=120)
        dist.init_process_group("gloo", store=dist.FileStore(store, 3), rank=rank, world_size=3, timeout=timeout)
        ctx = RankContext(rank=rank, world_size=3, publish_group=dist.new_group(backend="gloo", timeout=timeout))
        torch.manual_seed(0)
        model = shard_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), ctx)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        run_update(
            model, optimizer, batch, _section(model_dir, groups_per_batch=3, micro_batches=3), 0, frozenset(), ctx
        )
        state = model.state_dict()
        layout = PublishLayout.plan({n: tuple(t.shape) for n, t in state.items()}, max_shard_bytes=1 << 30, min_units=4)
        owner_of = {n: r for r in range(3) for n in layout.owned(r, 3)}
        torch.save({"outcome": "trained", "owned": gather_owned(list(state.items()), owner_of, ctx)}, out)
        dist.destroy_process_group()
    except BaseException as exc:
        torch.save({"outcome": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}, out)


def test_three_ranks_train_a_model_with_fewer_rows_than_ranks_in_a_parameter(model_dir, tmp_path):
    """Three forked gloo ranks and one process, the same batch in the same 3 slices: each parameter is
    gathered whole by exactly one owner, equal to the single process's up to the last bits. Not bit for
    bit: a sum of three slices' gradients depends on its order (gloo's ring sums each chunk starting on
    another rank), where a sum of two does not; measured here, up to 4e-7 on steps of 1e-3. The tiny MoE's
    experts (4 rows) leave the third rank none. Was: `RuntimeError: cannot reshape tensor of 0 elements
    into shape [0, -1]` in distributed.gradient_norm on the empty shard (128 experts over 24 ranks too)."""
    from transformers import AutoModelForCausalLM

    from pipeline.batching import GroupBatchItem
    from workers.trainer.update import run_update

    batch = [GroupBatchItem(f"g{i}", t, r, [], []) for i, (t, r) in enumerate(make_groups(model_dir, "r3", 3))]
    context = multiprocessing.get_context("fork")
    outs = [tmp_path / f"rank{r}.pt" for r in range(3)]
    ranks = [
        context.Process(target=_three_rank_update, args=(r, str(tmp_path / "store"), model_dir, batch, outs[r]))
        for r in range(3)
    ]
    for p in ranks:
        p.start()
    try:
        for p in ranks:
            p.join(HANG_GUARD_S)
            assert p.exitcode is not None, "a rank hung"
    finally:
        for p in ranks:
            if p.is_alive():
                p.kill()
    results = [torch.load(o, weights_only=False) for o in outs]
    assert [r["outcome"] for r in results] == ["trained"] * 3, [r.get("traceback", "")[-1500:] for r in results]

    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    run_update(model, optimizer, batch, _section(model_dir, groups_per_batch=3, micro_batches=3), 0)
    expected = model.state_dict()
    owned = [set(r["owned"]) for r in results]
    assert sum(len(o) for o in owned) == len(set().union(*owned)) == len(expected)
    for r in results:
        for name, tensor in r["owned"].items():
            assert torch.allclose(tensor, expected[name], rtol=0, atol=1e-6), name


# ---------------------------------------------------------------- 1. rank 0 (the lease, the log) killed


async def _leases(event_log, run_id: str) -> list:
    return [r async for r in replay(event_log, "TRAINER", trainer_lease_subject(run_id))]


@pytest.mark.slow
async def test_killed_rank_0_restarts_the_job_which_takes_its_lease_back_and_serves_one_process_bits(
    event_log, settings, model_dir, reference, tmp_path
):
    run_id = await _new_run(event_log, settings, model_dir, 2 * VERSIONS)
    env = _env(settings, run_id, model_dir, ranks=2, max_restarts=2)
    with Job(CMD, env, run_id, tmp_path / "job.log") as job:
        await _until(lambda: _version_published(event_log, run_id, 3), "version 3", job)
        victims = _rank_pids(run_id, 0)
        assert len(victims) == 1, victims
        os.kill(victims[0], signal.SIGKILL)  # the lease holder and the only log connection, after the v2 checkpoint
        assert job.wait() == 0, job.errors()
    lines = job.lines()
    joined = [ln for ln in lines if ln.get("event") == "trainer rank joined" and ln.get("rank") == 0]
    assert len(joined) == 2, "rank 0 joined once per attempt: the job restarted once"
    restored = [ln for ln in lines if ln.get("event") == "restored checkpoint"]
    assert restored and restored[-1]["ranks"] == 2 and restored[-1]["version"] >= 2
    # The same id took the lease back at once (a lease held by another holder would have refused the start).
    assert {r.event.holder for r in await _leases(event_log, run_id)} == {"t-ranks"}
    assert await _served(event_log, run_id, VERSIONS) == reference
    assert await _policy_versions(event_log, run_id) == list(range(VERSIONS + 1)), "a version lost or appended twice"


# ---------------------------------------------------------------- 2. a rank killed inside a sharded checkpoint


@pytest.mark.slow
@pytest.mark.parametrize(
    "kill_after_put",
    ["1:ckpt-v00000002-t-ranks/__1_0.distcp", "0:ckpt-v00000002-t-ranks/manifest.json"],
    ids=["rank1-after-its-shards", "rank0-after-the-manifest"],
)
async def test_a_rank_killed_inside_a_sharded_checkpoint_leaves_no_event_and_recovery_never_restores_it(
    event_log, settings, model_dir, reference, tmp_path, kill_after_put
):
    """Rank 1 dies right after its shards are stored (before rank 0 gathers their names), or rank 0 right
    after the manifest is stored (before the event): the v2 checkpoint has files and no event, the job
    restarts from nothing checkpointed and re-derives; every checkpoint event that exists names a complete
    manifest whose every file verifies."""
    run_id = await _new_run(event_log, settings, model_dir, 2 * VERSIONS)
    env = _env(settings, run_id, model_dir, ranks=2, max_restarts=1, kill_after_put=kill_after_put)
    with Job(CMD, env, run_id, tmp_path / "job.log") as job:
        assert job.wait() == 0, job.errors()
    assert "exitcode: -9" in job.output, "the rank was not killed where the test meant"
    checkpoints = await _checkpoints(event_log, run_id)
    assert [c.version for c in checkpoints] == [4], "the killed checkpoint has an event, or a later one is missing"
    blobs = S3BlobStore(settings.blobs)
    for checkpoint in checkpoints:
        manifest = json.loads(blobs.get_bytes(checkpoint.uri, expected=checkpoint.sha256))
        assert {f["name"] for f in manifest["files"]} == {".metadata", "__0_0.distcp", "__1_0.distcp"}
        for f in manifest["files"]:
            assert len(blobs.get_bytes(f["uri"], expected=f["sha256"])) == f["bytes"]
    left = blobs.list_keys(f"runs/{run_id}/trainer/ckpt-v00000002-t-ranks/")
    assert any(k.endswith(".distcp") for k in left), "the killed checkpoint's files were stored (the kill came after)"
    assert not [ln for ln in job.lines() if ln.get("event") == "restored checkpoint"], "restored an unfinished one"
    assert await _served(event_log, run_id, VERSIONS) == reference
    assert await _policy_versions(event_log, run_id) == list(range(VERSIONS + 1))


# ---------------------------------------------------------------- 4. restarts exhausted; a rank that hangs


async def test_a_killed_rank_with_no_restarts_left_ends_the_job_loudly(event_log, settings, model_dir, tmp_path):
    run_id = await _new_run(event_log, settings, model_dir, 2 * VERSIONS)
    env = _env(settings, run_id, model_dir, ranks=2, max_restarts=0)
    with Job(CMD, env, run_id, tmp_path / "job.log") as job:
        await _until(lambda: _version_published(event_log, run_id, 2), "version 2", job)
        os.kill(_rank_pids(run_id, 1)[0], signal.SIGKILL)
        code = job.wait()
        left = _processes(run_id)
    assert code != 0
    assert left == [], "a process of the job outlived its launcher"
    assert "exitcode: -9" in job.output and "ChildFailedError" in job.output, job.output[-3000:]


@pytest.mark.slow
async def test_a_stopped_rank_fails_its_peer_on_the_collective_timeout_and_the_job_restarts_past_it(
    event_log, settings, model_dir, reference, tmp_path
):
    """SIGSTOP rank 1 (alive, sockets open, nothing answers): rank 0 fails its next collective after
    trainer.collective_timeout_s, torchrun stops the job (the stopped rank ignores SIGTERM: SIGKILLed after
    torchrun's 30 s) and restarts it, which re-derives and finishes the same chain."""
    run_id = await _new_run(event_log, settings, model_dir, 2 * VERSIONS)
    env = _env(settings, run_id, model_dir, ranks=2, max_restarts=1, collective_timeout_s=5)
    with Job(CMD, env, run_id, tmp_path / "job.log") as job:
        await _until(lambda: _version_published(event_log, run_id, 2), "version 2", job)
        os.kill(_rank_pids(run_id, 1)[0], signal.SIGSTOP)
        assert job.wait() == 0, job.errors()
    assert "Timed out waiting 5000ms" in job.output
    assert await _served(event_log, run_id, VERSIONS) == reference
    assert await _policy_versions(event_log, run_id) == list(range(VERSIONS + 1))


# ---------------------------------------------------------------- 8. an idle job; the launcher killed; S3 down


async def _renewals_since(event_log, run_id: str, after_seq: int) -> int:
    return sum(1 for r in await _leases(event_log, run_id) if r.stream_seq > after_seq)


@pytest.mark.slow
async def test_an_idle_job_outlives_the_collective_timeout(event_log, settings, model_dir, tmp_path):
    """One version's groups, then nothing for several collective timeouts: the job waits (the same ranks,
    no restart), and trains on when the next groups come. The trainer's own lease renewals (every
    lease_ttl_s / 4 = 2 s) are the clock: six of them span four timeouts. Was: rank 1, waiting for rank 0's
    next command in a gloo broadcast bounded by trainer.collective_timeout_s, failed with `Timed out waiting
    3000ms for recv operation to complete` and torchrun restarted the job (600 s idle by default; each
    idle spell spent a restart)."""
    run_id = await _new_run(event_log, settings, model_dir, 2)
    env = _env(
        settings, run_id, model_dir, ranks=2, max_restarts=0, max_versions=2, collective_timeout_s=3, lease_ttl_s=8
    )
    with Job(CMD, env, run_id, tmp_path / "job.log") as job:
        await _until(lambda: _version_published(event_log, run_id, 1), "version 1", job)
        ranks = {p.pid for p in _processes(run_id) if p.rank is not None}
        since = (await _leases(event_log, run_id))[-1].stream_seq

        async def idle_long_enough() -> bool:
            return await _renewals_since(event_log, run_id, since) >= 6

        await _until(idle_long_enough, "six lease renewals while idle", job)
        assert {p.pid for p in _processes(run_id) if p.rank is not None} == ranks, "a rank was restarted while idle"
        await publish_groups(event_log, make_groups(model_dir, run_id, 4)[2:])  # the next version's groups
        assert job.wait() == 0, job.errors()
    assert (await chain_head(event_log, run_id)).version == 2


@pytest.mark.slow
async def test_sigkill_of_the_launcher_takes_its_ranks_with_it(event_log, settings, model_dir, tmp_path):
    """The job waits for data (one version's groups); the launcher is SIGKILLed: its torchrun and ranks
    must go too. Decided by events, not time: every process gone, or two more lease renewals (every
    lease_ttl_s / 4 = 5 s) from a job whose launcher is dead. Was: torchrun (a plain child) and its ranks (in
    sessions of their own) ran on, rank 0 renewing the lease, so a supervisor's restart with the same
    trainer_id made two jobs taking the lease from each other."""
    run_id = await _new_run(event_log, settings, model_dir, 2)
    env = _env(settings, run_id, model_dir, ranks=2, max_restarts=2, max_versions=10, lease_ttl_s=20)
    with Job(CMD, env, run_id, tmp_path / "job.log") as job:
        await _until(lambda: _version_published(event_log, run_id, 1), "version 1", job)
        since = (await _leases(event_log, run_id))[-1].stream_seq
        job.process.kill()
        job.process.wait()

        async def settled() -> str | None:
            if not _processes(run_id):
                return "gone"
            if await _renewals_since(event_log, run_id, since) >= 2:
                return "renewing its lease"
            return None

        outcome = await _until(settled, "the job's processes gone or renewing")
    assert outcome == "gone", f"torchrun and the ranks outlived their launcher, {outcome}"


@pytest.mark.slow
async def test_an_s3_outage_past_the_patience_stops_the_ranks_loudly_and_the_restart_recovers(
    event_log, settings, model_dir, reference, tmp_path
):
    """SeaweedFS SIGSTOPped after version 1 (its sockets open, nothing answers) for longer than
    blobs.outage_patience_s: the version's publish fails loudly (PublishFailed on rank 0; a follower's
    publish thread exits its rank), never a rank parked in the parts' gather; torchrun restarts the job once
    the store is back, and it re-derives and finishes the one-process chain."""
    from tests.servers import server_stopped

    run_id = await _new_run(event_log, settings, model_dir, 2 * VERSIONS)
    env = _env(settings, run_id, model_dir, ranks=2, max_restarts=2)
    env |= {
        "SPRAWL_BLOBS__MAX_ATTEMPTS": "1",
        "SPRAWL_BLOBS__CONNECT_TIMEOUT_S": "1",
        "SPRAWL_BLOBS__READ_TIMEOUT_S": "1",
        "SPRAWL_BLOBS__OUTAGE_PATIENCE_S": "4",
    }
    with Job(CMD, env, run_id, tmp_path / "job.log") as job:
        await _until(lambda: _version_published(event_log, run_id, 1), "version 1", job)
        first = {p.pid for p in _processes(run_id) if p.rank is not None}

        async def restarted() -> bool:
            ranks = {p.pid for p in _processes(run_id) if p.rank is not None}
            return bool(ranks) and not ranks & first

        with server_stopped(settings, "seaweedfs"):
            await _until(restarted, "the ranks replaced after the outage outlasted the patience", job)
        assert job.wait() == 0, job.errors()
    assert "longer than blobs.outage_patience_s=4" in job.output
    assert await _served(event_log, run_id, VERSIONS) == reference
    assert await _policy_versions(event_log, run_id) == list(range(VERSIONS + 1))


# ---------------------------------------------------------------- 7. SIGTERM to `sprawl trainer --trainer.ranks 2`


@dataclass
class Stopped:
    run_id: str
    code: int
    left: list[JobProcess]
    """The job's processes alive once the launcher returned."""
    head: int
    versions: list[int]
    """Every version event of the run, in log order."""
    metrics: list[int]
    """The version of every TrainerMetrics event."""
    lineages: list[str]
    output: str


@pytest.fixture(scope="module")
def sigtermed(stack_session, model_dir, tmp_path_factory) -> Stopped:
    """A 2-rank job with data for five versions, SIGTERMed (the launcher only, as a supervisor stops it)
    once version 2 is in the chain, mid-run."""

    async def run() -> Stopped:
        event_log = await EventLog.connect(stack_session, worker="test")
        try:
            run_id = await _new_run(event_log, stack_session, model_dir, 2 * VERSIONS)
            env = _env(stack_session, run_id, model_dir, ranks=2, max_restarts=2, max_versions=None)
            with Job(CMD, env, run_id, tmp_path_factory.mktemp("sigterm") / "job.log") as job:
                await _until(lambda: _version_published(event_log, run_id, 2), "version 2", job)
                job.process.send_signal(signal.SIGTERM)
                code = await asyncio.to_thread(job.wait)
                left = _processes(run_id)
            metrics = [r.event.version async for r in replay(event_log, "METRICS", f"rl.{run_id}.metrics.trainer")]
            return Stopped(
                run_id=run_id,
                code=code,
                left=left,
                head=(await chain_head(event_log, run_id)).version,
                versions=await _policy_versions(event_log, run_id),
                metrics=metrics,
                lineages=S3BlobStore(stack_session.blobs).list_keys(f"runs/{run_id}/lineage/"),
                output=job.output,
            )
        finally:
            await event_log.close()

    return asyncio.run(run())


@pytest.mark.slow
def test_sigterm_to_the_launcher_publishes_every_computed_version_and_every_process_exits(sigtermed):
    """torchrun passes the SIGTERM to the ranks; rank 0 stops as one trainer does (the followers ignore
    it and return when rank 0 says stop): every version whose lineage was written (its publish began) is in
    the chain once, with its metrics, and nothing of the job is left."""
    assert sigtermed.left == [], "a process of the job outlived the launcher"
    assert sigtermed.head >= 2
    assert sigtermed.versions == list(range(sigtermed.head + 1))
    assert sigtermed.metrics == list(range(1, sigtermed.head + 1))
    from schemas.lineage import lineage_key

    expected = [lineage_key(sigtermed.run_id, v) for v in range(1, sigtermed.head + 1)]
    assert sorted(sigtermed.lineages) == expected, "a version's publish began and never ended in the chain"


@pytest.mark.slow
def test_sigterm_to_the_launcher_exits_as_one_stopped_trainer_does(sigtermed):
    """0, as one process stopped by SIGTERM. Was: 1, torchrun's own SignalException traceback after its
    ranks had stopped cleanly (a supervisor restarts on a non-zero exit: a requested stop read as a crash)."""
    assert sigtermed.code == 0, "\n".join(sigtermed.output.splitlines()[-5:])


# ---------------------------------------------------------------- 5. ranks that cannot cut the batch


TORCHRUN_3 = [
    sys.executable,
    "-m",
    "torch.distributed.run",
    "--standalone",
    "--nproc-per-node=3",
    "--max-restarts=0",
    "-m",
    "workers.cli",
    "trainer",
]
"""A job started with torchrun by hand (as across hosts): trainer.ranks stays 1, so the settings'
validators cannot compare micro_batches and groups_per_batch with the real world size."""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("micro_batches", "refusal"),
    [(2, "cannot be split over 3 ranks"), (None, "groups_per_batch")],
    ids=["micro_batches-2", "micro_batches-unset-2-groups"],
)
async def test_ranks_that_cannot_cut_the_batch_are_refused_before_anything_is_published(
    event_log, settings, model_dir, tmp_path, micro_batches, refusal
):
    """No data at all: a job that cannot train a batch must say so at start, not once a batch comes. Was:
    version 0 published, then (with a batch) `trainer.micro_batches = 2 cannot be split over 3 ranks` on
    every rank, or with micro_batches unset `ValueError: max() arg is an empty sequence` in build_tensors;
    with no batch, nothing at all."""
    run_id = await _new_run(event_log, settings, model_dir, 0)
    env = _env(settings, run_id, model_dir, micro_batches=micro_batches)
    with Job(TORCHRUN_3, env, run_id, tmp_path / "job.log") as job:

        async def settled() -> bool:
            return job.process.poll() is not None or await fetch_version(event_log, run_id, 0) is not None

        await _until(settled, "an exit or version 0")
        published = await fetch_version(event_log, run_id, 0)
        code = job.process.poll()
    assert published is None, "version 0 published by a job whose ranks cannot cut a batch"
    assert code not in (None, 0)
    errors = [ln for ln in job.output.splitlines() if ln.startswith("sprawl: error:")]
    assert errors and all(refusal in ln for ln in errors), job.errors()


# ---------------------------------------------------------------- 6. another number of ranks re-deriving


@pytest.mark.slow
async def test_a_job_restarted_with_other_slices_is_refused_naming_them(
    event_log, settings, six_expert_model_dir, tmp_path
):
    """2 ranks x micro_batches 2 write v1..v5 (checkpoint at v3); torchrun by hand with 3 ranks and
    micro_batches 3 must refuse before re-deriving v4, saying the versions were computed in 2 slices on 2
    ranks. (A sum of gradients depends on its order past two terms: see the three-rank test above.) Was:
    the 2-rank checkpoint restored (resharded), v4 re-derived in another order and refused with `the
    update is not deterministic or the inputs changed`, naming neither cause; where the different masters
    happened to round to the same bf16/fp8 views (learning_rate 1e-5 did), accepted silently."""
    model_dir = six_expert_model_dir
    run_id = await _new_run(event_log, settings, model_dir, 36)
    shape = {"groups_per_batch": 6, "checkpoint_every": 3, "learning_rate": 1e-3}
    env = _env(settings, run_id, model_dir, ranks=2, max_restarts=0, micro_batches=2, **shape)
    with Job(CMD, env, run_id, tmp_path / "two.log") as two:
        assert two.wait() == 0, two.errors()
    assert [c.version for c in await _checkpoints(event_log, run_id)] == [3]
    env = _env(settings, run_id, model_dir, micro_batches=3, max_versions=VERSIONS + 1, **shape)
    with Job(TORCHRUN_3, env, run_id, tmp_path / "three.log") as three:
        code = three.wait()
    assert await fetch_version(event_log, run_id, VERSIONS + 1) is None
    assert code != 0
    errors = " ".join(ln for ln in three.output.splitlines() if ln.startswith("sprawl: error:"))
    assert "micro_batches" in errors and "ranks" in errors, errors


# ---------------------------------------------------------------- 3. a restored state never checked


@pytest.mark.slow
async def test_a_restored_checkpoint_is_checked_against_its_version_before_training_on(
    event_log, settings, model_dir, tmp_path
):
    """A forged checkpoint event at the chain's head whose manifest names v1's shards as v2's (its version
    fields agreeing, its digests right): nothing to re-derive, so only a check of the restored weights
    against v2's root hashes can refuse it. Was: trained on, and v3 published and signed from v1's weights."""
    from schemas import TrainerCheckpoint

    run_id = await _new_run(event_log, settings, model_dir, 4)
    env = _env(settings, run_id, model_dir, ranks=2, max_restarts=0, max_versions=2, checkpoint_every=1)
    with Job(CMD, env, run_id, tmp_path / "first.log") as first:
        assert first.wait() == 0, first.errors()
    v1, v2 = await _checkpoints(event_log, run_id)
    blobs = S3BlobStore(settings.blobs)
    manifest = json.loads(blobs.get_bytes(v1.uri, expected=v1.sha256))
    forged = json.dumps({**manifest, "version": 2, "step": 2}, sort_keys=True).encode()
    ref = blobs.put_bytes(forged, f"runs/{run_id}/trainer/forged-v2/manifest.json")
    await event_log.append(
        TrainerCheckpoint(
            run_id=run_id,
            version=2,
            step=2,
            uri=ref.uri,
            sha256=ref.checksum,
            bytes=ref.bytes,
            trajectory_position=v2.trajectory_position,
            reward_position=v2.reward_position,
        )
    )
    await publish_groups(event_log, make_groups(model_dir, run_id, 6)[4:])
    env = _env(settings, run_id, model_dir, ranks=2, max_restarts=0, max_versions=3, checkpoint_every=1)
    with Job(CMD, env, run_id, tmp_path / "second.log") as second:
        code = second.wait()
    assert await fetch_version(event_log, run_id, 3) is None, "v3 trained on v1's weights restored as v2's"
    assert code != 0


# ---------------------------------------------------------------- 8. rank 0 killed between a version and its metrics


@pytest.mark.slow
async def test_rank_0_killed_between_a_version_and_its_metrics_loses_no_metrics(
    event_log, settings, model_dir, reference, tmp_path
):
    """Rank 0 SIGKILLs itself right after the log acknowledged v3's event: the job restarts and finishes the
    one-process chain, and every version's metrics are in the log once (none lost, none twice). Was: v3's
    TrainerMetrics never appended (the restart re-derived v3 without them; one process shares the path)."""
    run_id = await _new_run(event_log, settings, model_dir, 2 * VERSIONS)
    env = _env(settings, run_id, model_dir, ranks=2, max_restarts=1, kill_after_append="0:.policy.v3")
    with Job(CMD, env, run_id, tmp_path / "job.log") as job:
        assert job.wait() == 0, job.errors()
    assert "exitcode: -9" in job.output, "rank 0 was not killed where the test meant"
    assert await _served(event_log, run_id, VERSIONS) == reference
    assert await _policy_versions(event_log, run_id) == list(range(VERSIONS + 1))
    metrics = [r.event.version async for r in replay(event_log, "METRICS", f"rl.{run_id}.metrics.trainer")]
    assert sorted(metrics) == list(range(1, VERSIONS + 1)), metrics


# ---------------------------------------------------------------- second round: the fixes attacked


@pytest.mark.slow
async def test_sigkill_of_torchrun_takes_its_ranks_with_it(event_log, settings, model_dir, tmp_path):
    """As for the launcher above, one level down: torchrun SIGKILLed, its ranks must go. Was: both ranks
    ran on in sessions of their own, rank 0 renewing the lease beside the launcher's next torchrun
    (PR_SET_PDEATHSIG was set on torchrun only)."""
    run_id = await _new_run(event_log, settings, model_dir, 2)
    env = _env(settings, run_id, model_dir, ranks=2, max_restarts=2, max_versions=10, lease_ttl_s=20)
    with Job(CMD, env, run_id, tmp_path / "job.log") as job:
        await _until(lambda: _version_published(event_log, run_id, 1), "version 1", job)
        since = (await _leases(event_log, run_id))[-1].stream_seq
        agents = [p.pid for p in _processes(run_id) if p.rank is None and p.pid != job.process.pid]
        assert len(agents) == 1, agents
        os.kill(agents[0], signal.SIGKILL)

        async def settled() -> str | None:
            if not [p for p in _processes(run_id) if p.rank is not None]:
                return "gone"
            if await _renewals_since(event_log, run_id, since) >= 2:
                return "renewing its lease"
            return None

        outcome = await _until(settled, "the ranks gone or renewing")
    assert outcome == "gone", f"the ranks outlived torchrun, {outcome}"


@pytest.mark.slow
async def test_a_stop_whose_last_versions_cannot_be_published_exits_non_zero(event_log, settings, model_dir, tmp_path):
    """SIGTERM while the store is down: rank 0 drains, the publish fails past the patience. The stop did
    not publish every computed version: the exit says so, as one process's does. Was: exit 0 (torchrun
    ends any forwarded stop with exit 1, which the launcher read as a stop), so a supervisor took a
    failed drain for a finished job."""
    from tests.servers import server_stopped

    run_id = await _new_run(event_log, settings, model_dir, 2 * VERSIONS)
    env = _env(settings, run_id, model_dir, ranks=2, max_restarts=2, max_versions=None) | _OUTAGE_BLOBS
    with Job(CMD, env, run_id, tmp_path / "job.log") as job:
        await _until(lambda: _version_published(event_log, run_id, 1), "version 1", job)
        with server_stopped(settings, "seaweedfs"):
            job.process.send_signal(signal.SIGTERM)
            code = await asyncio.to_thread(job.wait)
    assert "longer than blobs.outage_patience_s=4" in job.output, "the drain did not fail as the test meant"
    assert code != 0, "a stop that left a computed version unpublished exited 0"


_OUTAGE_BLOBS = {
    "SPRAWL_BLOBS__MAX_ATTEMPTS": "1",
    "SPRAWL_BLOBS__CONNECT_TIMEOUT_S": "1",
    "SPRAWL_BLOBS__READ_TIMEOUT_S": "1",
    "SPRAWL_BLOBS__OUTAGE_PATIENCE_S": "4",
}
"""Each attempt against a stopped store gives up after a second; the patience decides how long an outage
is waited out."""


@pytest.mark.slow
async def test_a_store_outage_within_the_patience_is_ridden_out_whatever_the_collective_timeout(
    event_log, settings, model_dir, reference, tmp_path
):
    """trainer.collective_timeout_s 5 s, blobs.outage_patience_s 60 s: either the job refuses the pair at
    start, naming the timeout, or it rides out a 10 s outage (measured by six of its own lease renewals,
    lease_ttl_s / 4 = 2 s each) with the same ranks and finishes the one-process chain. Was: killed 16 s
    into the outage (`Timed out waiting 5000ms`): rank 0, blocked on its full publish queue, sent no
    command, and the parts' gather after each rank's own uploads had the same 5 s bound."""
    from tests.servers import server_stopped

    run_id = await _new_run(event_log, settings, model_dir, 2 * VERSIONS)
    env = _env(settings, run_id, model_dir, ranks=2, max_restarts=0, collective_timeout_s=5, lease_ttl_s=8)
    env |= {**_OUTAGE_BLOBS, "SPRAWL_BLOBS__OUTAGE_PATIENCE_S": "60"}
    with Job(CMD, env, run_id, tmp_path / "job.log") as job:

        async def started() -> str | None:
            if job.process.poll() is not None:
                return "exited"
            return "published" if await fetch_version(event_log, run_id, 1) is not None else None

        if await _until(started, "version 1 or a refusal") == "exited":
            assert job.process.returncode != 0 and "collective_timeout_s" in job.errors(), job.errors()
            return
        ranks = {p.pid for p in _processes(run_id) if p.rank is not None}
        since = (await _leases(event_log, run_id))[-1].stream_seq
        with server_stopped(settings, "seaweedfs"):

            async def ten_seconds_out() -> bool:
                return await _renewals_since(event_log, run_id, since) >= 6

            await _until(ten_seconds_out, "six lease renewals during the outage", job)
        assert {p.pid for p in _processes(run_id) if p.rank is not None} == ranks, (
            "a rank died or was restarted during the outage"
        )
        assert job.wait() == 0, job.errors()
    assert await _served(event_log, run_id, VERSIONS) == reference


@pytest.mark.slow
async def test_a_job_restarted_with_other_ranks_and_the_same_slices_is_refused_naming_them(
    event_log, settings, model_dir, tmp_path
):
    """Four slices summed on two ranks are other bits than on one. Was: the lineage named the slices only,
    and one process re-deriving the run failed at v2 with a generic non-determinism error."""
    run_id = await _new_run(event_log, settings, model_dir, 16)
    shape = {"groups_per_batch": 4, "micro_batches": 4, "checkpoint_every": 100, "learning_rate": 1e-3}
    env = _env(settings, run_id, model_dir, ranks=2, max_restarts=0, max_versions=3, **shape)
    with Job(CMD, env, run_id, tmp_path / "two.log") as two:
        assert two.wait() == 0, two.errors()
    env = _env(settings, run_id, model_dir, max_versions=4, **shape)
    with Job(CMD, env, run_id, tmp_path / "one.log") as one:
        code = one.wait()
    assert await fetch_version(event_log, run_id, 4) is None
    assert code != 0
    errors = " ".join(ln for ln in one.output.splitlines() if ln.startswith("sprawl: error:"))
    assert re.search(r"\b2 ranks?\b|\b2 rank\(s\)", errors) and "trainer.ranks" in errors, errors

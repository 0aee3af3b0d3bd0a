"""The invariants a run must keep under any fault, judged from the harness's own readings.

- lost: an event a producer was acknowledged for (seen in the log before the fault, or appended by
  the harness) that is no longer in the log; a reward or a lineage entry pointing at a trajectory
  the log does not hold there; an event of the log missing from the archive (after a drain).
- duplicated: a trajectory id trained into more than one version (or twice into one); more than one
  reward per trajectory id in the log; a log message archived more than once.
- the archive's count of each event type equals the log's.
- every island's served version re-hashes, file by file, to the root hash the log recorded for it.
- recovery: seconds from the fault's end to the next version appended (server timestamps).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from schemas import PolicyVersion, Reward, Trajectory
from schemas.lineage import Lineage
from workers.bench.faults.ledger import ArchivedRow, LoggedMessage

_EXAMPLES = 5
"""How many examples of a broken invariant a report lists (the counts are complete)."""


@dataclass
class Findings:
    lost: int = 0
    duplicated: int = 0
    details: dict = field(default_factory=dict)
    """Each invariant that broke: its count and a few examples."""

    def add(self, key: str, count: int, examples: list, *, kind: str) -> None:
        if count <= 0:
            return
        if kind == "lost":
            self.lost += count
        elif kind == "duplicated":
            self.duplicated += count
        self.details[key] = {"count": count, "examples": [str(e) for e in examples[:_EXAMPLES]]}


def judge_log_and_archive(
    *,
    seen_before: set[tuple[str, int]],
    acked: set[tuple[str, int]],
    scan: dict[str, list[LoggedMessage]],
    archive: list[ArchivedRow],
    lineages: dict[int, Lineage],
    lineage_unreadable: dict[int, str],
) -> Findings:
    findings = Findings()
    messages = [m for stream in scan.values() for m in stream]
    in_log = {(m.stream, m.seq) for m in messages}

    # 0 acked events lost: what the log held before the fault, and what it acknowledged to the harness.
    gone = sorted((seen_before | acked) - in_log)
    findings.add("acked_missing_from_log", len(gone), gone, kind="lost")

    trajectories = {(m.seq): m.event for m in scan.get("trajectories", []) if isinstance(m.event, Trajectory)}
    trajectory_ids = {t.trajectory_id for t in trajectories.values()}
    rewards = [m.event for m in scan.get("rewards", []) if isinstance(m.event, Reward)]
    dangling_rewards = [r.trajectory_id for r in rewards if r.trajectory_id not in trajectory_ids]
    findings.add("rewards_without_their_trajectory", len(dangling_rewards), dangling_rewards, kind="lost")
    reward_seqs = {m.seq for m in scan.get("rewards", []) if isinstance(m.event, Reward)}
    dangling_lineage = [
        f"v{version}:{member.trajectory_id}@{member.trajectory_seq}"
        for version, lineage in sorted(lineages.items())
        for group in lineage.groups
        for member in group.members
        if getattr(trajectories.get(member.trajectory_seq), "trajectory_id", None) != member.trajectory_id
        or member.reward_seq not in reward_seqs
    ]
    findings.add("lineage_entries_not_in_log", len(dangling_lineage), dangling_lineage, kind="lost")
    findings.add("lineage_unreadable", len(lineage_unreadable), list(lineage_unreadable.items()), kind="lost")

    # Archive == log: every message archived once, nothing archived that the log does not hold.
    archived = Counter((r.stream, r.seq) for r in archive)
    missing = sorted(in_log - set(archived))
    findings.add("log_events_missing_from_archive", len(missing), missing, kind="lost")
    twice = sorted(k for k, n in archived.items() if n > 1)
    findings.add("archive_rows_written_twice", sum(archived[k] - 1 for k in twice), twice, kind="duplicated")
    extra = sorted(set(archived) - in_log)
    findings.add("archive_rows_not_in_log", len(extra), extra, kind="other")
    log_types = Counter(m.event_type for m in messages)
    archive_types = Counter(r.event_type for r in archive)
    mismatched = {
        t: {"log": log_types.get(t, 0), "archive": archive_types.get(t, 0)}
        for t in sorted(set(log_types) | set(archive_types))
        if log_types.get(t, 0) != archive_types.get(t, 0)
    }
    if mismatched:
        findings.details["archive_count_differs_by_type"] = mismatched

    # 0 trained twice, 0 rewarded twice.
    trained = Counter(
        member.trajectory_id for lineage in lineages.values() for group in lineage.groups for member in group.members
    )
    trained_twice = sorted(t for t, n in trained.items() if n > 1)
    findings.add(
        "trajectories_trained_twice", sum(trained[t] - 1 for t in trained_twice), trained_twice, kind="duplicated"
    )
    rewarded = Counter(r.trajectory_id for r in rewards)
    rewarded_twice = sorted(t for t, n in rewarded.items() if n > 1)
    findings.add(
        "rewards_counted_twice", sum(rewarded[t] - 1 for t in rewarded_twice), rewarded_twice, kind="duplicated"
    )
    stored = Counter(t.trajectory_id for t in trajectories.values())
    stored_twice = sorted(t for t, n in stored.items() if n > 1)
    findings.add("trajectory_ids_stored_twice", sum(stored[t] - 1 for t in stored_twice), stored_twice, kind="other")
    return findings


def recovery_seconds(scan: dict[str, list[LoggedMessage]], fault_end: datetime) -> float | None:
    """Seconds from `fault_end` to the first version the server stored after it; None: none was."""
    after = [
        m.stored_at for m in scan.get("policy", []) if isinstance(m.event, PolicyVersion) and m.stored_at >= fault_end
    ]
    return round((min(after) - fault_end).total_seconds(), 1) if after else None


def loop_recovery_seconds(
    scan: dict[str, list[LoggedMessage]], lineages: dict[int, Lineage], fault_end: datetime, trajectory_mark: int
) -> float | None:
    """Seconds from `fault_end` to the first version trained on a trajectory stored after the fault
    (TRAJECTORIES sequence above `trajectory_mark`, the stream's last sequence when the fault ended):
    the whole loop (prompt, sample, reward, update) went round again. None: it did not.

    A version appended right after a fault may come from a batch assembled before it, so the next
    version alone says little; this one cannot."""
    after = [
        m.stored_at
        for m in scan.get("policy", [])
        if isinstance(m.event, PolicyVersion)
        and m.event.version in lineages
        and any(
            member.trajectory_seq > trajectory_mark for g in lineages[m.event.version].groups for member in g.members
        )
    ]
    return round((min(after) - fault_end).total_seconds(), 1) if after else None


# ---------------------------------------------------------------- islands


@dataclass(frozen=True)
class IslandServing:
    island_id: str
    version: int | None
    """The version the island's cache points `current` at (what it serves); None: nothing yet."""
    root_hash_ok: bool
    detail: str = ""


async def islands_serving(event_log, run_id: str, island_dirs: dict[str, Path]) -> list[IslandServing]:
    """Each island's served version, re-hashed from its files and compared with the log's root hash."""
    from pipeline.materialize import verify_directory
    from pipeline.version_log import fetch_version

    out = []
    for island_id, root in sorted(island_dirs.items()):
        link = root / "current"
        if not link.exists():
            out.append(IslandServing(island_id, None, False, f"{root} has no current version"))
            continue
        directory = link.resolve()
        version = int(directory.name[1:])
        event = await fetch_version(event_log, run_id, version)
        view = root.name
        expected = {v.view: v.root_hash for v in event.views}.get(view) if event is not None else None
        actual = await asyncio.to_thread(verify_directory, directory)
        detail = "" if actual == expected else f"files hash to {actual}, the log says {expected}"
        out.append(IslandServing(island_id, version, actual == expected and expected is not None, detail))
    return out

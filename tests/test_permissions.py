"""Roles on the secure stack: every forbidden action refused by the servers themselves, every allowed one working.

The matrix (`infra/permission_check.py`, `infra/s3_identities.py`) runs against the session's real
nats-server and SeaweedFS, as `sprawl check permissions` does; the other tests here are the attacks a
sampler's credentials make possible: forging a version, stealing another role's messages.
"""

from __future__ import annotations

import json

import pytest

from infra import stack
from infra.permission_check import check_stack_permissions
from infra.streams import apply
from pipeline.errors import LogPermissionRefused
from pipeline.eventlog import EventLog
from pipeline.topology import POLICY, PROMPTS, consumer_for, policy_filter
from schemas import PolicyVersion
from workers.cli import main


def test_every_forbidden_action_of_every_role_is_refused_and_every_allowed_one_works(settings):
    st = stack.status(settings)
    assert st is not None and st.secure
    counts, unexpected = check_stack_permissions(settings, st)
    assert unexpected == []
    assert counts["forbidden_attempted"] > 500 and counts["allowed_attempted"] > 100, counts
    assert counts["forbidden_refused"] == counts["forbidden_attempted"]
    assert counts["allowed_ok"] == counts["allowed_attempted"]


def test_sprawl_check_permissions_prints_the_counts(settings, capsys, monkeypatch):
    monkeypatch.setenv("SPRAWL_STATE_DIR", str(settings.state_dir))
    assert main(["check", "permissions", "--json"]) == 0
    counts = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert counts["forbidden_refused"] == counts["forbidden_attempted"] > 0
    assert counts["allowed_ok"] == counts["allowed_attempted"] > 0


async def test_a_version_forged_with_a_samplers_credentials_never_reaches_the_log(settings):
    admin = await EventLog.connect(settings, worker="test-admin")
    await apply(admin.js, settings.streams, settings.run_id)
    sampler = await EventLog.connect(stack.with_role(settings, "sampler"), worker="test-forger")
    forged = PolicyVersion(run_id=settings.run_id, version=0, parent_version=None, trainer_step=0, views=[])
    try:
        with pytest.raises(LogPermissionRefused, match=r"policy\.v0"):
            await sampler.append(forged)
        info = await admin.js.stream_info(POLICY.name, subjects_filter=policy_filter(settings.run_id))
        assert not info.state.subjects, "the forged version is in the log"
    finally:
        await sampler.close()
        await admin.close()


async def test_a_sampler_cannot_take_the_archivers_messages(settings):
    """Pulling from (and acking on) another role's durable would take events out of the archive."""
    admin = await EventLog.connect(settings, worker="test-admin")
    await apply(admin.js, settings.streams, settings.run_id)
    sampler = await EventLog.connect(stack.with_role(settings, "sampler"), worker="test-thief")
    archiver = consumer_for(settings.run_id, "archiver", PROMPTS)
    try:
        sub = await sampler.js.pull_subscribe_bind(durable=archiver.name, stream=PROMPTS.name)
        with pytest.raises(Exception):  # noqa: B017 - refused: the client sees only a timeout
            await sub.fetch(1, timeout=2)
        assert f"$js.api.consumer.msg.next.prompts.{archiver.name}".lower() in _refused(sampler)
    finally:
        await sampler.close()
        await admin.close()


def _refused(log: EventLog) -> set[str]:
    from pipeline.eventlog import refused_subjects

    return refused_subjects(log.nc)

"""Join tokens on the real secure stack: a worker elsewhere needs the token alone; revoking it (or its
expiry) ends its access to the log and the bucket at once, and a worker holding it ends loudly."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
import sys

import pytest

from infra import stack
from infra.join_token import JoinTokenError, decode, join_settings
from pipeline.blobstore import open_blob_store
from pipeline.config import load_settings
from pipeline.errors import BlobAccessDenied, LogIdentityRefused, LogUnavailable
from pipeline.eventlog import EventLog
from tests.servers import HANG_GUARD_S
from workers.cli import main
from workers.sampler.settings import SamplerSettings


def _create(settings, capsys, monkeypatch, *args: str) -> str:
    monkeypatch.setenv("SPRAWL_STATE_DIR", str(settings.state_dir))
    monkeypatch.setenv("SPRAWL_RUN_ID", settings.run_id)
    assert main(["token", "create", *args]) == 0
    return capsys.readouterr().out.strip().splitlines()[-1]


def _joined(text: str, tmp_path) -> SamplerSettings:
    return load_settings(SamplerSettings, None, state_dir=tmp_path, **join_settings(text, tmp_path))


async def test_a_token_alone_connects_a_sampler_with_its_own_grants(settings, capsys, monkeypatch, tmp_path):
    text = _create(settings, capsys, monkeypatch, "--role", "sampler", "--ttl", "1h")
    joined = _joined(text, tmp_path)
    assert joined.run_id == settings.run_id and joined.trust.version_public_key
    assert joined.nats.creds_file.stat().st_mode & 0o077 == 0, "the token's credentials are owner-only"
    log = await EventLog.connect(joined, worker="joined")
    try:
        await log.nc.publish(f"rl.{settings.run_id}.heartbeat.x", b"{}")
        await log.nc.flush()
        assert not log.nc.last_error
    finally:
        await log.close()
    blobs = open_blob_store(joined.blobs)
    with pytest.raises(BlobAccessDenied):  # a sampler writes its claim checks, never version blobs
        blobs.put_bytes(b"forged", key=f"runs/{settings.run_id}/policy/v99999999-x/model.safetensors")


async def test_revoking_a_token_closes_its_connection_and_its_bucket_access(settings, capsys, monkeypatch, tmp_path):
    text = _create(settings, capsys, monkeypatch, "--role", "sampler")
    token = decode(text)
    joined = _joined(text, tmp_path)
    log = await EventLog.connect(joined, worker="to-be-revoked")
    blobs = open_blob_store(joined.blobs)
    probe = f"claims/{settings.run_id}/traj/probe"
    blobs.put_bytes(b"ok", key=probe)  # allowed before
    try:
        assert main(["token", "revoke", token.token_id]) == 0
        await asyncio.wait_for(log.wait_identity_refused(), HANG_GUARD_S)
    except LogIdentityRefused as refused:
        assert "revoked" in str(refused).lower() or "authorization" in str(refused).lower()
    finally:
        await log.close()
    with pytest.raises(BlobAccessDenied):
        blobs.put_bytes(b"after", key=probe + "2")
    with pytest.raises((LogUnavailable, LogIdentityRefused)):  # and it cannot come back
        await EventLog.connect(joined, worker="revoked-again")
    assert main(["token", "list"]) == 0
    assert f"{token.token_id}  sampler" in capsys.readouterr().out


async def test_an_expired_token_is_refused_by_the_server_itself(settings, capsys, monkeypatch, tmp_path):
    text = _create(settings, capsys, monkeypatch, "--role", "sampler", "--ttl", "3s")
    joined = _joined(text, tmp_path)
    log = await EventLog.connect(joined, worker="expiring")
    try:
        with pytest.raises(LogIdentityRefused):
            await asyncio.wait_for(log.wait_identity_refused(), HANG_GUARD_S)  # nats-server ends it at `exp`
    finally:
        await log.close()
    with pytest.raises(JoinTokenError, match="expired"):
        decode(text)


def test_a_worker_whose_token_is_revoked_exits_with_one_line(event_log, settings, capsys, monkeypatch, tmp_path):
    text = _create(settings, capsys, monkeypatch, "--role", "rewards")
    token_file = tmp_path / "rewards.token"
    token_file.write_text(text)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPRAWL_")}
    env |= {"SPRAWL_JOIN": f"@{token_file}", "SPRAWL_STATE_DIR": str(tmp_path / "state"), "SPRAWL_LOG_FORMAT": "json"}
    worker = subprocess.Popen(
        [sys.executable, "-m", "workers.cli", "rewards"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    seen: list[bytes] = []
    try:
        for line in worker.stderr:  # until it says it runs: connected to the log and bound
            seen.append(line)
            if b'"consumer bound"' in line or b"sprawl: error" in line:
                break
        assert main(["token", "revoke", decode(text).token_id]) == 0
        _, rest = worker.communicate(timeout=HANG_GUARD_S)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    stderr = (b"".join(seen) + rest).decode()
    assert worker.returncode not in (0, None)
    errors = [line for line in stderr.splitlines() if line.startswith("sprawl: error:")]
    assert len(errors) == 1 and "identity" in errors[0], stderr[-3000:]


def test_bad_tokens_fail_with_one_clear_line(settings, capsys, monkeypatch, tmp_path):
    text = _create(settings, capsys, monkeypatch, "--role", "sampler")
    monkeypatch.delenv("SPRAWL_RUN_ID")
    # The wrong command for the token's role.
    assert main(["rewards", "--join", text, "--state-dir", str(tmp_path)]) == 2
    assert "for the sampler role" in capsys.readouterr().err
    # Damaged, or not a token at all: what is wrong, never what it holds.
    body = json.loads(base64.urlsafe_b64decode(text.split(".", 2)[2] + "=="))
    for bad in (text[:-10], "hello", text.replace("sprawl-join.v1.", "sprawl-join.v9.")):
        assert main(["sampler", "--join", bad, "--state-dir", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert "join token" in err and body["nats_creds"][40:80] not in err
    # A trainer token cannot be made: it stays beside the stack.
    monkeypatch.setenv("SPRAWL_RUN_ID", settings.run_id)
    assert main(["token", "create", "--role", "trainer"]) == 2
    assert stack.status(settings) is not None


@pytest.mark.parametrize("trusted", ["another CA", "no CA"])
async def test_a_log_whose_certificate_does_not_verify_is_refused_in_one_clear_error_not_waited_on(
    settings, trusted, tmp_path
):
    """Before: nats-py reported the failed handshake once and its connect never returned (no socket
    left, no timer): a worker given the wrong CA hung for ever, alive and silent."""
    from infra.pki import ensure_ca
    from pipeline.errors import LogServerUntrusted

    own = stack.with_role(settings, "sampler")
    assert own.nats.tls_ca_file is not None  # the secure stack: TLS pinned to its own CA
    other_ca = ensure_ca(tmp_path / "other-ca")[0] if trusted == "another CA" else None
    wrong = own.model_copy(update={"nats": own.nats.model_copy(update={"tls_ca_file": other_ca})})
    with pytest.raises(LogServerUntrusted, match="does not trust") as refused:
        await asyncio.wait_for(EventLog.connect(wrong, worker="wrong-ca"), HANG_GUARD_S)
    assert "TLS_CA_FILE" in refused.value.hint
    assert (str(other_ca) in refused.value.hint) == (other_ca is not None)


@pytest.mark.parametrize("trusted", ["another CA", "no CA"])
def test_a_blob_store_whose_certificate_does_not_verify_is_refused_at_once_not_waited_out(settings, trusted, tmp_path):
    """botocore's certificate error is a ConnectionError: it was taken for an outage, so a write waited out
    `blobs.outage_patience_s` (2 minutes by default) and a consumer retried for 15 minutes."""
    from infra.pki import ensure_ca
    from pipeline.errors import BlobAccessDenied, BlobStoreUntrusted

    own = stack.with_role(settings, "sampler")
    assert own.blobs.ca_file is not None and own.blobs.endpoint_url.startswith("https://")
    other_ca = ensure_ca(tmp_path / "other-ca")[0] if trusted == "another CA" else None
    wrong = own.blobs.model_copy(update={"ca_file": other_ca, "max_attempts": 1})
    store = open_blob_store(wrong)
    with pytest.raises(BlobStoreUntrusted, match="does not trust") as refused:
        store.put_bytes(b"x", key=f"claims/{settings.run_id}/traj/probe")  # outage_patience_s is 120 s here
    assert isinstance(refused.value, BlobAccessDenied)  # fatal wherever a refused identity is
    assert "CA_FILE" in refused.value.hint
    with pytest.raises(BlobStoreUntrusted):
        store.get_bytes(store.uri(f"claims/{settings.run_id}/traj/probe"))

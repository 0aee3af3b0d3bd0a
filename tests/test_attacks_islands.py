"""Attacks on the trust boundaries of islands anywhere (issue 15), as a hostile island would make them with
its own credentials against the real servers. Each test states what must hold: the attack is refused,
never taken (wrong weights served, another role's cursor rewritten, a refusal hidden, a key that outlives
its token)."""

from __future__ import annotations

import asyncio
import json
import time

import nats.js.api as api
import pytest

from infra import join_token, stack
from infra.nats_auth import decode_claims
from infra.streams import apply
from pipeline.dead_letter import dead_letter_refused_version
from pipeline.errors import LogPermissionRefused
from pipeline.eventlog import EventLog
from pipeline.materialize import verify_directory
from pipeline.topology import POLICY, PROMPTS, REWARDS, TRAJECTORIES, consumer_for, follower_name
from pipeline.version_signing import VersionTrust, generate_signing_key
from schemas import DeadLetter
from schemas.envelope import new_event_id, now_utc
from tests.chain_helpers import materializer, publisher
from tests.servers import start_stack
from tests.tiny_models import tiny_moe


async def _rewritten(js, stream: str, name: str, filter_subject: str):
    """Ask the server to update consumer `name` on `stream` to read nothing (a create of an existing name
    is an update): returns the config the server now holds, or the error it answered."""
    try:
        cfg = (await js.consumer_info(stream, name, timeout=2)).config
    except Exception as exc:  # refused: not even its info
        return exc
    cfg.filter_subject, cfg.filter_subjects = filter_subject, None
    try:
        return (await js.add_consumer(stream, cfg, timeout=2)).config
    except Exception as exc:  # refused
        return exc


@pytest.mark.integration
async def test_a_sampler_cannot_rewrite_the_archivers_or_the_shared_samplers_consumer(settings, event_log):
    """One hostile island must not point the archiver's consumers (or the cursor every island shares) at
    nothing: the archiver and the other islands would sit idle, with no error anywhere."""
    run = settings.run_id
    sampler = await EventLog.connect(stack.with_role(settings, "sampler"), worker="test-hostile-island")
    nothing = f"rl.{run}.nothing.here"
    try:
        for stream, consumer in (
            (PROMPTS, consumer_for(run, "archiver", PROMPTS)),
            (POLICY, consumer_for(run, "archiver", POLICY)),
            (PROMPTS, consumer_for(run, "samplers")),
        ):
            await _rewritten(sampler.js, stream.name, consumer.name, nothing)
            held = (await event_log.js.consumer_info(stream.name, consumer.name)).config
            assert held.filter_subject != nothing, f"a sampler rewrote {consumer.name} on {stream.name}"
    finally:
        await sampler.close()


@pytest.mark.integration
async def test_a_rewards_worker_cannot_rewrite_or_delete_the_trainers_follower(settings, event_log):
    """The trainer's trajectory feed is a durable it creates itself (`follower_name`), outside the deny
    list of declared consumers: a rewards token (joinable from anywhere) must not be able to touch it."""
    run = settings.run_id
    name = follower_name(run, "trainer", TRAJECTORIES)
    config = api.ConsumerConfig(
        name=name,
        durable_name=name,
        deliver_policy=api.DeliverPolicy.ALL,
        ack_policy=api.AckPolicy.NONE,
        filter_subject=f"rl.{run}.traj.>",
        inactive_threshold=600,
    )
    await event_log.js.add_consumer(TRAJECTORIES.name, config)
    rewards = await EventLog.connect(stack.with_role(settings, "rewards"), worker="test-hostile-rewards")
    nothing = f"rl.{run}.traj.nothing.here"
    try:
        await _rewritten(rewards.js, TRAJECTORIES.name, name, nothing)
        held = (await event_log.js.consumer_info(TRAJECTORIES.name, name)).config
        assert held.filter_subject == f"rl.{run}.traj.>", "a rewards worker rewrote the trainer's feed"
        with pytest.raises(Exception):  # noqa: B017 - refused (a permission violation times out)
            await rewards.js.delete_consumer(TRAJECTORIES.name, name)
        assert (await event_log.js.consumer_info(TRAJECTORIES.name, name)).name == name
    finally:
        await rewards.close()
        await event_log.js.delete_consumer(TRAJECTORIES.name, name)


def test_the_account_and_the_users_limit_consumers_connections_and_subscriptions(settings):
    """A hostile island must not exhaust the server: the account JWT bounds consumers, connections and
    storage, and each user JWT bounds its subscriptions (every one of these is -1, unlimited, today)."""
    from infra.stack_security import StackSecurity

    security = StackSecurity(settings.state_dir / "stack")
    account = decode_claims(security.authority.account_jwt())["nats"]["limits"]
    for limit in ("consumer", "conn", "disk_storage", "subs"):
        assert account[limit] != -1, f"the account's {limit} is unlimited"
    creds = stack.with_role(settings, "sampler").nats.creds_file
    assert creds is not None
    user_jwt = creds.read_text().split("-----BEGIN NATS USER JWT-----\n", 1)[1].split("\n", 1)[0]
    assert decode_claims(user_jwt)["nats"]["subs"] != -1, "a sampler may hold unlimited subscriptions"


@pytest.mark.integration
async def test_a_sampler_cannot_plant_dead_letters_and_a_planted_one_is_called_out(settings, event_log, capsys):
    """Dead letters keep one message per subject: a letter planted where a refusal must go would hide the
    refusal from the audit. A sampler may dead-letter only messages of the streams it reads (prompts,
    versions); on those, the island that finds a planted letter in its way says so as an error (its
    refusal is counted in its heartbeat and metrics either way)."""
    run = settings.run_id
    forged_pub = publisher(event_log, settings, tiny_moe(seed=3), signing_key=generate_signing_key())
    await forged_pub.open()
    event = await forged_pub.publish(0, tiny_moe(seed=3).state_dict())  # signed by a key no island pins
    forged_pub.close()
    seq = (await event_log.js.get_last_msg(POLICY.name, f"rl.{run}.policy.v0")).seq
    sampler = await EventLog.connect(stack.with_role(settings, "sampler"), worker="test-hostile-island")

    def decoy(stream: str, original_subject: str) -> DeadLetter:
        return DeadLetter(
            run_id=run,
            event_id=new_event_id(),
            produced_at=now_utc(),
            reason="nothing to see",
            error_class="ok",
            stream=stream,
            consumer="someone",
            original_subject=original_subject,
            original_seq=seq,
            num_delivered=1,
            payload=b"",
        )

    try:
        for stream in (TRAJECTORIES, REWARDS):  # streams a sampler does not read: refused by the server
            with pytest.raises(LogPermissionRefused):
                await sampler.append(decoy(stream.label, f"rl.{run}.{stream.label}.g.t"))
        await sampler.append(decoy(POLICY.label, f"rl.{run}.policy.v0"))  # a stream it reads: taken
        stored = await dead_letter_refused_version(
            event_log,
            run_id=run,
            version=0,
            event_id=event.event_id,
            reason="signed by another key",
            error_class="version_signature_invalid",
            refused_by="honest-island",
        )
        assert not stored
        lines = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")]
        planted = [line for line in lines if line.get("event", "").startswith("the dead letter at this subject")]
        assert planted and planted[0]["level"] == "error", [line["event"] for line in lines]
    finally:
        await sampler.close()


@pytest.mark.integration
async def test_an_expired_tokens_s3_key_is_swept(settings):
    """`--ttl` ends the token on the log by itself (nats-server); S3 keys have no expiry on SeaweedFS (it
    does not evaluate time conditions), so every `sprawl token` and `sprawl stack` command, and `sprawl
    up`, deletes the S3 identities of expired tokens: after the sweep the key is refused."""
    import boto3
    from botocore.config import Config
    from botocore.exceptions import ClientError

    st = stack.status(settings)
    assert st is not None and st.secure
    issued = join_token.create_token(settings, st, "sampler", ttl_s=2, version_public_key="unused")
    token = issued.token
    s3 = boto3.client(
        "s3",
        endpoint_url=token.s3.endpoint_url,
        region_name=token.s3.region,
        aws_access_key_id=token.s3.access_key_id,
        aws_secret_access_key=token.s3.secret_access_key,
        verify=st.ca_file,
        config=Config(retries={"max_attempts": 1}, s3={"addressing_style": "path"}),
    )
    key = f"claims/{settings.run_id}/traj/written-after-expiry"
    try:
        while time.time() < token.expires_at:  # the expiry itself is what this waits for
            await asyncio.sleep(0.1)
        assert token.token_id in join_token.revoke_expired(settings, st)
        with pytest.raises(ClientError):
            s3.put_object(Bucket=token.s3.bucket, Key=key, Body=b"x")
    finally:
        join_token.revoke_token(settings, st, token.token_id)


@pytest.mark.integration
async def test_an_island_never_serves_cached_bits_that_differ_from_the_signed_version(tmp_path, settings, event_log):
    """The version cache is keyed by run id and view; a cached version is served as-is. An island that
    once followed another stack's run of the same id (the default run id is `local`; or a stack a forged
    token pointed it at) must not serve those bits as this trainer's signed version."""
    cache = tmp_path / "versions"
    other = start_stack(tmp_path / "other-stack", run_id=settings.run_id)
    try:
        other_log = await EventLog.connect(other, worker="test-other-trainer")
        await apply(other_log.js, other.streams, other.run_id)
        other_key, other_model = generate_signing_key(), tiny_moe(seed=11)
        pub = publisher(other_log, other, other_model, signing_key=other_key)
        await pub.open()
        await pub.publish(0, other_model.state_dict())
        pub.close()
        await materializer(other_log, other, cache, trust=VersionTrust(other_key.public_key())).materialize(0)
        await other_log.close()
    finally:
        stack.down(other)

    key, model = generate_signing_key(), tiny_moe(seed=12)
    pub = publisher(event_log, settings, model, signing_key=key)
    await pub.open()
    event = await pub.publish(0, model.state_dict())
    pub.close()
    signed_root = next(v.root_hash for v in event.views if v.view == "bf16")
    got = await materializer(event_log, settings, cache, trust=VersionTrust(key.public_key())).materialize(0)
    assert verify_directory(got.path) == signed_root, f"served {got.route}: bits of another trainer's v0"
    assert got.root_hash == signed_root

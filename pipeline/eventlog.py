"""The log client: one connection, one append function, claim checks both ways.

`append` is the only way events enter the log. It sets a deterministic
`Nats-Msg-Id` from the event's business key, so a producer that retries (or
crashes and re-creates the same event) is deduplicated by JetStream; it
retries timeouts and no-responders with the same id; and it can fence the
append with an expected last subject sequence, which is how a policy version
is made create-only.

Beyond the dedup window, streams that keep one message per subject (a version,
a trajectory, a reward, a dead letter: `Stream.one_message_per_subject`) refuse
a second event for the same logical id on the server. `append` tells our own
earlier attempt (the head carries our Nats-Msg-Id: a duplicate) from someone
else's (`SubjectTaken`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import ssl
import time
from dataclasses import dataclass, field
from pathlib import Path

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js import api

from pipeline.blobstore import BlobStore, open_blob_store
from pipeline.config import ConfigError, LogSettings, NatsSettings, SprawlSettings
from pipeline.errors import (
    AppendConflict,
    AppendFailed,
    AppendUnavailable,
    LogError,
    LogIdentityRefused,
    LogPermissionRefused,
    LogServerUntrusted,
    LogUnavailable,
    PoisonEvent,
    StreamNotDeclared,
    SubjectTaken,
)
from pipeline.logs import get_logger
from pipeline.subjects import subject_for
from schemas import (
    ClaimCheck,
    DeadLetter,
    Event,
    EventDecodeError,
    PolicyVersion,
    Reward,
    Trajectory,
    decode_event,
    encode_event,
)

log = get_logger(__name__)

# JetStream API error codes we act on (see nats-server's errors.json).
_ERR_WRONG_LAST_SEQUENCE = 10071
_ERR_WRONG_LAST_MSG_ID = 10070
_ERR_NO_STREAM_MATCH = 10060
_ERR_SUBJECT_FULL = 10077
_ERR_DUPLICATE_IN_PROCESS = 10158
"""'duplicate message id is in process': an earlier attempt of this append (same Nats-Msg-Id) is still
being stored (a leader change, a replica catching up). Not a refusal: it may land; asked again later,
the server answers with its position (a duplicate) or takes it."""
"""'maximum messages per subject exceeded': a one-message-per-subject stream already holds this subject."""

PUBLISH_BACKOFF_CAP_S = 1.0
"""The longest wait between two publish attempts of one append (the delay doubles up to this). Short:
while a cluster elects a stream's leader (seconds) appends find no responder, and each second of
backoff past the election is a second without appends (`sprawl bench failover`)."""

NO_ANSWER = (
    TimeoutError,  # covers nats.errors.TimeoutError and the bare asyncio timeouts nats-py sometimes raises
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.NoRespondersError,
)
"""What the client raises when the server did not answer: never "not found", always retry later."""

CLAIM_CHECK_HEADER = "Sprawl-Claim-Check"
EVENT_TYPE_HEADER = "Sprawl-Event-Type"


@dataclass(frozen=True)
class AppendResult:
    subject: str
    stream: str
    seq: int
    duplicate: bool
    """True if JetStream already had this Nats-Msg-Id: nothing new was appended."""
    claim_checked: bool
    msg_id: str


def default_producer(worker: str) -> str:
    return f"{worker}/{socket.gethostname()}/{os.getpid()}"


async def connect_nats(settings: NatsSettings, name: str) -> NATS:
    """Connect, giving up after `connect_attempts` per server with LogUnavailable; once connected,
    reconnect forever: a restarted server must not end a worker, but a server that was never there
    must not leave one alive, silent and retrying."""
    options: dict[str, object] = {
        "servers": [u.strip() for u in settings.url.split(",")],
        "name": name,
        "connect_timeout": settings.connect_timeout_s,
        "reconnect_time_wait": settings.reconnect_wait_s,
        # nats-py drops a server after max_reconnect_attempts + 1 failures, the first connect included.
        "max_reconnect_attempts": settings.connect_attempts - 1,
        "allow_reconnect": True,
        "inbox_prefix": settings.inbox_prefix,
        "ping_interval": settings.ping_interval_s,
        "max_outstanding_pings": settings.max_outstanding_pings,
    }
    if settings.user:
        options["user"] = settings.user
        options["password"] = settings.password.get_secret_value() if settings.password else ""
    if settings.creds_file:
        options["user_credentials"] = str(settings.creds_file)
    if settings.tls_ca_file:
        options["tls"] = tls_context(settings.tls_ca_file)
        if settings.tls_server_name:
            options["tls_hostname"] = settings.tls_server_name

    nc = NATS()

    async def on_disconnected() -> None:
        if not (nc.is_closed or nc.is_draining):
            log.warning("nats disconnected", url=settings.url)

    async def on_reconnected() -> None:
        log.info("nats reconnected", url=settings.url)

    watch = connection_watch(nc)

    async def on_error(exc: Exception) -> None:
        text = str(exc)
        if isinstance(exc, ssl.SSLCertVerificationError) or "CERTIFICATE_VERIFY_FAILED" in text:
            watch.untrusted_reason = text
            watch.untrusted_server.set()
            log.error("the log's TLS certificate does not verify", error=text, ca_file=str(settings.tls_ca_file))
            return
        if _refuses_identity(text):
            watch.refuse_identity(text)
            return
        if match := _PERMISSION_VIOLATION.search(text):
            watch.refused_subjects.add(match.group(2))
            log.error("the log refused this identity", operation=match.group(1), subject=match.group(2))
            return
        log.warning("nats client error", error=text)

    async def on_closed() -> None:
        # nats-py closes the client for good when a reconnect is refused for its credentials (the error
        # reaches `last_error`, not always the error callback): nobody closed it on purpose.
        cause = str(nc.last_error or "")
        if not watch.closing and _refuses_identity(cause):
            watch.refuse_identity(cause)

    callbacks = {"disconnected_cb": on_disconnected, "reconnected_cb": on_reconnected, "closed_cb": on_closed}
    # However nats-py's connect goes (it waited for ever on a server whose certificate failed to verify),
    # it ends within every attempt at every server, plus a margin.
    servers = len(options["servers"])  # type: ignore[arg-type]
    bound_s = servers * settings.connect_attempts * (2 * settings.connect_timeout_s + settings.reconnect_wait_s) + 5.0
    try:
        await _connect_unless_refused(
            nc, watch, bound_s, settings.tls_ca_file, error_cb=on_error, **callbacks, **options
        )
    except LogConnectTimedOut as exc:
        raise LogUnavailable(
            f"connecting to {settings.url} (not connected after {bound_s:.0f}s)",
            exc,
            hint="is nats-server running and reachable? `sprawl stack status` shows the local one",
        ) from exc
    except (nats.errors.NoServersError, OSError, TimeoutError) as exc:
        if watch.identity_refused.is_set() or _refuses_identity(str(nc.last_error)):
            raise LogIdentityRefused(watch.refusal_reason or str(nc.last_error)) from exc
        raise LogUnavailable(
            f"connecting to {settings.url} ({settings.connect_attempts} attempts per server)",
            exc,
            hint="is nats-server running and reachable? `sprawl stack status` shows the local one",
        ) from exc
    nc.options["max_reconnect_attempts"] = -1  # from now on a restart of the server is waited out
    return nc


_PERMISSION_VIOLATION = re.compile(r'permissions violation for (publish|subscription) to "([^"]+)"', re.IGNORECASE)


_IDENTITY_REFUSED = ("authorization violation", "authentication expired", "authentication revoked")
"""What nats-server says when it no longer accepts a client's credentials (a revoked or expired token)."""


def _refuses_identity(text: str) -> bool:
    return any(marker in text.lower() for marker in _IDENTITY_REFUSED)


@dataclass
class ConnectionWatch:
    """What the server told one connection asynchronously: which publishes it refused (a refused publish
    otherwise looks like a timeout), and whether it refused the identity itself (the client would then
    reconnect forever with credentials that can never work again, so the worker must end instead)."""

    refused_subjects: set[str] = field(default_factory=set)
    """Lowercased, as the server reports them."""
    identity_refused: asyncio.Event = field(default_factory=asyncio.Event)
    refusal_reason: str = ""
    untrusted_server: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when a TLS handshake failed on the server's certificate (the wrong CA, or none)."""
    untrusted_reason: str = ""
    closing: bool = False
    """Closed on purpose (`EventLog.close`): a close is then no refusal."""

    def refuse_identity(self, reason: str) -> None:
        if not self.identity_refused.is_set():
            self.refusal_reason = reason
            self.identity_refused.set()
            log.error("the log refused this identity (revoked, expired or unknown)", error=reason)


class LogConnectTimedOut(TimeoutError):
    """nats-py's first connect did not end within its bound."""


async def _connect_unless_refused(
    nc: NATS, watch: ConnectionWatch, bound_s: float, ca_file: Path | None, **options
) -> None:
    """`nc.connect(**options)`, ended as soon as a server refuses the credentials or presents a
    certificate that does not verify, and after `bound_s` whatever happens. Both refusals are final (a
    revoked or expired token; the wrong CA); against a cluster, nats-py would otherwise try every node it
    learns about from the others' INFO, again and again, and the first connect would never return. On a
    certificate that failed to verify it waited for ever, with no socket open."""
    connecting = asyncio.ensure_future(nc.connect(**options))
    refused = asyncio.ensure_future(watch.identity_refused.wait())
    untrusted = asyncio.ensure_future(watch.untrusted_server.wait())
    try:
        await asyncio.wait({connecting, refused, untrusted}, timeout=bound_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        refused.cancel()
        untrusted.cancel()
    if connecting.done():
        connecting.result()  # raises what the connect raised
        return
    connecting.cancel()
    with contextlib.suppress(asyncio.CancelledError, *NO_ANSWER, nats.errors.Error):
        await connecting
    with contextlib.suppress(*NO_ANSWER, nats.errors.Error):
        await nc.close()
    if watch.identity_refused.is_set():
        raise LogIdentityRefused(watch.refusal_reason)
    if watch.untrusted_server.is_set():
        raise LogServerUntrusted(", ".join(options["servers"]), watch.untrusted_reason, ca_file)
    raise LogConnectTimedOut(f"no connection within {bound_s:.0f}s")


def connection_watch(nc: NATS) -> ConnectionWatch:
    """The watch of `nc`, kept on the client itself: the server's callbacks need it before any EventLog
    wraps the connection, and tools that connect without one still get it."""
    watch = getattr(nc, "_sprawl_watch", None)
    if watch is None:
        watch = ConnectionWatch()
        nc._sprawl_watch = watch  # type: ignore[attr-defined]
    return watch


def refused_subjects(nc: NATS) -> set[str]:
    return connection_watch(nc).refused_subjects


def tls_context(ca_file: Path) -> ssl.SSLContext:
    """A client context that trusts only `ca_file` (the stack's own CA, not the system's store), checks
    the server's name and speaks TLS 1.2 or later."""
    try:
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(ca_file))
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(
            f"cannot read the NATS CA certificate {ca_file}: {exc}", hint="check nats.tls_ca_file"
        ) from exc
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


class EventLog:
    """Append to and read from the log; holds the NATS connection and the blob store for claim checks."""

    def __init__(self, nc: NATS, blobs: BlobStore | None, settings: LogSettings, producer: str):
        self.nc = nc
        self.js = nc.jetstream(timeout=settings.publish_timeout_s)
        self.blobs = blobs
        self.settings = settings
        self.producer = producer
        self.append_patience_s: float | None = None
        """The default `patience_s` of this log's appends (see `append`): set by a process whose every
        append must wait out an outage rather than fail (the trainer)."""

    @classmethod
    async def connect(cls, settings: SprawlSettings, worker: str) -> EventLog:
        producer = default_producer(worker)
        nc = await connect_nats(settings.nats, name=producer)
        return cls(nc, open_blob_store(settings.blobs), settings.log, producer)

    async def wait_identity_refused(self) -> None:
        """Return never; raise LogIdentityRefused once the server refuses this connection's credentials."""
        watch = connection_watch(self.nc)
        await watch.identity_refused.wait()
        raise LogIdentityRefused(watch.refusal_reason)

    async def close(self) -> None:
        # Every publish and ack we make is awaited, so there is nothing in flight to drain; a drain
        # would wait out pending pull requests instead.
        connection_watch(self.nc).closing = True
        if not self.nc.is_closed:
            with contextlib.suppress(nats.errors.Error):
                await self.nc.flush(timeout=2)
            # With the server gone, nats-py's close writes what it buffered while reconnecting onto the
            # dead socket and raises ConnectionResetError; by then the client is already CLOSED (no more
            # reconnects), which is all closing means here. Over TLS the same write meets asyncio's SSL
            # transport already torn down and raises AttributeError (`_ssl_protocol` is None) instead.
            with contextlib.suppress(ConnectionError, AttributeError):
                await self.nc.close()

    # ---------------------------------------------------------------- append

    def msg_id(self, event: Event) -> str:
        return f"{event.run_id}:{event.business_key()}"

    async def append(
        self,
        event: Event,
        *,
        expected_last_subject_seq: int | None = None,
        fence_subject: str | None = None,
        subject: str | None = None,
        patience_s: float | None = None,
    ) -> AppendResult:
        """Append one event and return where it landed.

        `patience_s`: how long to keep retrying (the same Nats-Msg-Id, so safely) while the log takes no
        appends (a server restart or outage), with a warning repeated while it lasts, before raising
        AppendUnavailable. None: `publish_attempts` attempts only. A producer that cannot usefully do
        anything else until its event is in the log (the trainer) waits; one that can retry later fails fast.

        `expected_last_subject_seq` makes the append conditional: JetStream
        refuses it unless the last message on `fence_subject` (default: the
        event's own subject; wildcards allowed) has that sequence (0 = none).
        A refusal raises AppendConflict and is never retried.
        """
        subject = subject or subject_for(event)
        if not event.producer:
            event = _with_producer(event, self.producer)
        data = encode_event(event)
        claim_checked = False
        headers = {"Nats-Msg-Id": self.msg_id(event), EVENT_TYPE_HEADER: type(event).type_tag()}
        if len(data) > self.settings.claim_check_threshold_bytes:
            data = await self._claim_check(event, data, subject)
            headers[CLAIM_CHECK_HEADER] = "1"
            claim_checked = True
        if expected_last_subject_seq is not None:
            headers["Nats-Expected-Last-Subject-Sequence"] = str(expected_last_subject_seq)
            if fence_subject is not None:
                headers["Nats-Expected-Last-Subject-Sequence-Subject"] = fence_subject
        try:
            patience = self.append_patience_s if patience_s is None else patience_s
            ack = await self._publish_patiently(subject, data, headers, expected_last_subject_seq, patience)
        except _SubjectFull as full:
            # The subject holds a message and the dedup window did not call ours a duplicate: either our
            # own earlier attempt landed longer ago than the window (its ack lost, or the producer
            # restarted and re-created the event), or someone else's event holds the subject.
            ack, holder = await self._head_of(subject, headers["Nats-Msg-Id"])
            if ack is None:
                raise SubjectTaken(subject, _kind_of(event), _logical_id(event), holder) from full.__cause__
        except AppendConflict:
            # JetStream checks the expected sequence before the dedup window, so our own earlier
            # attempt (landed, ack lost) looks like a conflict. If the head is ours, it is a duplicate.
            ack, _ = await self._head_of(subject, headers["Nats-Msg-Id"])
            if ack is None:
                raise
        if ack.duplicate:
            log.info("append deduplicated", subject=subject, msg_id=headers["Nats-Msg-Id"], stream_seq=ack.seq)
        return AppendResult(
            subject=subject,
            stream=ack.stream,
            seq=ack.seq,
            duplicate=bool(ack.duplicate),
            claim_checked=claim_checked,
            msg_id=headers["Nats-Msg-Id"],
        )

    async def _head_of(self, subject: str, msg_id: str) -> tuple[api.PubAck | None, str | None]:
        """(our own earlier append at the head of `subject` as a duplicate ack, or None when the head is
        not ours or there is none; the head's Nats-Msg-Id). A head we could not read raises
        LogUnavailable: not knowing is not "someone else's", and the same Nats-Msg-Id makes retrying
        the append safe."""
        try:
            stream = await self.js.find_stream_name_by_subject(subject)
            last = await self.js.get_last_msg(stream, subject)
        except nats.js.errors.NotFoundError:
            return None, None
        except NO_ANSWER as exc:
            raise LogUnavailable(f"reading the head of {subject} to tell our own append from a rival's", exc) from exc
        holder = (last.headers or {}).get("Nats-Msg-Id")
        if holder != msg_id:
            return None, holder
        return api.PubAck(stream=stream, seq=last.seq, duplicate=True), holder

    async def _claim_check(self, event: Event, data: bytes, subject: str) -> bytes:
        """Blob first, event second: the pointer is only published once the blob is durable.

        Under `claims/<run>/<kind>/` (the subject's kind token: `traj`, `reward`, ...), so that an S3
        identity may write only the claims of the kinds its role publishes and read only those it
        consumes (infra/s3_identities.py)."""
        if self.blobs is None:
            raise AppendFailed(
                f"event {event.event_id} is {len(data)} bytes, above the claim-check threshold, "
                "and this log has no blob store",
                hint="open the EventLog with a blob store",
            )
        if len(data) > self.settings.max_claim_bytes:  # every reader would refuse it: say so here, once
            raise AppendFailed(
                f"event {event.event_id} is {len(data)} bytes, above log.max_claim_bytes="
                f"{self.settings.max_claim_bytes}: its readers would refuse it",
                hint="make the event smaller, or raise log.max_claim_bytes for every worker of the run",
            )
        kind = subject.split(".")[2]  # rl.<run>.<kind>[.<qualifier>...]
        ref = await asyncio.to_thread(self.blobs.put_bytes, data, prefix=claims_prefix(event.run_id, kind))
        claim = ClaimCheck(
            run_id=event.run_id,
            event_id=event.event_id,
            producer=event.producer,
            event_type=type(event).type_tag(),
            uri=ref.uri,
            sha256=ref.checksum,
            bytes=ref.bytes,
        )
        return encode_event(claim)

    async def _publish_patiently(
        self, subject: str, data: bytes, headers: dict[str, str], expected_seq: int | None, patience_s: float | None
    ):
        started = time.monotonic()
        while True:
            try:
                return await self._publish_with_retries(subject, data, headers, expected_seq)
            except AppendUnavailable:
                waited = time.monotonic() - started
                if patience_s is None or waited >= patience_s:
                    raise
                log.warning(
                    "the log takes no appends; waiting for it",
                    subject=subject,
                    waited_s=round(waited, 1),
                    patience_s=patience_s,
                )

    async def _publish_with_retries(self, subject: str, data: bytes, headers: dict[str, str], expected_seq: int | None):
        delay = self.settings.publish_backoff_s
        last_error: Exception | None = None
        for attempt in range(1, self.settings.publish_attempts + 1):
            try:
                return await self.js.publish(subject, data, headers=headers, timeout=self.settings.publish_timeout_s)
            except nats.js.errors.APIError as exc:
                if exc.err_code in (_ERR_WRONG_LAST_SEQUENCE, _ERR_WRONG_LAST_MSG_ID):
                    raise AppendConflict(subject, expected_seq or 0, exc.description or str(exc)) from exc
                if exc.err_code == _ERR_NO_STREAM_MATCH:
                    raise StreamNotDeclared(subject) from exc
                if exc.err_code == _ERR_SUBJECT_FULL:
                    raise _SubjectFull(subject) from exc  # a verdict, not a hiccup: never retried
                # A 503 (JetStream busy electing a leader) is no answer either, like no responders.
                busy = isinstance(exc, nats.js.errors.ServiceUnavailableError)
                if not busy and exc.err_code != _ERR_DUPLICATE_IN_PROCESS:
                    raise AppendFailed(f"JetStream refused the append to {subject}: {exc}") from exc
                last_error = exc  # an earlier attempt is still being stored: asked again
            except (nats.errors.NoRespondersError, nats.js.errors.NoStreamResponseError) as exc:
                # No stream listens (yet): either it is not declared or the server is restarting.
                last_error = exc
            except (
                TimeoutError,
                nats.errors.ConnectionClosedError,
                nats.errors.ConnectionReconnectingError,
                nats.errors.OutboundBufferLimitError,
            ) as exc:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    # nats-py can turn our cancellation into a timeout: a stopping worker must stop.
                    raise asyncio.CancelledError from exc
                if subject.lower() in connection_watch(self.nc).refused_subjects:
                    raise LogPermissionRefused(subject) from exc
                last_error = exc
            log.warning("append retry", subject=subject, attempt=attempt, error=type(last_error).__name__)
            await asyncio.sleep(delay)
            delay = min(delay * 2, PUBLISH_BACKOFF_CAP_S)
        if isinstance(
            last_error, nats.errors.NoRespondersError | nats.js.errors.NoStreamResponseError
        ) and await self._no_stream_holds(subject):
            raise StreamNotDeclared(subject) from last_error
        raise AppendUnavailable(subject, self.settings.publish_attempts, last_error) from last_error

    async def _no_stream_holds(self, subject: str) -> bool:
        """True only on the server's word that no stream listens on `subject`. No responders alone also
        happens while a restarted server recovers its streams: that is an outage, not a missing stream."""
        try:
            await self.js.find_stream_name_by_subject(subject)
        except nats.js.errors.NotFoundError:
            return True
        except (*NO_ANSWER, nats.js.errors.ServiceUnavailableError, nats.js.errors.APIError):
            return False
        return False

    # ---------------------------------------------------------------- read

    async def resolve(self, data: bytes, subject: str | None = None) -> Event:
        """Decode a message body, fetching and verifying claim-checked events from the blob store.

        With `subject` (the subject the message arrived on), the event must be one that travels
        there: its run, kind and qualifiers (group, version, ...) are checked against the subject,
        so a body claiming another run or group than its subject is refused as poison
        (`subject_mismatch`) instead of being acted on in the wrong place.

        Raises PoisonEvent for anything that can never decode (malformed,
        unknown type, failed validation, a claim whose blob is corrupt or gone, or that points outside
        this run's claims).
        Other blob-store errors propagate: BlobStoreUnavailable is a TransientError, so
        the caller retries.
        """
        from pipeline.errors import BlobIntegrityError, BlobNotFound, BlobTooLarge

        try:
            event = decode_event(data)
        except EventDecodeError as exc:
            # The category is the dead letter's error class: the reason does not repeat it.
            raise PoisonEvent(exc.message, error_class=exc.category) from exc
        if not isinstance(event, ClaimCheck):
            return _on_its_subject(event, subject)
        if self.blobs is None:
            raise LogError(
                f"received claim-checked event {event.event_id} but this log has no blob store to fetch {event.uri}",
                hint="open the EventLog with a blob store (EventLog.connect does)",
            )
        own_claims = self.blobs.uri(f"claims/{event.run_id}/")
        if not event.uri.startswith(own_claims):
            # Producers put claims under this prefix of the run's store (`_claim_check`). A pointer anywhere
            # else (another bucket, another run, another host) is forged or misrouted: refusing it before any
            # GET also keeps a forged event from making every reader fetch what it names. It is poison, not a
            # fatal "bucket missing": our own store is fine, the message is not.
            raise PoisonEvent(
                f"claim check {event.uri} is outside this run's claims ({own_claims}...)",
                error_class="claim_check_foreign",
            )
        limit = self.settings.max_claim_bytes
        if event.bytes > limit:  # refused before any GET: a claim's size is what its readers will hold
            raise PoisonEvent(
                f"claim check {event.uri} says its event is {event.bytes} bytes, above log.max_claim_bytes={limit}",
                error_class="claim_check_oversized",
            )
        try:
            # Never more than the claim says: a blob swapped for a larger one is not read to its end.
            body = await asyncio.to_thread(
                self.blobs.get_bytes, event.uri, expected=event.sha256, max_bytes=event.bytes
            )
        except BlobTooLarge as exc:
            raise PoisonEvent(str(exc), error_class="claim_check_oversized") from exc
        except BlobIntegrityError as exc:
            raise PoisonEvent(str(exc), error_class="claim_check_corrupt") from exc
        except BlobNotFound as exc:
            raise PoisonEvent(str(exc), error_class="claim_check_missing") from exc
        try:
            inner = decode_event(body)
        except EventDecodeError as exc:
            raise PoisonEvent(f"claim-checked body: {exc.message}", error_class=exc.category) from exc
        if type(inner).type_tag() != event.event_type or inner.event_id != event.event_id:
            raise PoisonEvent(
                f"claim check {event.uri} promised {event.event_type} {event.event_id}, "
                f"blob holds {type(inner).type_tag()} {inner.event_id}",
                error_class="claim_check_mismatch",
            )
        return _on_its_subject(inner, subject)


def publish_retry_span_s(settings: LogSettings) -> float:
    """The longest one append keeps publishing one Nats-Msg-Id: every attempt waiting out its timeout,
    and the backoff after each (the schedule of `_publish_with_retries`). A dedup window shorter than
    this could forget the id while the append still retries it."""
    span, delay = 0.0, settings.publish_backoff_s
    for _ in range(settings.publish_attempts):
        span += settings.publish_timeout_s + delay
        delay = min(delay * 2, PUBLISH_BACKOFF_CAP_S)
    return span


class _SubjectFull(Exception):
    """The server's "maximum messages per subject exceeded"; `append` turns it into a duplicate or a
    SubjectTaken once it has read whose message holds the subject."""


def claims_prefix(run_id: str, kind: str) -> str:
    """`claims/<run>/<kind>`: where the claim checks of one kind of event go (`kind`: the subject's kind
    token, e.g. `traj`). One prefix per kind, so S3 grants can follow who publishes and who reads each
    kind. Claims written before this layout (`claims/<run>/<digest[:2]>/...`) still resolve: `resolve`
    accepts anything under `claims/<run>/`."""
    return f"claims/{run_id}/{kind}"


def _kind_of(event: Event) -> str:
    """`trajectory` of `trajectory.v1`: what the log holds, in words."""
    return type(event).type_tag().rsplit(".v", 1)[0].replace("_", " ")


def _logical_id(event: Event) -> str:
    """What a one-message-per-subject stream keeps one event for, in words."""
    match event:
        case PolicyVersion():
            return f"version {event.version}"
        case Trajectory() | Reward():
            return f"trajectory {event.trajectory_id}"
        case DeadLetter():
            return f"message {event.original_seq} of {event.stream}"
    return event.business_key()


def _on_its_subject(event: Event, subject: str | None) -> Event:
    """The event, if it belongs on `subject` (or no subject is given); PoisonEvent otherwise."""
    if subject is None:
        return event
    try:
        expected = subject_for(event)
    except ValueError as exc:  # an id that cannot be a subject token never travelled on a valid subject
        raise PoisonEvent(f"{type(event).type_tag()} on {subject}: {exc}", error_class="subject_mismatch") from exc
    if expected != subject:
        raise PoisonEvent(
            f"{type(event).type_tag()} {event.event_id} arrived on {subject} but belongs on {expected} "
            "(its run, group or version disagree with the subject)",
            error_class="subject_mismatch",
        )
    return event


def _with_producer(event: Event, producer: str) -> Event:
    import msgspec

    return msgspec.structs.replace(event, producer=producer)

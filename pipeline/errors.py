"""Typed errors: each says what was refused, with its context, and what to do about it."""

from __future__ import annotations


class SprawlError(Exception):
    """Base of every error sprawl raises on purpose. `hint` says what to do."""

    def __init__(self, message: str, *, hint: str = ""):
        self.message = message
        self.hint = hint
        super().__init__(f"{message} ({hint})" if hint else message)


class TransientError(SprawlError):
    """Retry later, with backoff: a dependency (the log, the object store, a peer) did not answer or
    is not ready yet, and the same operation may succeed unchanged once it does.

    Never a verdict about the data: a timeout is not "not found". A consumer handler that raises one
    is nak'ed with backoff (`retry_after_s`, when given, is the least delay), and a worker loop waits
    and tries again instead of exiting.
    """

    def __init__(self, message: str, *, hint: str = "", retry_after_s: float | None = None):
        self.retry_after_s = retry_after_s
        super().__init__(message, hint=hint or "transient: retry later, with backoff")


Retryable = TransientError
"""The same class under the name the restructuring issue uses."""


# ------------------------------------------------------------------ blob store


class BlobStoreError(SprawlError):
    pass


class BlobNotFound(BlobStoreError):
    def __init__(self, uri: str):
        self.uri = uri
        super().__init__(f"blob {uri} does not exist", hint="was it written before the event that names it?")


class BucketNotFound(BlobStoreError):
    def __init__(self, bucket: str, endpoint: str | None):
        self.bucket = bucket
        super().__init__(
            f"bucket {bucket!r} does not exist at {endpoint or 'the default S3 endpoint'}",
            hint="create it, or start the local stack with `sprawl stack up`, which creates its buckets",
        )


class BlobAccessDenied(BlobStoreError):
    def __init__(self, uri: str, code: str, endpoint: str | None):
        self.uri = uri
        super().__init__(
            f"S3 refused access to {uri} ({code}) at {endpoint or 'the default S3 endpoint'}",
            hint="check SPRAWL_BLOBS__ACCESS_KEY_ID / SPRAWL_BLOBS__SECRET_ACCESS_KEY",
        )


class BlobIntegrityError(BlobStoreError):
    def __init__(self, uri: str, algorithm: str, expected: str, actual: str):
        self.uri, self.expected, self.actual = uri, expected, actual
        super().__init__(
            f"blob {uri} failed verification: {algorithm} is {actual}, expected {expected}",
            hint="the object was altered or truncated after it was written; do not use it",
        )


class BlobTooLarge(BlobIntegrityError):
    """A blob that holds more bytes than the pointer naming it says: not the blob meant, and not read on
    (a swapped or forged object could be any size; reading it whole could exhaust memory or disk)."""

    def __init__(self, uri: str, limit: int):
        self.uri, self.limit = uri, limit
        self.expected, self.actual = f"{limit} bytes at most", f"more than {limit} bytes"
        BlobStoreError.__init__(
            self,
            f"blob {uri} holds more than the {limit} bytes it may: not read further",
            hint="the object was replaced or the pointer forged; do not use it",
        )


class BlobStoreUntrusted(BlobAccessDenied):
    """The store's TLS certificate does not verify against the CA this worker trusts: fatal like a refused
    identity (every retry gets the same certificate), never waited out as an outage."""

    def __init__(self, endpoint: str | None, reason: str, ca_file: object | None):
        self.uri, self.endpoint = endpoint or "", endpoint
        trusted = f"blobs.ca_file={ca_file}" if ca_file else "the system's trust store (no blobs.ca_file)"
        BlobStoreError.__init__(
            self,
            f"the blob store at {endpoint or 'the default S3 endpoint'} presented a TLS certificate this worker "
            f"does not trust: {reason}",
            hint=f"it was checked against {trusted}; point SPRAWL_BLOBS__CA_FILE at the run's CA (the local "
            "stack's is <state dir>/stack/tls/ca.pem; a join token carries it)",
        )


class UnknownBlobBackend(BlobStoreError):
    def __init__(self, backend: str, registered: list[str]):
        self.backend = backend
        super().__init__(
            f"no blob store backend is registered for type {backend!r} (registered: {', '.join(registered)})",
            hint="set `blobs.type` to one of those, or register the backend with `register_blob_backend`",
        )


class BlobStoreUnavailable(BlobStoreError, TransientError):
    """The object store did not answer (connection refused, timed out, throttled): retry later."""

    def __init__(self, endpoint: str | None, cause: str):
        self.endpoint = endpoint
        super().__init__(
            f"S3 endpoint {endpoint or '(default)'} is unreachable: {cause}",
            hint="is the object store running? `sprawl stack status` shows the local one",
        )


# ------------------------------------------------------------------ log


class LogError(SprawlError):
    pass


class AppendConflict(LogError):
    """A create-only or fenced append found someone else's event where it expected none.

    Fatal, never retried: it means a second writer (e.g. a second trainer) exists.
    """

    def __init__(self, subject: str, expected_last_seq: int, detail: str):
        self.subject = subject
        self.expected_last_seq = expected_last_seq
        super().__init__(
            f"append to {subject} refused: expected last subject sequence {expected_last_seq}, "
            f"but the stream has moved on ({detail})",
            hint="another writer appended first; a second trainer must not fork the chain, stop one of them",
        )


class AppendFailed(LogError):
    pass


class LogIdentityRefused(LogError):
    """The log no longer accepts this worker's credentials (its token was revoked or expired): fatal,
    since reconnecting with them can never succeed."""

    def __init__(self, reason: str):
        super().__init__(
            f"the log refused this worker's identity: {reason}",
            hint="its join token was revoked or has expired: ask the run's owner for a new one (`sprawl token create`)",
        )


class LogServerUntrusted(LogError):
    """The log's TLS certificate does not verify against the CA this worker trusts: fatal, since every
    reconnect gets the same certificate (nats-py would otherwise wait on a connect that never ends)."""

    def __init__(self, url: str, reason: str, ca_file: object | None):
        trusted = f"nats.tls_ca_file={ca_file}" if ca_file else "the system's trust store (no nats.tls_ca_file)"
        super().__init__(
            f"the log at {url} presented a TLS certificate this worker does not trust: {reason}",
            hint=f"it was checked against {trusted}; point SPRAWL_NATS__TLS_CA_FILE at the run's CA (the local "
            "stack's is <state dir>/stack/tls/ca.pem; a join token carries it)",
        )


class LogPermissionRefused(AppendFailed):
    """The server refused this identity a publish (its role has no such permission): fatal, never
    retried, since the same credentials get the same answer."""

    def __init__(self, subject: str):
        self.subject = subject
        super().__init__(
            f"the log refused this identity permission to publish to {subject}",
            hint="this worker runs with another role's credentials or an outdated token: check nats.creds_file "
            "or ask for a token of the right role (`sprawl token create --role ...`)",
        )


class LogUnavailable(LogError, TransientError):
    """The log did not answer (timeout, reconnecting, no responders): retry later, never read as absence."""

    def __init__(self, operation: str, cause: BaseException | str, *, hint: str = ""):
        self.operation = operation
        self.cause = cause if isinstance(cause, str) else _describe(cause)
        super().__init__(
            f"the log did not answer while {operation}: {self.cause}",
            hint=hint or "is nats-server reachable? `sprawl stack status` shows the local one; retry with backoff",
        )


class AppendUnavailable(AppendFailed, LogUnavailable):
    """An append that ran out of attempts without an answer; the same Nats-Msg-Id makes a retry safe."""

    def __init__(self, subject: str, attempts: int, cause: BaseException | None):
        self.subject = subject
        super().__init__(
            f"appending to {subject} ({attempts} attempts)",
            cause or "no answer",
            hint="is nats-server reachable? the same Nats-Msg-Id makes a later retry safe",
        )


class StreamNotDeclared(LogError):
    def __init__(self, subject: str):
        super().__init__(
            f"no stream captures subject {subject!r}",
            hint="declare streams and consumers with `sprawl infra apply`",
        )


class ConsumerNotDeclared(LogError):
    def __init__(self, stream: str, consumer: str):
        super().__init__(
            f"consumer {consumer!r} is not declared on stream {stream!r}",
            hint="workers never create consumers; run `sprawl infra apply --run <run>` first",
        )


class PoisonEvent(SprawlError):
    """Raised by a handler (or the decoder) for an event that can never succeed: dead-letter it."""

    def __init__(self, message: str, *, error_class: str = "poison"):
        self.error_class = error_class
        super().__init__(message)


# ------------------------------------------------------------------ views


class UnknownView(SprawlError, ValueError):
    """A view name nobody registered. Also a ValueError, so config validators report it as invalid input."""

    def __init__(self, name: str, registered: list[str]):
        self.name = name
        super().__init__(
            f"unknown view {name!r}; registered views: {', '.join(registered)}",
            hint="name one of those in `chain.views`, or add a view module under pipeline/views/ and register it",
        )


# ------------------------------------------------------------------ stack


class StackError(SprawlError):
    pass


def _describe(exc: BaseException) -> str:
    """`Type: message`, or just `Type` for the many nats-py errors whose message is empty."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# ------------------------------------------------------------------ log: one message per subject


class SubjectTaken(AppendConflict):
    """The server refused an append because its subject already holds a message, and that message is
    not ours (another Nats-Msg-Id): the log keeps one event per logical id (a policy version, a
    trajectory, a reward, a dead letter), and someone else's is already there. Never retried."""

    def __init__(self, subject: str, kind: str, logical_id: str, holder_msg_id: str | None):
        self.subject = subject
        self.expected_last_seq = None
        self.kind = kind
        self.logical_id = logical_id
        self.holder_msg_id = holder_msg_id
        holder = f" (stored under message id {holder_msg_id!r})" if holder_msg_id else ""
        LogError.__init__(
            self,
            f"the log already holds a {kind} for {logical_id}: append to {subject} refused{holder}",
            hint="a subject keeps one event; this one was produced a second time under another message id "
            "(a rival writer, or a producer that re-created it with another key): keep the stored one, do not retry",
        )


class StreamUpgradeRefused(LogError):
    """Applying a stream's declared config to the server would delete history it holds."""

    def __init__(self, stream: str, detail: str):
        self.stream = stream
        super().__init__(
            f"stream {stream} cannot take one message per subject: {detail}; the server would delete "
            "all but the newest message on each such subject",
            hint="these are messages of an older subject layout: archive what you need, then start from a fresh "
            "store (`sprawl stack down`, remove the stack's nats directory) or apply to another server",
        )


# ------------------------------------------------------------------ worker lifecycle


class WorkerPartFailed(SprawlError):
    """A part of a worker that must live as long as the worker (a feed, the lease, a projection, a
    heartbeat loop) failed or ended: the process stops non-zero with this one line, so its supervisor
    restarts it, instead of living on with a dead part."""

    def __init__(self, part: str, cause: BaseException | None):
        self.part = part
        if cause is None:
            super().__init__(f"{part} ended while the worker was running", hint="see the log lines before it")
        else:
            detail, hint = (cause.message, cause.hint) if isinstance(cause, SprawlError) else (_describe(cause), "")
            super().__init__(f"{part} failed: {detail}", hint=hint or "see the log lines before it")

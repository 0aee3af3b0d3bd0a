"""Typed errors: each says what was refused, with its context, and what to do about it."""

from __future__ import annotations


class SprawlError(Exception):
    """Base of every error sprawl raises on purpose. `hint` says what to do."""

    def __init__(self, message: str, *, hint: str = ""):
        self.message = message
        self.hint = hint
        super().__init__(f"{message} ({hint})" if hint else message)


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


class BlobStoreUnavailable(BlobStoreError):
    def __init__(self, endpoint: str | None, cause: str):
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


# ------------------------------------------------------------------ stack


class StackError(SprawlError):
    pass

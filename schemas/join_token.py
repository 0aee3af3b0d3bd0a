"""A join token: everything a worker on another network needs to take part in one run as one role.

`sprawl token create --role sampler` prints one; `sprawl sampler --join TOKEN` needs nothing else.
The text is `sprawl-join.v1.` followed by the base64url (unpadded) JSON of `JoinToken`: opaque to
users, plain to read for anyone holding it, so it is a secret (it holds the identity's private key
and S3 secret) and expires (`expires_at`).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from schemas.envelope import NonEmpty

JOIN_TOKEN_PREFIX = "sprawl-join.v1."

UnixSeconds = Annotated[int, msgspec.Meta(ge=0)]


class JoinS3(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The blob store as this identity reaches it."""

    endpoint_url: str | None
    region: NonEmpty
    bucket: NonEmpty
    access_key_id: NonEmpty
    secret_access_key: NonEmpty
    ca_pem: str = ""
    """The CA of an https endpoint that is the stack's own; empty: the system's trust store."""


class JoinToken(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    token_id: NonEmpty
    """Names this token in `sprawl token list` / `revoke` (not a secret)."""
    run_id: NonEmpty
    role: NonEmpty
    nats_urls: list[NonEmpty]
    nats_ca_pem: NonEmpty
    """The stack's CA: the only one the worker trusts for the log."""
    nats_server_name: str = ""
    """The name to verify the server's certificate against, when it is not the URL's host."""
    nats_creds: NonEmpty
    """The NATS creds text (user JWT and nkey seed) of this token's own identity."""
    inbox_prefix: NonEmpty
    s3: JoinS3
    version_public_key: str
    """The trainer's Ed25519 key that every version the worker serves must be signed by."""
    expires_at: UnixSeconds | None = None
    issued_at: UnixSeconds = 0

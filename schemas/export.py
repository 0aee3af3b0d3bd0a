"""Export the JSON Schema of every event type and every layout to `schemas/json/` (committed, checked by a test)."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from schemas.archive import ArchiveKey
from schemas.events import CURRENT_EVENTS
from schemas.join_token import JoinToken
from schemas.lineage import Lineage
from schemas.upcasters import LEGACY_EVENTS
from schemas.version_manifest import VersionManifest

JSON_DIR = Path(__file__).parent / "json"

LAYOUTS: dict[str, type[msgspec.Struct]] = {
    "lineage.v1": Lineage,
    "archive_key.v1": ArchiveKey,
    "version_manifest.v1": VersionManifest,
    "join_token.v1": JoinToken,
}
"""Layouts that cross processes without being events (blobs, object keys), by file name. Named like
event types so a breaking change gets a new `.vN` beside the old one."""


DIALECT = "https://json-schema.org/draft/2020-12/schema"
"""msgspec writes Draft 2020-12 (`$defs`, `prefixItems`); saying so lets a generic validator pick the dialect."""

EVENT_NOTE = (
    "Every constraint the decoder enforces is in this schema, except the rules between fields that a "
    "description marks '(checked by the decoder)', and two about numbers: write integers without a fraction "
    "(1, not 1.0: JSON Schema counts 1.0 as an integer, the decoder does not), and no number beyond a 64-bit "
    "float. Unknown fields are ignored (evolution is additive)."
)
"""What a client in another language needs to know beyond the schema (tests/test_schema_contract.py pins it)."""


def rendered_schemas() -> dict[str, str]:
    """File name -> file text for every current and legacy event type and every layout."""
    events = {cls.type_tag(): cls for cls in CURRENT_EVENTS + LEGACY_EVENTS}
    rendered = {}
    for name, cls in (events | LAYOUTS).items():
        schema = {"$schema": DIALECT, **msgspec.json.schema(cls)}
        if name in events:
            schema["$comment"] = EVENT_NOTE
        rendered[f"{name}.json"] = json.dumps(schema, indent=2, sort_keys=True) + "\n"
    return rendered


def write_schemas(directory: Path = JSON_DIR) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in rendered_schemas().items():
        path = directory / name
        path.write_text(text)
        written.append(path)
    for stale in set(directory.glob("*.json")) - set(written):
        stale.unlink()
    return written

"""Export the JSON Schema of every event type and every layout to `schemas/json/` (committed, checked by a test)."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from schemas.archive import ArchiveKey
from schemas.events import CURRENT_EVENTS
from schemas.lineage import Lineage
from schemas.upcasters import LEGACY_EVENTS

JSON_DIR = Path(__file__).parent / "json"

LAYOUTS: dict[str, type[msgspec.Struct]] = {
    "lineage.v1": Lineage,
    "archive_key.v1": ArchiveKey,
}
"""Layouts that cross processes without being events (blobs, object keys), by file name. Named like
event types so a breaking change gets a new `.vN` beside the old one."""


def rendered_schemas() -> dict[str, str]:
    """File name -> file text for every current and legacy event type and every layout."""
    named = {cls.type_tag(): cls for cls in CURRENT_EVENTS + LEGACY_EVENTS} | LAYOUTS
    return {
        f"{name}.json": json.dumps(msgspec.json.schema(cls), indent=2, sort_keys=True) + "\n"
        for name, cls in named.items()
    }


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

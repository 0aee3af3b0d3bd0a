"""Export the JSON Schema of every event type to `schemas/json/` (committed, checked by a test)."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from schemas.events import CURRENT_EVENTS
from schemas.upcasters import LEGACY_EVENTS

JSON_DIR = Path(__file__).parent / "json"


def rendered_schemas() -> dict[str, str]:
    """File name -> file text for every current and legacy event type."""
    files = {}
    for cls in CURRENT_EVENTS + LEGACY_EVENTS:
        schema = msgspec.json.schema(cls)
        files[f"{cls.type_tag()}.json"] = json.dumps(schema, indent=2, sort_keys=True) + "\n"
    return files


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

"""The fault suite's fixtures: one warmed-up base policy shared by every run of the session."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the base policy is warmed up once (each run of the suite has its own stack and state)."""
    return tmp_path_factory.mktemp("fault-models")

from pathlib import Path

import pytest
from pydantic import BaseModel

from infra.stack import StackSettings
from pipeline.config import LocalBlobSettings, S3BlobSettings, SprawlSettings, load_settings


def _models(model: type[BaseModel], seen: set) -> list[type[BaseModel]]:
    found = [model]
    seen.add(model)
    for field in model.model_fields.values():
        for arg in _flatten(field.annotation):
            if isinstance(arg, type) and issubclass(arg, BaseModel) and arg not in seen:
                found += _models(arg, seen)
    return found


def _flatten(annotation) -> list:
    args = getattr(annotation, "__args__", None) or getattr(annotation, "__metadata__", None)
    if not args:
        return [annotation]
    out = [annotation] if isinstance(annotation, type) else []
    for arg in args:
        out += _flatten(arg)
    return out


def test_every_settings_field_is_documented():
    models = [*_models(StackSettings, set()), S3BlobSettings, LocalBlobSettings]
    undocumented = [
        f"{m.__name__}.{name}"
        for m in models
        for name, f in m.model_fields.items()
        if name != "type" and not f.description
    ]
    assert undocumented == []


def test_precedence_arguments_over_env_over_toml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    toml = tmp_path / "sprawl.toml"
    toml.write_text('run_id = "from-toml"\n[nats]\nurl = "nats://toml:1"\nconnect_timeout_s = 9.0\n')
    monkeypatch.setenv("SPRAWL_NATS__URL", "nats://env:2")
    settings = load_settings(SprawlSettings, toml)
    assert settings.run_id == "from-toml"
    assert settings.nats.url == "nats://env:2"
    assert settings.nats.connect_timeout_s == 9.0
    assert load_settings(SprawlSettings, toml, run_id="explicit").run_id == "explicit"


def test_blob_backend_is_a_discriminated_union(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("SPRAWL_BLOBS__ENDPOINT_URL", "https://s3.example.invalid")
    assert isinstance(load_settings(SprawlSettings).blobs, S3BlobSettings)
    monkeypatch.setenv("SPRAWL_BLOBS__TYPE", "local")
    monkeypatch.delenv("SPRAWL_BLOBS__ENDPOINT_URL")
    assert isinstance(load_settings(SprawlSettings).blobs, LocalBlobSettings)


def test_unknown_keys_and_missing_files_are_refused(tmp_path: Path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[nats]\nulr = "typo"\n')
    with pytest.raises(ValueError, match="ulr"):
        load_settings(SprawlSettings, bad)
    with pytest.raises(FileNotFoundError):
        load_settings(SprawlSettings, tmp_path / "absent.toml")

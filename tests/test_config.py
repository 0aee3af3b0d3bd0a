import os
import stat
import tomllib
from pathlib import Path

import pytest
from pydantic import BaseModel, SecretStr, ValidationError

from infra.stack import StackSettings
from pipeline.config import (
    ChainSettings,
    ConfigError,
    LocalBlobSettings,
    S3BlobSettings,
    SprawlSettings,
    StreamSettings,
    load_settings,
    settings_toml,
    validation_lines,
    write_settings_file,
)
from workers.trainer.settings import TrainerSettings
from workers.up.options import UpOptions, UpSettings


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
    from workers.archiver import ArchiverSettings
    from workers.cli import COMMANDS, _import

    models = [S3BlobSettings, LocalBlobSettings]
    seen: set = set()
    for root in (StackSettings, TrainerSettings, UpSettings, UpOptions, ArchiverSettings):
        models += _models(root, seen)
    for command in COMMANDS.values():  # every command's own options (the settings' help is their docstrings)
        if command.options is not None:
            options = _import(command.options) if isinstance(command.options, str) else command.options
            models += _models(options, seen)
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
    with pytest.raises(ConfigError, match=r"absent\.toml does not exist"):
        load_settings(SprawlSettings, tmp_path / "absent.toml")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch):
    for name in list(os.environ):
        if name.startswith("SPRAWL_"):
            monkeypatch.delenv(name)


def _lines(build) -> list[str]:
    with pytest.raises(ValidationError) as caught:
        build()
    return validation_lines(caught.value)


def test_values_that_used_to_fail_later_fail_at_start_naming_the_field(clean_env, monkeypatch, tmp_path: Path):
    assert _lines(lambda: TrainerSettings(trainer={"checkpoint_every": 0})) == [
        "trainer.checkpoint_every: Input should be greater than or equal to 1 (got 0)"
    ]
    assert _lines(lambda: TrainerSettings(chain={"keyframe_every": 0})) == [
        "chain.keyframe_every: Input should be greater than or equal to 1 (got 0)"
    ]
    assert _lines(lambda: TrainerSettings(trainer={"loss": {"importance_level": "Token"}})) == [
        "trainer.loss.importance_level: Input should be 'token' or 'sequence' (got 'Token')"
    ]
    # the same from a variable and from a file, with a typo in a name
    monkeypatch.setenv("SPRAWL_TRAINER__LOSS__IMPORTANCE_LEVEL", "Token")
    toml = tmp_path / "trainer.toml"
    toml.write_text("[trainer]\ncheckpoint_evry = 5\n")
    lines = _lines(lambda: load_settings(TrainerSettings, toml))
    assert "trainer.checkpoint_evry: Extra inputs are not permitted (got 5)" in lines
    assert "trainer.loss.importance_level: Input should be 'token' or 'sequence' (got 'Token')" in lines


def test_bounds_and_cross_field_rules():
    for build, field in (
        (lambda: StreamSettings(max_deliver=3), "backoff_s"),  # 4 backoff delays need max_deliver > 4
        (lambda: StreamSettings(replicas=0), "replicas"),
        (lambda: ChainSettings(views=[]), "views"),
        (lambda: ChainSettings(views=["bf16", "bf16"]), "views"),
        (lambda: ChainSettings(skip_distances=[1]), "skip_distances"),
        (lambda: S3BlobSettings(bucket="Not_A_Bucket"), "bucket"),
        (lambda: S3BlobSettings(multipart_chunk_bytes=1024), "multipart_chunk_bytes"),
        (lambda: S3BlobSettings(endpoint_url="127.0.0.1:8333"), "endpoint_url"),
        (lambda: SprawlSettings(run_id="a.b"), "run_id"),
        (lambda: SprawlSettings(nats={"url": "http://127.0.0.1:4222"}), "nats.url"),
        (lambda: SprawlSettings(nats={"password": "p"}), "nats.password"),
        (lambda: SprawlSettings(log_level="loud"), "log_level"),
        (lambda: SprawlSettings(blobs={"type": "gcs"}), "blobs"),
    ):
        lines = _lines(build)
        assert len(lines) == 1 and field in lines[0], lines
    assert StreamSettings(max_deliver=5).max_deliver == 5
    assert SprawlSettings(log_level="debug").log_level == "DEBUG"
    assert S3BlobSettings(endpoint_url="").endpoint_url is None  # "" stands for None in files


def test_secrets_are_not_echoed_in_errors():
    lines = _lines(lambda: S3BlobSettings(secret_access_key=42, region=""))
    assert all("42" not in line for line in lines) and any("region" in line for line in lines)


TRICKY = 'quote " backslash \\ tab \t newline \n del \x7f unicode é 🙂 = [x] #'


def test_settings_survive_a_toml_round_trip(clean_env, tmp_path: Path):
    from workers.archiver import ArchiverSettings
    from workers.rewards.worker import RewardSettings

    settings = [
        TrainerSettings(
            run_id="r-1",
            nats={"url": "nats://a:1,tls://b:2", "user": TRICKY, "password": TRICKY},
            blobs={"endpoint_url": None, "secret_access_key": TRICKY, "max_download_mbps": 12.5},
            trainer={"learning_rate": 3e-4, "max_staleness": 2, "loss": {"importance": "tis", "tail_eps": 1e-9}},
            chain={"views": ["bf16", "fp8_e4m3"], "skip_distances": [2, 4]},
        ),
        UpSettings(trainer={"learning_rate": 1e-3}, task={"digits": 3}, blobs={"type": "local", "root": tmp_path}),
        ArchiverSettings(streams={"backoff_s": []}),
        RewardSettings(routes={"arith": "exact", "odd key.with dots": "format"}),
    ]
    for original in settings:
        text = settings_toml(original)
        again = type(original).model_validate(tomllib.loads(text))
        assert again == original, text
        path = write_settings_file(original, tmp_path / "conf" / f"{type(original).__name__}.toml")
        assert stat.S_IMODE(path.stat().st_mode) == 0o600  # it holds credentials
        assert load_settings(type(original), path) == original
    assert settings[0].blobs.secret_access_key == SecretStr(TRICKY)


def test_up_settings_keep_the_demo_defaults_under_a_partial_override(clean_env, monkeypatch):
    monkeypatch.setenv("SPRAWL_TRAINER__LEARNING_RATE", "0.001")
    settings = load_settings(UpSettings)
    assert settings.trainer.learning_rate == 0.001
    assert settings.trainer.groups_per_batch == 8 and settings.chain.keyframe_every == 50  # not the library's

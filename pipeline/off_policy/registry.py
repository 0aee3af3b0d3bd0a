"""The registry of off-policy corrections: what `--correction sc+mis+mask` names, and where each lives.

A correction is one switch of `LossSection` (a field and the value that turns it on) plus, when it
changes the numbers, one module under `pipeline/off_policy/corrections/` whose hook class the loss
core calls at its stage (see `pipeline.off_policy.hooks`). Adding one is that file plus one entry
in `CORRECTIONS` below (and its switch and parameters in `LossSection`, if it brings new ones).

This module does not import torch: specs are checked when settings are parsed, before any worker
loads a model.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from pipeline.errors import SprawlError
from pipeline.off_policy.settings import LossSection


@dataclass(frozen=True)
class Correction:
    name: str
    """The word in a `--correction` spec (`sc+mis+mask`)."""
    summary: str
    """One line for help texts and errors."""
    field: str
    """The `LossSection` field that switches it."""
    on: Any
    """The field's value with the correction on."""
    off: Any
    """The field's value with it off (a spec starts with every correction off)."""
    hook: str | None = None
    """`module:Class` of its hook, a subclass of one stage of `pipeline.off_policy.hooks` (None: a
    switch that changes no numbers by itself)."""

    def active(self, loss: LossSection) -> bool:
        return getattr(loss, self.field) == self.on


class UnknownCorrection(SprawlError, ValueError):
    """A spec names a correction nobody registered. Also a ValueError, so settings validators report it."""

    def __init__(self, name: str):
        self.name = name
        super().__init__(
            f"unknown correction {name!r}: combine {', '.join(CORRECTIONS)} with '+', or say 'none'",
            hint="`sprawl up --help` describes each",
        )


class ConflictingCorrections(SprawlError, ValueError):
    def __init__(self, first: Correction, second: Correction):
        super().__init__(
            f"corrections {first.name!r} and {second.name!r} both set `{first.field}`: choose one",
            hint=f"{first.name}: {first.summary}; {second.name}: {second.summary}",
        )


CORRECTIONS: dict[str, Correction] = {}
"""Spec name -> correction, in the order the spec of a loss is written."""


def register_correction(correction: Correction) -> Correction:
    if correction.name in CORRECTIONS or correction.name in ("", "none"):
        raise SprawlError(f"correction name {correction.name!r} is taken", hint="give the new correction its own name")
    if correction.field not in LossSection.model_fields:
        raise SprawlError(
            f"correction {correction.name!r} switches `{correction.field}`, which LossSection does not have",
            hint="add the field (with its docstring and bounds) to pipeline/off_policy/settings.py",
        )
    for value in (correction.on, correction.off):
        LossSection.model_validate({correction.field: value} | _companions(correction.field, value))
    CORRECTIONS[correction.name] = correction
    return correction


def _companions(field: str, value: Any) -> dict[str, Any]:
    """What a lone value needs to validate (a sequence level needs an importance weight)."""
    return {"importance": "mis"} if (field, value) == ("importance_level", "sequence") else {}


def loss_fields(spec: str) -> dict[str, Any]:
    """`sc+mis+mask` (`,` works too; `none` or "" is plain policy gradient) as `LossSection` fields:
    every registered switch, on for the named corrections, off for the rest."""
    fields = {c.field: c.off for c in CORRECTIONS.values()}
    chosen: dict[str, Correction] = {}
    for part in spec.replace(",", "+").split("+"):
        name = part.strip().lower()
        if name in ("", "none"):
            continue
        correction = CORRECTIONS.get(name)
        if correction is None:
            raise UnknownCorrection(name)
        earlier = chosen.get(correction.field)
        if earlier is not None and earlier.name != name:
            raise ConflictingCorrections(earlier, correction)
        chosen[correction.field] = correction
        fields[correction.field] = correction.on
    return fields


def apply_spec(loss: LossSection, spec: str) -> LossSection:
    """`loss` with its switches set by `spec` (its parameters kept), validated."""
    return LossSection.model_validate(loss.model_dump() | loss_fields(spec))


def correction_spec(loss: LossSection) -> str:
    """The spec that gives `loss`'s switches (`none` when every correction is off)."""
    return "+".join(c.name for c in CORRECTIONS.values() if c.active(loss)) or "none"


def correction_help() -> str:
    return "; ".join(f"{c.name}: {c.summary}" for c in CORRECTIONS.values())


def load_hook(correction: Correction) -> Any:
    """An instance of the correction's hook class (imports torch)."""
    if correction.hook is None:
        return None
    module, _, attr = correction.hook.partition(":")
    return getattr(importlib.import_module(module), attr)()


# The corrections, in the order `correction_spec` writes them.
_HOOKS = "pipeline.off_policy.corrections"
for _correction in (
    Correction(
        "sc", "score centering (top-k form)", "score_centering", True, False, f"{_HOOKS}.score_centering:ScoreCentering"
    ),
    Correction(
        "mis",
        "masked importance sampling: rho outside [mis_low, mis_high] leaves the loss",
        "importance",
        "mis",
        "none",
        f"{_HOOKS}.mis:MaskedImportance",
    ),
    Correction(
        "tis",
        "truncated importance sampling: w = min(rho, tis_cap)",
        "importance",
        "tis",
        "none",
        f"{_HOOKS}.tis:TruncatedImportance",
    ),
    Correction(
        "mask",
        "top-p mask replay: renormalize over the sampler's kept set",
        "mask_replay",
        True,
        False,
        f"{_HOOKS}.mask_replay:MaskReplay",
    ),
    Correction(
        "geo",
        "geometric rejection of whole sequences",
        "geometric_rejection",
        True,
        False,
        f"{_HOOKS}.geometric:GeometricRejection",
    ),
    Correction(
        "seq",
        "tis/mis on the sequence ratio instead of per token",
        "importance_level",
        "sequence",
        "token",
        f"{_HOOKS}.sequence:SequenceRatio",
    ),
    Correction(
        "ppo", "PPO-clip surrogate instead of plain policy gradient", "surrogate", "ppo", "pg", f"{_HOOKS}.ppo:PPOClip"
    ),
):
    register_correction(_correction)

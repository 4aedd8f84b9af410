"""cocodiff's settings: what a user chooses, typed, validated once, and what the flags are made of.

:class:`Options` holds the backend's choices and :class:`VMajorSettings` V-Major's knobs (the
shipped ``configs/policies/v-major.yaml``, a user's file, flags). Each field that is a flag
carries its help (and choices) in its metadata: :mod:`cocodiff_xfuser.xfuser.flags` builds the
``--cocodiff-*`` flags from them, and validation happens here, once, when the settings are built.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, Union

import torch

from cocodiff_xfuser.comm import compress, faults
from cocodiff_xfuser.comm.autotune import A2A_SETTINGS
from cocodiff_xfuser.shipped import CONFIGS

logger = logging.getLogger("cocodiff_xfuser")


def _flag(default: Any, help: str, *, name: str | None = None, choices: tuple[str, ...] | None = None,
          metavar: str | None = None, env: str | None = None) -> Any:
    """A field that is the flag ``--cocodiff-<name>`` (default: the field's name); ``env``: the
    environment variable that supplies its value when the flag is not given."""
    return field(default=default, metadata={"help": help, "flag": name, "choices": choices, "metavar": metavar, "env": env})


def _knob(help: str) -> Any:
    """A V-Major knob: a settings file key and the flag ``--cocodiff-v-major-<name>``."""
    return field(metadata={"help": help})


DEFAULTS = CONFIGS / "policies" / "v-major.yaml"
METRICS = ("rel-l2", "l1")
SCOPES = ("v", "qkv", "qkvo")
RESIDUAL_DTYPES = ("none", "bfloat16", "float8_e4m3fn", "int4")
IF_SLOWER = ("stop", "keep")
FIRST_STEPS = ("residual", "exact")
MODES = ("off", "on", "auto")
CALIBRATION = DEFAULTS.with_name("v-major-calibration.yaml")


#: ``--cocodiff-v-major-min-psnr``'s default (dB against the exact run).
DEFAULT_MIN_PSNR_DB = 38.0


def error_for(min_psnr_db: float, path: Path = CALIBRATION) -> float:
    """The ``budget`` policy's ``error`` for a mean-PSNR target: on each calibrated model, the largest
    error whose PSNR, interpolated linearly in log(error) between measured points (each point's
    PSNR taken as the lower 95% prediction bound for a fresh 20-image check where the calibration
    gives one, and as the lowest at that error or below, so the curve falls), meets the target; the
    smallest of these over the models. A target above every measured PSNR gets the smallest calibrated error
    (logged): its quality is then not known to meet the target."""
    import yaml

    models = yaml.safe_load(path.read_text())["models"]
    if not models:
        raise ValueError(f"{path}: no calibrated model (cocodiff quality --sweep v-major-budget writes one)")
    errors = []
    for name, model in models.items():
        points = sorted((p["error"], p.get("psnr_low_db", p["psnr_db"])) for p in model["points"])
        falling, lowest = [], math.inf
        for error, psnr in points:
            lowest = min(lowest, psnr)
            falling.append((math.log(error), lowest))
        if min_psnr_db > falling[0][1]:
            logger.warning(
                "cocodiff: V-Major auto: %g dB is above what %s measured at the smallest calibrated error "
                "(%.1f dB at %g); using that error", min_psnr_db, name, falling[0][1], points[0][0],
            )
            errors.append(points[0][0])
            continue
        best = falling[0][0]
        for (x0, y0), (x1, y1) in zip(falling, falling[1:]):
            if y1 >= min_psnr_db:
                best = x1
            elif y0 >= min_psnr_db:
                best = x0 + (x1 - x0) * (y0 - min_psnr_db) / (y0 - y1)
                break
        errors.append(math.exp(best))
    return min(errors)


def _share(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"--cocodiff-v-major-{name} {value!r}: expected a share between 0 and 1")


def _metric(metric: str) -> None:
    if metric not in METRICS:
        raise ValueError(f"--cocodiff-v-major-metric {metric!r}: expected one of {', '.join(METRICS)}")


_METRIC_HELP = f"change of a token: {', '.join(METRICS)}"


@dataclass(frozen=True)
class Threshold:
    """Sends as many tokens as exceeded ``threshold`` at an earlier step (measured per layer,
    agreed per step), those that changed most."""

    name: ClassVar[str] = "threshold"
    metric: str = _knob(_METRIC_HELP)
    threshold: float = _knob("change above which a token is sent (policy threshold)")

    def check(self) -> None:
        _metric(self.metric)
        if self.threshold < 0:
            raise ValueError(f"--cocodiff-v-major-threshold {self.threshold!r}: must be >= 0")

    def describe(self) -> str:
        return f"change > {self.threshold:g} ({self.metric})"


@dataclass(frozen=True)
class TopK:
    """Sends the ``fraction`` of tokens that changed most."""

    name: ClassVar[str] = "top-k"
    metric: str = _knob(_METRIC_HELP)
    fraction: float = _knob("share of tokens sent per step (policy top-k)")

    def check(self) -> None:
        _metric(self.metric)
        _share("fraction", self.fraction)

    def describe(self) -> str:
        return f"top {self.fraction:.0%} per step ({self.metric})"


@dataclass(frozen=True)
class Schedule:
    """Top-k with a cached share rising linearly from 0 after the warm-up to ``final_cached`` at the
    last step (the CoCoDiff paper's schedule)."""

    name: ClassVar[str] = "schedule"
    metric: str = _knob(_METRIC_HELP)
    final_cached: float = _knob("cached share reached at the last step (policy schedule)")

    def check(self) -> None:
        _metric(self.metric)
        _share("final-cached", self.final_cached)

    def describe(self) -> str:
        return f"cached share rising to {self.final_cached:.0%} ({self.metric})"


@dataclass(frozen=True)
class Budget:
    """Per layer, the fewest tokens (largest change first) that keep the relative L2 error of V as
    the receivers hold it within ``error``, measured at every step (``--cocodiff-v-major auto``)."""

    name: ClassVar[str] = "budget"
    error: float = _knob("relative L2 error of V kept per layer (policy budget)")

    def check(self) -> None:
        if not 0.0 < self.error < 1.0:
            raise ValueError(f"--cocodiff-v-major-error {self.error!r}: expected a relative error between 0 and 1")

    def describe(self) -> str:
        return f"fewest tokens keeping V's error within {self.error:g} (rel-l2, per layer)"


#: V-Major's token-selection policies, by name: each class holds the knobs it reads and nothing else.
RULES = {rule.name: rule for rule in (Threshold, TopK, Schedule, Budget)}
POLICIES = tuple(RULES)
Rule = Union[Threshold, TopK, Schedule, Budget]


@dataclass(frozen=True)
class VMajorSettings:
    """The V-Major knobs (``configs/policies/v-major.yaml``; each also a ``--cocodiff-v-major-*`` flag):
    the policy (``rule``, with its own knobs) and the knobs every policy reads."""

    rule: Rule
    warmup_steps: int = _knob("first steps exchanged in full")
    refresh_every: int = _knob("full exchange every this many steps (0: never)")
    scope: str = _knob(f"exchanges the mask gates: {', '.join(SCOPES)}")
    residual_dtype: str = _knob(f"active rows over slow links: {', '.join(RESIDUAL_DTYPES)} (none: values)")
    first_step: str = _knob(f"with residuals, the first step's tokens: {', '.join(FIRST_STEPS)} (residuals against zeros, "
                            "or the exact exchange)")
    budget_mib: float = _knob("bound on the caches in MiB; layers beyond it use the exact exchange")
    if_slower: str = _knob(f"auto, where its steps are not faster than exact steps: {', '.join(IF_SLOWER)}")
    # --cocodiff-v-major auto's target (not a file knob): its ``error`` came from the calibration,
    # and V-Major turns itself off where its steps are not faster than exact ones.
    min_psnr_db: float | None = None

    @property
    def policy(self) -> str:
        return self.rule.name

    @classmethod
    def load(cls, path: str | Path | None = None, *, min_psnr_db: float | None = None, strict: bool = False,
             **overrides: Any) -> VMajorSettings:
        """The settings of ``path`` (default: the shipped defaults), with non-None ``overrides`` applied
        and auto's ``min_psnr_db``. ``strict`` (a user's settings): a knob that the user's file or an
        override sets and the chosen policy never reads is an error, not a silent no-op."""
        import yaml

        path = Path(path) if path else DEFAULTS
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ValueError(f"--cocodiff-v-major-config {path}: cannot read it ({e})") from e
        names = {f.name: f.type for f in knobs()}
        unknown = sorted(set(data) - set(names))
        if unknown:
            raise ValueError(f"{path}: unknown V-Major setting(s) {', '.join(unknown)}; expected {', '.join(names)}")
        given = {k for k, v in overrides.items() if v is not None} | (set(data) if path != DEFAULTS else set())
        if path != DEFAULTS:  # a user's file may set only some knobs
            data = {**yaml.safe_load(DEFAULTS.read_text()), **data}
        data.update({k: v for k, v in overrides.items() if v is not None})
        rule = RULES.get(str(data["policy"]))
        if rule is None:
            raise ValueError(f"--cocodiff-v-major-policy {data['policy']!r}: expected one of {', '.join(POLICIES)}")
        if strict:  # a knob the user set that the chosen policy never reads: one line, not a silent no-op
            _check_read(rule, given, min_psnr_db)

        def typed(k: str) -> Any:
            return (int if names[k] == "int" else float if names[k] == "float" else str)(data[k])

        try:
            settings = cls(rule(**{f.name: typed(f.name) for f in fields(rule)}),
                           **{f.name: typed(f.name) for f in fields(cls) if "help" in f.metadata}, min_psnr_db=min_psnr_db)
        except (TypeError, ValueError) as e:
            raise ValueError(f"V-Major settings: {e}") from e
        settings.check()
        if strict and "first_step" in given and settings.residual is None:
            raise ValueError("--cocodiff-v-major-first-step acts only with a residual dtype (values: the first step is "
                             "exact): leave it out or set --cocodiff-v-major-residual-dtype")
        return settings

    def check(self) -> None:
        self.rule.check()
        for name, value, allowed in (
            ("scope", self.scope, SCOPES),
            ("residual-dtype", self.residual_dtype, RESIDUAL_DTYPES),
            ("if-slower", self.if_slower, IF_SLOWER),
            ("first-step", self.first_step, FIRST_STEPS),
        ):
            if value not in allowed:
                raise ValueError(f"--cocodiff-v-major-{name} {value!r}: expected one of {', '.join(allowed)}")
        if self.warmup_steps < 0 or self.refresh_every < 0 or self.budget_mib < 0:
            raise ValueError("--cocodiff-v-major-warmup-steps, -refresh-every and -budget-mib must be >= 0")

    def describe(self) -> str:
        rule = self.rule.describe()
        refresh = f", full every {self.refresh_every} steps" if self.refresh_every else ""
        rows = "values" if self.residual_dtype == "none" else f"{self.residual_dtype} residuals" + (
            ", the first step exact" if self.first_step == "exact" else "")
        auto = "" if self.min_psnr_db is None else f"auto for {self.min_psnr_db:g} dB: "
        return (f"{auto}{rule}, scope {self.scope}, active rows as {rows}, {self.warmup_steps} warm-up steps{refresh}, "
                f"cache budget {self.budget_mib:g} MiB")

    @property
    def residual(self) -> torch.dtype | None:
        """The dtype active rows' changes travel in (None: the rows themselves, in the exchange's dtype)."""
        return None if self.residual_dtype == "none" else getattr(torch, self.residual_dtype)


@dataclass(frozen=True)
class Options:
    """What a user chose for the backend: each field with a flag is ``--cocodiff-<name>``."""

    topology: str | None = _flag(
        None, "hardware levels as NxL[xT] (nodes x ranks per node [x tiles]), a preset (aurora, dgx-h100, dgx-h200, "
        "pcie-8gpu) or preset file, or 'auto' (detected from hostnames and LOCAL_WORLD_SIZE; the default)")
    a2a: str = _flag("auto", "all-to-all algorithm; 'auto' measures the eligible ones per message size against the "
                     "backend's fair flat exchange", choices=A2A_SETTINGS)
    v_first: bool = _flag(False, "V-First attention processors (V's exchange overlaps Q/K projection, norm and RoPE)")
    v_major: VMajorSettings | None = None  # None: off (V-Major implies V-First); from the --cocodiff-v-major* flags
    timeout_s: float = _flag(
        faults.DEFAULT_TIMEOUT_S, f"bound on every exchange; a stalled or dead peer ends the job with one line "
        f"(default ${faults.TIMEOUT_ENV}, else {faults.DEFAULT_TIMEOUT_S:g})", name="timeout", metavar="SECONDS",
        env=faults.TIMEOUT_ENV)
    compress: str = _flag(
        "none", "fp8: every Ulysses exchange in fp8 with one scale per token and head (lossy, on every link); fp8-slow: "
        "the same on links to other nodes only, node-mates get exact values (compared with V-Major in "
        "docs/benchmarks.md)", choices=compress.SETTINGS)

    def __post_init__(self) -> None:
        if self.a2a not in A2A_SETTINGS:
            raise ValueError(f"--cocodiff-a2a {self.a2a!r}: expected one of {', '.join(A2A_SETTINGS)}")
        if self.compress not in compress.SETTINGS:
            raise ValueError(f"--cocodiff-compress {self.compress!r}: expected one of {', '.join(compress.SETTINGS)}")
        if self.compress != "none" and self.v_major is not None:
            raise ValueError("--cocodiff-compress and --cocodiff-v-major both compress the exchanges: choose one")
        if not self.timeout_s > 0:
            raise ValueError(f"--cocodiff-timeout {self.timeout_s!r}: expected a positive number of seconds")


def flags(cls: type) -> list[tuple[str, Any]]:
    """The fields of ``cls`` that are flags, as (flag name, field)."""
    return [(f.metadata.get("flag") or f.name, f) for f in fields(cls) if "help" in f.metadata]


@dataclass(frozen=True)
class _Policy:
    """The policy's name as a settings-file key and flag (VMajorSettings holds it as its ``rule``)."""

    policy: str = _knob(f"token selection: {', '.join(POLICIES)}")


def knobs() -> list[Any]:
    """The V-Major knobs, the keys of a settings file: the policy, every policy's own knobs (once
    each), and the knobs every policy reads."""
    found: dict[str, Any] = {}
    for cls in (_Policy, *RULES.values(), VMajorSettings):
        found.update({f.name: f for f in fields(cls) if "help" in f.metadata and f.name not in found})
    return list(found.values())


def _check_read(rule: type, given: set[str], min_psnr_db: float | None) -> None:
    """One line for the first knob in ``given`` that another policy reads and ``rule`` does not (the
    knobs every policy reads are always read); ``--cocodiff-v-major-if-slower`` outside auto likewise."""
    own = {f.name for f in fields(rule)}
    policy_knobs = {f.name for r in RULES.values() for f in fields(r)}
    unread = sorted(given & (policy_knobs - own))
    if unread:
        name = unread[0]
        readers = [r.name for r in RULES.values() if name in {f.name for f in fields(r)}]
        raise ValueError(f"--cocodiff-v-major-{name.replace('_', '-')} is not read by policy {rule.name} (read by "
                         f"{', '.join(readers)}): leave it out or choose one of those with --cocodiff-v-major-policy")
    if "if_slower" in given and min_psnr_db is None:
        raise ValueError("--cocodiff-v-major-if-slower acts only with --cocodiff-v-major auto (its speed check): leave it out")

"""One verification as given, typed once: :class:`VerifyRun`, and what one worker process
of it runs, :class:`WorkerTask`.

``speccheck verify``, :func:`speccheck.verify` and the pytest plugin each build a
:class:`VerifyRun` from their input; planning (:func:`~speccheck.checks.api.
plan_verification`) takes it unchanged, and every worker process (a single-rank worker, a
shard, the reproduce-confirmation worker, the claims audit, DCP ranks) receives it as
JSON inside its :class:`WorkerTask`. A new option is a new field here (and, where it is
a flag, its flag in :mod:`speccheck.checks.cli.verify`).

Torch-free: the command line builds a run before it imports the engine.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import ErrorDetails

from speccheck.checks.verify.scale import (
    DEFAULT_SHRINK_SECONDS,
    DEFAULT_STEPS,
    MAX_NEW_TOKENS,
    MAX_REQUESTS,
    TIER_DEFAULTS,
    TIER_SCALE,
    HarnessScale,
)
from speccheck.checks.verify.vocabulary import Tier
from speccheck.contract.matrix_model import VERIFIABLE_FIELDS, KvLayout, Matrix
from speccheck.contract.runtime_config import RuntimeConfig
from speccheck.speculator.drafter_kind import DrafterKind

MAX_JOBS = 16
"""Most worker processes a verification runs per backend at once (``--jobs``)."""

RuntimeOverrides = dict[str, Any]
"""Runtime fields given, by :class:`RuntimeConfig` field name (fields left out are
absent)."""


def option_flag(field: str) -> str:
    """The command-line flag of a ``RuntimeConfig`` field: ``dcp_world_size`` ->
    ``--dcp-world-size``."""
    return "--" + field.replace("_", "-")


def runtime_flags(runtime: Mapping[str, object]) -> str:
    """Runtime fields given, as they would be typed again on the command line (for
    reproduce commands)."""
    parts = []
    for name, value in runtime.items():
        if isinstance(value, bool):
            parts.append(option_flag(name) if value else f"--no-{name.replace('_', '-')}")
        else:
            parts.append(f"{option_flag(name)} {value}")
    return " ".join(parts)


def bound_problem(error: ErrorDetails) -> str:
    """One value pydantic rejected by its type or bound, in words: ``FIELD should be ...,
    got VALUE``."""
    return (f"{'.'.join(map(str, error['loc']))} "
            f"{error['msg'].replace('Input should be', 'should be', 1)}, got {error['input']!r}")


def config_problems(error: ValidationError) -> str:
    """A :class:`RuntimeConfig` validation error in one line: :func:`bound_problem` per
    problem, joined by ``; ``."""
    return "; ".join(bound_problem(e) for e in error.errors())


class VerifyRun(BaseModel):
    """Everything a verification is given: which backends, at which runtime config and
    scale, on how many examples from which seed, within which limits, and where its
    reports go. Frozen; built once by the command, the API or the pytest plugin; two equal
    inputs give equal runs. Defaults are the command's."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    backend: str = "reference"
    """A backend name from the matrix, or ``all`` (checked against the matrix when
    planned)."""
    config: RuntimeOverrides = Field(default_factory=dict)
    """Runtime fields that override the tier's defaults and the backend's
    ``verify_defaults``: only :data:`~speccheck.contract.matrix_model.VERIFIABLE_FIELDS`,
    kept in that order, each validated by :class:`RuntimeConfig`. A ``RuntimeConfig``
    given here counts its explicitly set fields."""
    matrix: Path | None = None
    """A matrix file, verified alone; ``None``: the shipped matrix merged with the
    installed plug-ins' fragments."""
    examples: int = Field(50, ge=1)
    """Examples per backend."""
    seed: int = 0
    """Hypothesis seed (shard ``i`` of ``jobs`` draws from ``seed + i``)."""
    steps: tuple[int, ...] | None = None
    """Draft step counts (K) to draw from; ``None``: ``num_speculative_steps`` when
    ``config`` gives it, else :data:`~speccheck.checks.verify.scale.DEFAULT_STEPS`."""
    capture_sizes: tuple[int, ...] | None = None
    """Padded request counts to capture graphs for (and pad eager runs to), kept distinct
    and ascending; ``None``: the tier's."""
    max_new_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS)
    """Most tokens a request brings to the first pass; ``None``: the tier's."""
    kv_layout: KvLayout | None = None
    """The drafter's layer kind for a backend whose entry states no ``kv_layout`` (it reads
    both); ``None``: the entry's, and at the defaults every layout the entry claims, each
    a cell of its own (:mod:`~speccheck.checks.verify.cells`)."""
    drafter: DrafterKind | None = None
    """The drafter verified: ``dflash`` runs the DFlash drafter on real ranks (data-parallel
    ones at ``dp_size > 1``, the DCP group's at ``dcp_world_size > 1`` for a backend whose
    builders hold a DCP share, else one), the run's config alone; ``autoregressive`` the
    single-rank and DCP verification, without the DFlash cells. ``None``: ``dflash`` at ``dp_size > 1``, else
    ``autoregressive`` (whose cells include DFlash ones where the entry claims them)."""
    cells: bool = True
    """Verify every configuration cell the entry claims around the run's config
    (:func:`~speccheck.checks.verify.cells.claimed_cells`), the examples spread over them;
    ``False``: the run's config alone."""
    reproduce: str | None = None
    """Run exactly this example: a blob from a failure's reproduce command, or ``@FILE``
    for one kept in a file (read when planned)."""
    audit_claims: bool = False
    """For a backend the matrix does not allow to fuse, also run the fused path in a
    worker of its own and report whether the claim is too strict."""
    example_timeout: float = Field(300.0, gt=0, allow_inf_nan=False)
    """Seconds without progress before a worker counts as hung; once it has finished
    examples, less: 20 times its slowest, at least 120 s (:mod:`~speccheck.checks.verify.
    hang`)."""
    shrink_seconds: float = Field(DEFAULT_SHRINK_SECONDS, ge=0, allow_inf_nan=False)
    """Each worker's budget for shrinking a failure to a smaller example."""
    fail_fast: bool = False
    """End each worker's search at its first failure, and a backend's run at its first
    failing configuration cell (the cells after it are listed as not run); by default it
    searches on with the examples left for failures of checks (and ``step_metadata``
    fields) not yet failed, in every cell."""
    jobs: int | None = Field(None, ge=1, le=MAX_JOBS)
    """Worker processes per single-rank backend; ``None``: the machine's default
    (:func:`~speccheck.checks.verify.scale.default_jobs`)."""
    json_path: Path | None = None
    """Where the command writes the JSON report (``--json``)."""
    junit_path: Path | None = None
    """Where the command writes the JUnit XML report (``--junit``)."""

    @field_validator("config", mode="before")
    @classmethod
    def _given_fields(cls, value: object) -> object:
        if value is None:
            return {}
        if isinstance(value, RuntimeConfig):
            return {name: getattr(value, name) for name in value.model_fields_set}
        return value

    @field_validator("config")
    @classmethod
    def _verifiable_fields(cls, given: RuntimeOverrides) -> RuntimeOverrides:
        fixed = sorted(set(given) - set(VERIFIABLE_FIELDS))
        if fixed:
            raise ValueError(
                f"{', '.join(fixed)} cannot be given to a verification (platform, compute "
                "capability and graph mode come from the machine); allowed: "
                f"{', '.join(VERIFIABLE_FIELDS)}")
        try:
            checked = RuntimeConfig(**given)
        except ValidationError as exc:
            raise ValueError(config_problems(exc)) from None
        return {name: getattr(checked, name) for name in VERIFIABLE_FIELDS if name in given}

    @field_validator("capture_sizes")
    @classmethod
    def _request_counts(cls, sizes: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if sizes is None:
            return None
        if not sizes or not all(1 <= n <= MAX_REQUESTS for n in sizes):
            raise ValueError(f"request counts must lie in 1..{MAX_REQUESTS}, got {list(sizes)}")
        return tuple(sorted(set(sizes)))

    @field_validator("steps")
    @classmethod
    def _step_counts(cls, steps: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if steps is not None and (not steps or any(k < 1 for k in steps)):
            raise ValueError(f"draft step counts must be at least 1, got {list(steps)}")
        return steps

    @model_validator(mode="after")
    def _steps_given_once(self) -> VerifyRun:
        if self.steps is not None and "num_speculative_steps" in self.config:
            raise ValueError("give steps or config num_speculative_steps, not both")
        return self

    @model_validator(mode="after")
    def _data_parallel_drafts_dflash(self) -> VerifyRun:
        dp_size = self.config.get("dp_size", 1)
        if self.drafter is DrafterKind.AUTOREGRESSIVE and dp_size > 1:
            raise ValueError(f"drafter autoregressive cannot run at dp_size {dp_size}: "
                             "data-parallel ranks run the DFlash drafter")
        return self

    @property
    def draft_steps(self) -> tuple[int, ...]:
        """The draft step counts drawn from (single-rank runs): :attr:`steps`, else
        ``num_speculative_steps`` when given, else the default range."""
        if self.steps is not None:
            return self.steps
        k = self.config.get("num_speculative_steps")
        return (k,) if isinstance(k, int) else DEFAULT_STEPS

    def scale(self, tier: Tier) -> HarnessScale:
        """The batch scale on ``tier``: the tier's, with what was given."""
        tier_scale = TIER_SCALE[tier]
        return HarnessScale(self.capture_sizes or tier_scale.capture_sizes,
                            self.max_new_tokens or tier_scale.max_new_tokens)

    def tier_config(self, tier: Tier, platform: str) -> RuntimeConfig:
        """The runtime config of this run on ``tier`` (on ``platform``) before any
        backend's ``verify_defaults``: the tier's defaults, then :attr:`config`."""
        return RuntimeConfig(**{**TIER_DEFAULTS[tier], "platform": platform, **self.config})

    def config_for(self, name: str, tier: Tier, matrix: Matrix, platform: str) -> RuntimeConfig:
        """The runtime config backend ``name`` is verified at on ``tier`` (on
        ``platform``): the tier's defaults, then its entry's ``verify_defaults`` in
        ``matrix``, then :attr:`config`."""
        defaults = matrix.backend(name).verify_defaults
        return RuntimeConfig(**{**TIER_DEFAULTS[tier], "platform": platform, **defaults,
                                **self.config})

    def reproduce_prefix(self, name: str) -> str:
        """The command that reruns backend ``name`` with this run's seed, matrix, scale
        and runtime fields, to which a report appends ``--reproduce BLOB``."""
        matrix = f" --matrix {shlex.quote(str(self.matrix))}" if self.matrix is not None else ""
        sizes = (f" --capture-sizes {','.join(map(str, self.capture_sizes))}"
                 if self.capture_sizes else "")
        if self.max_new_tokens is not None:
            sizes += f" --max-new-tokens {self.max_new_tokens}"
        if self.kv_layout is not None:
            sizes += f" --kv-layout {self.kv_layout.value}"
        if self.drafter is not None:
            sizes += f" --drafter {self.drafter.value}"
        return (f"speccheck verify --backend {name} --seed {self.seed}{matrix}{sizes} "
                f"{runtime_flags(self.config)}").strip()


class WorkerTask(BaseModel):
    """What one worker process runs: its :class:`VerifyRun`, unchanged, and what is its
    own (the backend, its share of the examples and its seed, whether it audits the
    fused claim, the example it reproduces). Travels as JSON
    (:meth:`~pydantic.BaseModel.model_dump_json`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    run: VerifyRun
    backend: str
    """The one backend (a name from the matrix) this worker verifies."""
    examples: int = Field(ge=1)
    """This worker's share of ``run.examples``."""
    seed: int
    """The seed this worker draws from."""
    claim_fused: bool = False
    """Run the fused candidate even where the matrix forbids it (the claims audit)."""
    reproduce: str | None = None
    """Run exactly this example blob (already read from ``@FILE``) instead of drawing."""
    cell: RuntimeOverrides = Field(default_factory=dict)
    """Runtime fields this worker's configuration cell sets on top of the run's
    (:class:`~speccheck.checks.verify.cells.Cell`; none of them given by the run)."""
    kv_layout: KvLayout | None = None
    """The cell's drafter layout; ``None``: the run's ``kv_layout``."""

    def config_for(self, tier: Tier, matrix: Matrix, platform: str) -> RuntimeConfig:
        """The runtime config this worker verifies at: the run's for its backend
        (:meth:`VerifyRun.config_for`) with :attr:`cell` set."""
        return self.run.config_for(self.backend, tier, matrix, platform).model_copy(
            update=self.cell)

    @property
    def drafter_layout(self) -> KvLayout | None:
        """The drafter's layer kind: the cell's, else the run's (``None``: the entry's)."""
        return self.kv_layout or self.run.kv_layout

    @property
    def reproduce_prefix(self) -> str:
        """The command that reruns this worker's backend as it ran here, in its cell."""
        prefix = self.run.reproduce_prefix(self.backend)
        if self.cell:
            prefix += f" {runtime_flags(self.cell)}"
        if self.kv_layout is not None:
            prefix += f" --kv-layout {self.kv_layout.value}"
        if self.cell or self.kv_layout is not None:
            prefix += " --no-cells"
        return prefix + " --audit-claims" if self.claim_fused else prefix

    @property
    def progress_total(self) -> int:
        """How many examples the worker will run: one for a reproduce run."""
        return 1 if self.reproduce is not None else self.examples


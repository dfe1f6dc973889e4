"""Command-line options shared by every command that needs a runtime configuration.

Each option is an ``Annotated`` alias that a typer command uses as a parameter type, with
``None`` as the default meaning "keep :class:`RuntimeConfig`'s default". Help texts come from
the ``RuntimeConfig`` field descriptions, so the model stays the single source. A command
passes its option values to :func:`build_runtime_config`::

    @app.command()
    def verify(platform: PlatformOption = None, dcp_world_size: DcpWorldSizeOption = None):
        config = build_runtime_config(platform=platform, dcp_world_size=dcp_world_size)
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from pydantic import ValidationError

from speccheck.contract.runtime_config import (
    CudaGraphModeName,
    DtypeName,
    KvCacheDtypeName,
    Platform,
    RuntimeConfig,
)

RUNTIME_PANEL = "Runtime configuration"


def _help(field: str) -> str:
    return RuntimeConfig.model_fields[field].description or field


def _default(field: str) -> str:
    return str(RuntimeConfig.model_fields[field].default)


def option_flag(field: str) -> str:
    """The command-line flag of a ``RuntimeConfig`` field: ``dcp_world_size`` ->
    ``--dcp-world-size``."""
    return "--" + field.replace("_", "-")


def _option(field: str) -> typer.models.OptionInfo:
    return typer.Option(
        option_flag(field),
        help=_help(field),
        rich_help_panel=RUNTIME_PANEL,
        show_default=_default(field),
    )


MatrixPathOption = Annotated[
    Optional[Path],
    typer.Option(
        "--matrix",
        help="Capability matrix to read.",
        dir_okay=False,
        show_default="the matrix.yaml shipped with speccheck",
    ),
]
PlatformOption = Annotated[Optional[Platform], _option("platform")]
ComputeCapabilityOption = Annotated[Optional[int], _option("compute_capability")]
DcpWorldSizeOption = Annotated[Optional[int], _option("dcp_world_size")]
DpSizeOption = Annotated[Optional[int], _option("dp_size")]
CudaGraphModeOption = Annotated[Optional[CudaGraphModeName], _option("cudagraph_mode")]
NumSpeculativeStepsOption = Annotated[Optional[int], _option("num_speculative_steps")]
AdvanceDraftPositionsOption = Annotated[
    Optional[bool],
    typer.Option(
        "--advance-draft-positions/--no-advance-draft-positions",
        help=_help("advance_draft_positions"),
        rich_help_panel=RUNTIME_PANEL,
        show_default=_default("advance_draft_positions"),
    ),
]
BlockSizeOption = Annotated[Optional[int], _option("block_size")]
MaxModelLenOption = Annotated[Optional[int], _option("max_model_len")]
KvCacheDtypeOption = Annotated[Optional[KvCacheDtypeName], _option("kv_cache_dtype")]
DtypeOption = Annotated[Optional[DtypeName], _option("dtype")]
HeadSizeOption = Annotated[Optional[int], _option("head_size")]
NumHeadsOption = Annotated[Optional[int], _option("num_heads")]
NumKvHeadsOption = Annotated[Optional[int], _option("num_kv_heads")]


def build_runtime_config(**options: object) -> RuntimeConfig:
    """A :class:`RuntimeConfig` from option values keyed by field name; ``None`` values
    keep the defaults.

    Raises ``typer.BadParameter`` (exit status 2) naming the flag, the expected range and
    the value given when the config rejects a value (e.g. ``--dcp-world-size 0``).
    """
    values = {field: value for field, value in options.items() if value is not None}
    try:
        return RuntimeConfig(**values)
    except ValidationError as exc:
        lines = []
        for error in exc.errors():
            field = str(error["loc"][0]) if error["loc"] else "?"
            message = error["msg"].replace("Input should be", "should be", 1)
            lines.append(f"{option_flag(field)} {message}, got {error['input']!r}")
        raise typer.BadParameter("; ".join(lines)) from None

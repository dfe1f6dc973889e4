"""Runtime-configuration options, generated from :class:`RuntimeConfig`.

A runtime option is declared once, as a ``RuntimeConfig`` field (its type, default and
description); :func:`with_runtime_options` turns fields into typer options of a command, so
a new field reaches ``speccheck matrix``, ``speccheck verify``, the config and the docs
without touching a command::

    @app.command()
    @with_runtime_options()
    def matrix(as_json: bool = False, *, runtime: RuntimeOverrides) -> None:
        config = build_runtime_config(runtime)

The wrapped command receives the options the user gave as ``runtime`` (field name to
value; options left out are absent), and decides the defaults itself (``verify`` has one
set per tier).
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, Optional, TypeVar

import typer
from pydantic import ValidationError

from speccheck.checks.verify.run import RuntimeOverrides, option_flag
from speccheck.contract.runtime_config import RuntimeConfig

RUNTIME_PANEL = "Runtime configuration"

F = TypeVar("F", bound=Callable[..., Any])

MatrixPathOption = Annotated[
    Optional[Path],  # noqa: UP045 - typer on the GPU image needs Optional
    typer.Option(
        "--matrix",
        help="Capability matrix to read: that file alone.",
        dir_okay=False,
        show_default="the matrix.yaml shipped with speccheck plus installed plug-in fragments",
    ),
]


def _option_type(annotation: Any) -> Any:
    """The typer parameter type of a field annotation (``Literal`` choices are kept)."""
    if typing.get_origin(annotation) is typing.Annotated:
        return typing.get_args(annotation)[0]
    return annotation


def _parameter(field: str, shown_default: object) -> inspect.Parameter:
    info = RuntimeConfig.model_fields[field]
    kind = _option_type(info.annotation)
    decls = (
        [f"{option_flag(field)}/--no-{field.replace('_', '-')}"]
        if kind is bool else [option_flag(field)]
    )
    option = typer.Option(
        *decls,
        help=info.description or field,
        rich_help_panel=RUNTIME_PANEL,
        show_default=str(shown_default),
    )
    return inspect.Parameter(
        field, inspect.Parameter.KEYWORD_ONLY, default=None,
        annotation=Annotated[Optional[kind], option],  # noqa: UP045 - see above
    )


def with_runtime_options(
    fields: tuple[str, ...] | None = None, defaults: Mapping[str, object] | None = None
) -> Callable[[F], F]:
    """Add one option per ``RuntimeConfig`` field in ``fields`` (all fields when ``None``)
    to a typer command, which must take a keyword-only ``runtime`` parameter.

    ``defaults`` are what ``--help`` shows for a field (the command applies them itself);
    otherwise ``RuntimeConfig``'s own default is shown.
    """
    names = tuple(RuntimeConfig.model_fields) if fields is None else fields
    unknown = sorted(set(names) - set(RuntimeConfig.model_fields))
    if unknown:
        raise ValueError(f"not RuntimeConfig fields: {', '.join(unknown)}")
    shown = {name: RuntimeConfig.model_fields[name].default for name in names}
    shown.update(defaults or {})

    def decorate(command: F) -> F:
        signature = inspect.signature(command, eval_str=True)
        if "runtime" not in signature.parameters:
            raise TypeError(f"{command.__name__} must take a keyword-only 'runtime' parameter")
        kept = [p for p in signature.parameters.values() if p.name != "runtime"]
        added = [_parameter(name, shown[name]) for name in names]

        @functools.wraps(command)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            given = {name: kwargs.pop(name) for name in names if kwargs.get(name) is not None}
            for name in names:
                kwargs.pop(name, None)
            return command(*args, runtime=given, **kwargs)

        parameters = kept + added
        wrapper.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
        wrapper.__annotations__ = {p.name: p.annotation for p in parameters}
        del wrapper.__wrapped__  # typer must see the new signature, not the command's
        return typing.cast(F, wrapper)

    return decorate


def build_runtime_config(
    runtime: RuntimeOverrides, defaults: Mapping[str, object] | None = None
) -> RuntimeConfig:
    """A :class:`RuntimeConfig` from ``defaults`` overridden by the options given.

    Raises ``typer.BadParameter`` (exit status 2) naming the flag, the expected range and
    the value given when the config rejects a value (e.g. ``--dcp-world-size 0``).
    """
    try:
        return RuntimeConfig(**{**(defaults or {}), **runtime})
    except ValidationError as exc:
        lines = []
        for error in exc.errors():
            field = str(error["loc"][0]) if error["loc"] else "?"
            message = error["msg"].replace("Input should be", "should be", 1)
            lines.append(f"{option_flag(field)} {message}, got {error['input']!r}")
        raise typer.BadParameter("; ".join(lines)) from None


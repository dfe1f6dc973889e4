"""Find, snapshot and compare every tensor and host value reachable from an object.

The verifier does not trust a builder's ``step_dependent_fields`` declaration alone: it walks
every tensor reachable from a metadata object (and the builder's persistent buffers), snapshots
them after each draft step, and asks which ones changed. The capture probes use the same walk
to check that a refresh wrote into existing tensors instead of binding new ones.
:func:`walk_host_values` walks the same way for the metadata's host-side plain data (numbers,
strings, number sequences, numpy arrays): a captured graph bakes those in, so they are
step-dependent metadata too.

Paths are Python-like and dotted: ``metadata.scheduler_metadata``, ``groups[0].seq_lens``,
``buffers['tile_schedule']``.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import logging
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, cast

import numpy as np
import torch

logger = logging.getLogger(__name__)

DEFAULT_MAX_DEPTH = 32
"""Containers nested deeper than this below the root are not expanded (and a warning is
logged): metadata objects are a few levels deep, so hitting it means the walk wandered into
something that is not metadata."""

_ATOMIC_TYPES: tuple[type, ...] = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    bytearray,
    range,
    enum.Enum,
    torch.dtype,
    torch.device,
    torch.Size,
    torch.layout,
    torch.memory_format,
    types.ModuleType,
    type,
)


_MISSING = object()

HOST_ARRAY_KINDS = "biufc"
"""numpy dtype kinds of the arrays :func:`walk_host_values` reads (booleans and numbers)."""


class TensorIdentity(NamedTuple):
    """What a captured graph pins about a tensor: the Python object, its address and layout.

    Two identities differ in ``obj_id`` when the attribute was rebound to another tensor
    object, and in ``data_ptr`` when the storage moved (``resize_``, ``set_``, an ``out=``
    tensor of the wrong size) even though the object stayed the same.
    """

    obj_id: int
    data_ptr: int
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


def tensor_identity(t: torch.Tensor) -> TensorIdentity:
    """The :class:`TensorIdentity` of ``t``. Reads metadata only; never touches values.

    ``obj_id`` is ``id(t)``: compare identities only while a reference to the old tensor is
    still held, or Python may have reused the id (and the allocator the address).
    """
    return TensorIdentity(
        obj_id=id(t),
        data_ptr=t.data_ptr(),
        storage_offset=int(t.storage_offset()),
        shape=tuple(t.shape),
        stride=tuple(t.stride()),
    )


def walk_tensors(
    obj: object, prefix: str = "", *, max_depth: int = DEFAULT_MAX_DEPTH
) -> dict[str, torch.Tensor]:
    """Every tensor reachable from ``obj``, keyed by its path below ``prefix``.

    Contract:

    - Tensors (including subclasses such as ``nn.Parameter``) are leaves: the walk does not
      look inside them. A root that is itself a tensor is returned as ``{prefix: obj}``.
    - Expanded: mappings (``prefix[key]`` with ``repr(key)``), lists and tuples
      (``prefix[i]``), named tuples (``prefix.field``), dataclass fields, instance attributes
      (``vars()``) and ``__slots__`` (``prefix.attr``; dataclass fields first, in declaration
      order, then other attributes in insertion order). Private attributes are included:
      builders keep persistent buffers in them.
    - Not expanded: scalars, strings, enums, dtypes, devices, modules, classes, functions and
      methods, sets, and objects without ``__dict__`` or ``__slots__`` (e.g. C++ handles).
    - Each container is expanded once, at the first path the walk reaches it by (the order
      is deterministic), which also breaks cycles; a tensor is listed under every path that
      refers to it directly, so two keys may map to the same tensor.
    - Containers deeper than ``max_depth`` below ``obj`` are skipped with a warning.
    - How a node is expanded is read from its class, once per class (whether it is a
      mapping, a named tuple (its class has ``_fields``), a list or tuple, or an object;
      dataclass fields and ``__slots__``); its instance attributes are read at every visit.
    - Read-only: attribute access uses ``vars()``/``getattr`` on stored attributes and never
      calls properties or methods of the walked objects.

    The result is ordered in walk order.
    """
    found: dict[str, torch.Tensor] = {}

    def leaf(node: object, path: str) -> bool:
        if isinstance(node, torch.Tensor):
            found[path] = node
            return True
        return False

    _walk(obj, prefix, max_depth, leaf, "walk_tensors")
    return found


def attribute_storages(obj: object) -> set[int]:
    """Storage addresses of the tensors among ``obj``'s instance attributes (``vars()``;
    other attributes, such as :class:`~speccheck.contract.metadata.AttentionInputBuffers`'
    cache of views of its buffers, are skipped, and nothing is walked further)."""
    return {t.untyped_storage().data_ptr() for t in vars(obj).values()
            if isinstance(t, torch.Tensor)}


def walk_host_values(
    obj: object, prefix: str = "", *, max_depth: int = DEFAULT_MAX_DEPTH
) -> dict[str, np.ndarray]:
    """Every host value reachable from ``obj``, keyed by its path below ``prefix``, as a
    numpy array the caller owns (a copy: later changes to ``obj`` do not reach it).

    Contract:

    - A host value is plain data, and a leaf of the walk:

      - numbers (``bool``, ``int``, ``float``, ``complex``, numpy scalars): a 0-d array of
        their own dtype;
      - lists and tuples (named tuples and ``torch.Size`` included) whose every element is
        a number: a 1-d array (an empty one is ``float64``);
      - numpy arrays of booleans or numbers (:data:`HOST_ARRAY_KINDS`): a copy;
      - ``None``, strings and enum members: a 0-d string array of their ``repr``, so that
        ``None``, ``'None'`` and an enum member named ``None`` stay apart;
      - an integer too large for numpy's integer types: its ``repr``, as a string array.

    - Everything else is walked exactly as :func:`walk_tensors` walks it (same containers,
      same paths, same order, same cycle handling and depth limit, same read-only attribute
      access), and contributes nothing itself: tensors (:func:`walk_tensors` covers them),
      bytes, dtypes, devices, modules, classes, functions and methods, sets, and objects
      without ``__dict__`` or ``__slots__``. Lists and tuples that hold anything but numbers
      are expanded (``prefix[i]``, or ``prefix.field`` for named tuples).
    - Only plain data compares: object identities (``id``, addresses) are never read. A
      builder that keeps a counter or an address in its metadata as a plain ``int`` makes
      it step-dependent metadata like any other.

    The result is ordered in walk order.
    """
    return walk_state(obj, prefix, max_depth=max_depth)[1]


def walk_state(
    obj: object, prefix: str = "", *, max_depth: int = DEFAULT_MAX_DEPTH
) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray]]:
    """``(walk_tensors(obj, prefix), walk_host_values(obj, prefix))``, in one walk.

    The two walks expand the same containers in the same order, except that the tensor
    walk also expands the lists and tuples of numbers (and numpy arrays) that the host walk
    takes as values, which hold no tensor: this walk takes them as host values and finds
    the same tensors. Containers deeper than ``max_depth`` are logged once, as
    :func:`walk_host_values` logs them.
    """
    tensors: dict[str, torch.Tensor] = {}
    values: dict[str, np.ndarray] = {}

    def leaf(node: object, path: str) -> bool:
        if isinstance(node, torch.Tensor):
            tensors[path] = node
            return True
        value = _host_leaf(node)
        if value is None:
            return False
        values[path] = value
        return True

    _walk(obj, prefix, max_depth, leaf, "walk_state")
    return tensors, values


def same_host_value(a: np.ndarray, b: np.ndarray) -> bool:
    """True when two :func:`walk_host_values` values have the same dtype, the same shape and
    equal elements (NaN equals NaN in the same position, ``-0.0`` equals ``0.0``)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))


def describe_host_value(a: np.ndarray) -> str:
    """A :func:`walk_host_values` value as the source would spell it: ``17``, ``True``,
    ``None``, ``'fa3'``, ``(1, 2, 3)``; arrays longer than eight elements abbreviated."""
    if a.ndim == 0 and a.dtype.kind == "U":
        return str(a.item())
    if a.ndim == 0:
        return repr(a.item())
    flat = a.reshape(-1).tolist()
    shown = ", ".join(repr(x) for x in flat[:8]) + (", ..." if len(flat) > 8 else "")
    body = f"({shown},)" if len(flat) == 1 else f"({shown})"
    return body if a.ndim == 1 else f"{body} (shape {a.shape})"


def _walk(
    obj: object, prefix: str, max_depth: int, leaf: Callable[[object, str], bool], name: str
) -> None:
    """The walk shared by :func:`walk_tensors`, :func:`walk_host_values` and
    :func:`walk_state`: ``leaf(node, path)`` records ``node`` and returns ``True`` when it is
    a leaf (which is then not expanded), else returns ``False``."""
    expanded: set[int] = set()
    truncated: list[str] = []

    def visit(node: object, path: str, depth: int) -> None:
        if leaf(node, path):
            return
        layout = _layout(node)
        if layout.kind is _Kind.OPAQUE or id(node) in expanded:
            return
        if depth > max_depth:
            truncated.append(path)
            return
        expanded.add(id(node))
        for child_path, child in _children(node, layout, path):
            visit(child, child_path, depth + 1)

    visit(obj, prefix, 0)
    if truncated:
        logger.warning(
            "%s stopped at max_depth=%d below %r; not expanded: %s",
            name,
            max_depth,
            prefix or "<root>",
            ", ".join(truncated[:5]) + (" ..." if len(truncated) > 5 else ""),
        )


def _is_number(node: object) -> bool:
    return isinstance(node, (bool, int, float, complex, np.number, np.bool_))


def _host_leaf(node: object) -> np.ndarray | None:
    """``node`` as a :func:`walk_host_values` value, ``None`` when it is not plain data."""
    if isinstance(node, np.ndarray):
        return node.copy() if node.dtype.kind in HOST_ARRAY_KINDS else None
    if _is_number(node) or (isinstance(node, (list, tuple)) and all(map(_is_number, node))):
        value = np.asarray(node)
        return value if value.dtype.kind in HOST_ARRAY_KINDS else np.asarray(repr(node))
    if node is None or isinstance(node, (str, enum.Enum)):
        return np.asarray(repr(node))
    return None


def _is_atomic(node: object) -> bool:
    return (
        isinstance(node, _ATOMIC_TYPES)
        or inspect.isroutine(node)
        or isinstance(node, (set, frozenset))
    )


def _attr_path(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


class _Kind(enum.Enum):
    """How the walk treats a node."""

    OPAQUE = enum.auto()
    """A tensor or an atomic value (:func:`_is_atomic`): never expanded."""
    MAPPING = enum.auto()
    NAMED_TUPLE = enum.auto()
    SEQUENCE = enum.auto()
    """A list or a tuple that is not a named tuple."""
    OBJECT = enum.auto()
    """Expanded by its stored attributes."""


class _Layout(NamedTuple):
    """What the walk reads of a node's class: its :class:`_Kind` and, for an ``OBJECT``, its
    dataclass field names and its ``__slots__`` (private names mangled)."""

    kind: _Kind
    fields: tuple[str, ...] = ()
    slots: tuple[str, ...] = ()


_LAYOUTS: dict[type, _Layout] = {}
""":func:`_layout` per class, made on the first node of each class."""


def _layout(node: object) -> _Layout:
    """How the walk treats ``node``: a function of its class, made once per class (a node
    whose ``__class__`` is not its type, such as a proxy, which ``isinstance`` judges by its
    ``__class__``, is classified on its own every time)."""
    cls = type(node)
    layout = _LAYOUTS.get(cls)
    if layout is None:
        layout = _classify(node)
        if node.__class__ is cls:
            _LAYOUTS[cls] = layout
    return layout


def _classify(node: object) -> _Layout:
    if isinstance(node, torch.Tensor) or _is_atomic(node):
        return _Layout(_Kind.OPAQUE)
    if isinstance(node, Mapping):
        return _Layout(_Kind.MAPPING)
    if isinstance(node, tuple) and hasattr(type(node), "_fields"):
        return _Layout(_Kind.NAMED_TUPLE)
    if isinstance(node, (list, tuple)):
        return _Layout(_Kind.SEQUENCE)
    cls = type(node)
    fields = tuple(f.name for f in dataclasses.fields(cls)) if dataclasses.is_dataclass(cls) else ()
    slots: dict[str, None] = {}
    for owner in cls.__mro__:
        declared = owner.__dict__.get("__slots__", ())
        if isinstance(declared, str):
            declared = (declared,)
        for name in declared:
            if name in ("__dict__", "__weakref__"):
                continue
            if name.startswith("__") and not name.endswith("__"):
                name = f"_{owner.__name__.lstrip('_')}{name}"  # private-name mangling
            slots[name] = None
    return _Layout(_Kind.OBJECT, fields, tuple(slots))


def _children(node: object, layout: _Layout, path: str) -> Iterator[tuple[str, object]]:
    """Direct children of a node that is not ``OPAQUE``, with their paths."""
    if layout.kind is _Kind.MAPPING:
        for key, value in cast(Mapping[object, object], node).items():
            yield f"{path}[{key!r}]", value
        return
    if layout.kind is _Kind.NAMED_TUPLE:
        named = cast(Any, node)
        for name, value in zip(named._fields, named, strict=True):
            yield _attr_path(path, name), value
        return
    if layout.kind is _Kind.SEQUENCE:
        for i, value in enumerate(cast(Sequence[object], node)):
            yield f"{path}[{i}]", value
        return
    instance_dict = getattr(node, "__dict__", None)
    if not isinstance(instance_dict, dict):
        instance_dict = {}
    for name in _attribute_names(layout, instance_dict):
        # Instance-dict entries are read directly so that a same-named property on the class
        # is never called; dataclass fields and slots not in it go through their descriptor.
        value = instance_dict[name] if name in instance_dict else getattr(node, name, _MISSING)
        if value is not _MISSING:
            yield _attr_path(path, name), value


def _attribute_names(layout: _Layout, instance_dict: Mapping[str, object]) -> list[str]:
    """Stored attribute names of an ``OBJECT`` node: dataclass fields, ``vars()``,
    ``__slots__``, in that order, each once."""
    if not layout.fields and not layout.slots:
        return list(instance_dict)
    names = dict.fromkeys(layout.fields)
    names.update(dict.fromkeys(instance_dict))
    names.update(dict.fromkeys(layout.slots))
    return list(names)


def snapshot(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached clones of ``tensors`` (same keys, same devices), immune to later in-place
    writes. Host work: on a GPU, call it outside capture."""
    return {path: t.detach().clone() for path, t in tensors.items()}


def same_value(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when ``a`` and ``b`` have the same shape, the same dtype and exactly equal values.

    NaN equals NaN (in the same position), ``-0.0`` equals ``0.0``; complex values compare
    their real and imaginary parts separately. ``b`` is moved to ``a``'s device when they
    differ. Synchronises with the device: verifier-side only.
    """
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if b.device != a.device:
        b = b.to(a.device)
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    if torch.equal(a, b):
        return True
    if not a.is_floating_point():
        return False
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def changed_paths(snapshots: Sequence[Mapping[str, torch.Tensor]]) -> set[str]:
    """Paths whose tensor differs between some pair of consecutive snapshots.

    Differ means :func:`same_value` is false, or the path is present in one snapshot and
    absent from the next (a field that appears or disappears changed). Fewer than two
    snapshots: nothing changed.
    """
    changed: set[str] = set()
    for before, after in zip(snapshots, snapshots[1:]):
        for path in before.keys() | after.keys():
            if path in changed:
                continue
            if path not in before or path not in after or not same_value(before[path], after[path]):
                changed.add(path)
    return changed

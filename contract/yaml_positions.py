"""YAML loading that remembers where every value came from, within fixed bounds.

:class:`PositionTrackingLoader` is a ``yaml.SafeLoader`` that, besides the plain Python data,
records the 1-based line of every mapping key and value and every sequence item, keyed by
the item's path (``("backends", 2, "draft_decode", "supported")``), and reports keys that
appear twice in one mapping (PyYAML itself silently keeps the last one). Timestamps are not
resolved, so dates stay strings, and a plain ``=`` is a string too.

It is also the boundary that untrusted text crosses: whatever the input, loading either
succeeds or raises a ``yaml.YAMLError`` whose mark carries the line, never another
exception. On top of PyYAML's own syntax errors it refuses, each with the line where it is
found (as :class:`RejectedYaml`):

- U+2028, U+2029 and U+0085 anywhere: YAML reads them as line breaks and editors do not,
  so text that looks like a comment would be live and every later line number would be off
  (lines are counted at ``\\n``, ``\\r\\n`` and ``\\r``, as YAML and editors both do);
- explicit tags other than :data:`ALLOWED_TAGS` (``!!timestamp``, ``!!binary``,
  ``!!python/...``, local tags), and a scalar tagged ``!!int``, ``!!float``, ``!!bool`` or
  ``!!null`` whose text is not such a value (``!!int abc``, ``!!bool maybe``);
- integers outside the signed 64-bit range (:data:`MAX_INT`), however they are written;
- scalars (keys included) longer than :data:`MAX_SCALAR_LENGTH` characters;
- nesting deeper than :data:`MAX_DEPTH` levels, counted through aliases and merge keys;
- more than :data:`MAX_NODES` values, or more than :data:`MAX_SCALAR_CHARACTERS` characters
  of scalars, once every alias and merge key is expanded (no "billion laughs", no
  quadratic merge chains);
- an alias inside the node it refers to (a recursive structure);
- any value PyYAML's constructors fail on, whatever the exception.

Together with a bounded file size these bound the time and memory of loading and of
everything downstream (validation, rendering) by the limits above.
"""

from __future__ import annotations

import reprlib
from dataclasses import dataclass
from typing import Any

import yaml

Path = tuple[object, ...]

MAX_DEPTH = 32
"""Deepest nesting of collections and scalars, the root being level 1; a value reached
through an alias or a merge key counts at the depth where it is used."""

MAX_NODES = 20_000
"""Most values (scalars, sequences, mappings, keys included) after expanding every alias."""

MAX_SCALAR_LENGTH = 4096
"""Longest scalar (a key or a value), in characters."""

MAX_SCALAR_CHARACTERS = 1 << 20
"""Most characters of scalars in the whole document after expanding every alias."""

MAX_INT = 2**63 - 1
"""Integers must lie in ``[-MAX_INT, MAX_INT]``."""

_YAML_TAG = "tag:yaml.org,2002:"
_MERGE_TAG = _YAML_TAG + "merge"
_INT_TAG = _YAML_TAG + "int"
_FLOAT_TAG = _YAML_TAG + "float"
_BOOL_TAG = _YAML_TAG + "bool"
_NULL_TAG = _YAML_TAG + "null"
_UNRESOLVED_TAGS = (_YAML_TAG + "timestamp", _YAML_TAG + "value")

ALLOWED_TAGS = ("!!str", "!!int", "!!float", "!!bool", "!!null", "!!seq", "!!map")
"""The explicit tags a document may use: the core YAML types. PyYAML's other safe tags
(``!!timestamp``, ``!!binary``, ``!!set``, ``!!omap``, ``!!pairs``) are refused too."""

_SCALAR_SPELLINGS = {
    _INT_TAG: (frozenset({_INT_TAG}), "an integer"),
    _FLOAT_TAG: (frozenset({_FLOAT_TAG, _INT_TAG}), "a number"),
    _BOOL_TAG: (frozenset({_BOOL_TAG}), "true or false"),
    _NULL_TAG: (frozenset({_NULL_TAG}), "null"),
}
"""For each checked scalar tag: the tags its text may resolve to as a plain scalar, and what
the text must be, in words."""

_SAFE_CONSTRUCTORS = yaml.SafeLoader.yaml_constructors

_LINE_SEPARATORS = {
    "\u2028": "U+2028 LINE SEPARATOR",
    "\u2029": "U+2029 PARAGRAPH SEPARATOR",
    "\x85": "U+0085 NEXT LINE",
}
_MAX_INT_TEXT = 100
"""Longer integer literals are out of range whatever their digits (checked before
conversion, which Python limits and which is slow for huge sexagesimal values)."""

_SHORT = reprlib.Repr()
_SHORT.maxstring = 40
_SHORT.maxother = 40


@dataclass(frozen=True)
class NodePosition:
    """Where one value sits: the line of its key (``None`` for a sequence item or the
    document root) and the line where the value itself starts, both 1-based."""

    key_line: int | None
    value_line: int

    @property
    def line(self) -> int:
        """The line to point an editor at: the key's if there is one, else the value's."""
        return self.key_line if self.key_line is not None else self.value_line


@dataclass(frozen=True)
class DuplicateKey:
    """A key that occurs more than once in one mapping: ``path`` ends with the key; ``line``
    is the repeated occurrence and ``first_line`` the first one (both 1-based)."""

    path: Path
    line: int
    first_line: int


@dataclass(frozen=True)
class LoadedYaml:
    """The result of :meth:`PositionTrackingLoader.load_with_positions`."""

    data: object
    positions: dict[Path, NodePosition]
    duplicate_keys: tuple[DuplicateKey, ...]


class RejectedYaml(yaml.MarkedYAMLError):
    """Input the loader refuses on purpose (see the module docstring). ``problem`` is the
    whole reason, one line; ``problem_mark`` is where (0-based line, as all YAML marks)."""

    def __init__(self, problem: str, mark: Any) -> None:
        super().__init__(problem=problem, problem_mark=mark)


@dataclass(frozen=True)
class _Extent:
    """A composed node once every alias below it is expanded."""

    nodes: int
    characters: int
    height: int


def line_at(text: str, index: int) -> int:
    """The 1-based line of character ``index`` of ``text``, counting ``\\n``, ``\\r\\n`` and
    a lone ``\\r`` as line breaks, as YAML and editors both do."""
    prefix = text[:index]
    return prefix.count("\n") + prefix.count("\r") - prefix.count("\r\n") + 1


def _show_tag(tag: str) -> str:
    shown = "!!" + tag[len(_YAML_TAG):] if tag.startswith(_YAML_TAG) else tag
    return _SHORT.repr(shown)[1:-1]


class PositionTrackingLoader(yaml.SafeLoader):
    """A bounded ``SafeLoader`` that also records positions and duplicate keys of one
    document.

    Use :meth:`load_with_positions` instead of ``yaml.load``. Values reached through an
    alias get no positions of their own (look up the nearest recorded ancestor instead), and
    keys merged in with ``<<`` are not duplicate-checked, as overriding them is intended.
    Raises ``yaml.YAMLError`` (with a mark wherever the position is known) for malformed or
    refused input, and nothing else.
    """

    yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag not in _UNRESOLVED_TAGS]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }

    def __init__(self, stream: str) -> None:
        for character, name in _LINE_SEPARATORS.items():
            index = stream.find(character)
            if index >= 0:
                line = line_at(stream, index)
                column = index - max(stream.rfind("\n", 0, index), stream.rfind("\r", 0, index))
                raise RejectedYaml(
                    f"character {name} at column {column} is not allowed: YAML reads it as a "
                    "line break, editors do not",
                    yaml.Mark("<matrix>", index, line - 1, column - 1, None, None),
                )
        super().__init__(stream)
        self._depth = 0
        self._open_anchors: set[str] = set()
        self._extents: dict[int, _Extent] = {}
        self._expanded_nodes = 0
        self._expanded_characters = 0

    def load_with_positions(self) -> LoadedYaml:
        """Compose and construct the single document of the stream (``None`` when empty).

        The loader is disposed afterwards; create a new one per stream.
        """
        try:
            node = self.get_single_node()
            positions: dict[Path, NodePosition] = {}
            duplicates: list[DuplicateKey] = []
            if node is None:
                return LoadedYaml(None, positions, ())
            positions[()] = NodePosition(None, node.start_mark.line + 1)
            self._record(node, (), positions, duplicates, set())
            data = self.construct_document(node)
            return LoadedYaml(data, positions, tuple(duplicates))
        finally:
            self.dispose()

    # ------------------------------------------------------------ composing, bounded
    def compose_node(self, parent: Any, index: Any) -> Any:
        """PyYAML's ``compose_node``, counting depth and the expanded size as it goes."""
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            if event.anchor in self._open_anchors:
                raise RejectedYaml(
                    f"alias *{_SHORT.repr(event.anchor)[1:-1]} is used inside the node it "
                    "refers to; recursive structures are not allowed", event.start_mark,
                )
            node = super().compose_node(parent, index)
            extent = self._extents[id(node)]
            if self._depth + extent.height > MAX_DEPTH:
                raise RejectedYaml(
                    f"through this alias the document nests more than {MAX_DEPTH} levels "
                    "deep (aliases and merge keys count at the depth where they are used)",
                    event.start_mark,
                )
            self._count(extent.nodes, extent.characters, event.start_mark)
            return node
        if self._depth >= MAX_DEPTH:
            raise RejectedYaml(f"the document nests more than {MAX_DEPTH} levels deep",
                               event.start_mark)
        if event.anchor is not None:
            self._open_anchors.add(event.anchor)
        self._depth += 1
        node = super().compose_node(parent, index)
        self._depth -= 1
        self._open_anchors.discard(event.anchor)
        if isinstance(node, yaml.ScalarNode):
            if len(node.value) > MAX_SCALAR_LENGTH:
                raise RejectedYaml(
                    f"this value is {len(node.value)} characters long; at most "
                    f"{MAX_SCALAR_LENGTH} are allowed", node.start_mark,
                )
            extent = _Extent(1, len(node.value), 1)
        else:
            children = node.value
            if isinstance(node, yaml.MappingNode):
                children = [child for pair in node.value for child in pair]
            below = [self._extents[id(child)] for child in children]
            extent = _Extent(
                1 + sum(child.nodes for child in below),
                sum(child.characters for child in below),
                1 + max((child.height for child in below), default=0),
            )
        self._extents[id(node)] = extent
        own_characters = len(node.value) if isinstance(node, yaml.ScalarNode) else 0
        self._count(1, own_characters, node.start_mark)
        return node

    def _count(self, nodes: int, characters: int, mark: Any) -> None:
        """Add to the document's expanded size; refuse it past the limits."""
        self._expanded_nodes += nodes
        self._expanded_characters += characters
        if self._expanded_nodes > MAX_NODES:
            raise RejectedYaml(
                f"the document holds more than {MAX_NODES} values (aliases and merge keys "
                "expanded)", mark,
            )
        if self._expanded_characters > MAX_SCALAR_CHARACTERS:
            raise RejectedYaml(
                f"the document holds more than {MAX_SCALAR_CHARACTERS} characters of values "
                "(aliases and merge keys expanded)", mark,
            )

    # ------------------------------------------------------------ constructing, checked
    def construct_object(self, node: Any, deep: bool = False) -> Any:
        """PyYAML's ``construct_object``; whatever a constructor raises becomes a
        :class:`RejectedYaml` at the node (PyYAML's constructors are not total: ``0b_``
        resolves as an integer and then fails to convert)."""
        try:
            return super().construct_object(node, deep=deep)
        except yaml.YAMLError:
            raise
        except (ValueError, TypeError, LookupError, AttributeError, ArithmeticError):
            what = _SHORT.repr(node.value) if isinstance(node, yaml.ScalarNode) else "this value"
            raise RejectedYaml(f"cannot read {what} as {_show_tag(node.tag)}",
                               node.start_mark) from None

    def construct_checked_scalar(self, node: Any) -> Any:
        """Construct an ``!!int``/``!!float``/``!!bool``/``!!null`` scalar whose text is a
        value of its tag, as a plain scalar would resolve it; integers within ±MAX_INT."""
        if isinstance(node, yaml.ScalarNode):
            resolvable, words = _SCALAR_SPELLINGS[node.tag]
            if self.resolve(yaml.ScalarNode, node.value, (True, False)) not in resolvable:
                raise RejectedYaml(
                    f"{_SHORT.repr(node.value)} is not {words}, as its tag "
                    f"{_show_tag(node.tag)} requires", node.start_mark,
                )
            if node.tag == _INT_TAG and len(node.value) > _MAX_INT_TEXT:
                raise self._out_of_range(node)
        value = _SAFE_CONSTRUCTORS[node.tag](self, node)
        if node.tag == _INT_TAG and abs(value) > MAX_INT:
            raise self._out_of_range(node)
        return value

    @staticmethod
    def _out_of_range(node: Any) -> RejectedYaml:
        return RejectedYaml(
            f"integer {_SHORT.repr(node.value)} is out of range: integers must lie within "
            f"±{MAX_INT} (64 bits)", node.start_mark,
        )

    def construct_refused(self, node: Any) -> Any:
        """Refuse a tag outside :data:`ALLOWED_TAGS` (including a ``<<`` used as a value)."""
        if node.tag == _MERGE_TAG:
            raise RejectedYaml("'<<' is a merge key; it cannot be used as a value",
                               node.start_mark)
        raise RejectedYaml(
            f"tag {_show_tag(node.tag)} is not allowed; use no tag or one of "
            f"{', '.join(ALLOWED_TAGS)}", node.start_mark,
        )

    yaml_constructors: dict[str | None, Any] = {
        **{tag: _SAFE_CONSTRUCTORS[tag] for tag in (_YAML_TAG + "str", _YAML_TAG + "seq",
                                                    _YAML_TAG + "map")},
        **dict.fromkeys(_SCALAR_SPELLINGS, construct_checked_scalar),
        None: construct_refused,
    }

    # ------------------------------------------------------------ positions
    def _record(
        self,
        node: yaml.Node,
        path: Path,
        positions: dict[Path, NodePosition],
        duplicates: list[DuplicateKey],
        visited: set[int],
    ) -> None:
        if id(node) in visited:
            return
        visited.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            for index, item in enumerate(node.value):
                item_path = (*path, index)
                positions[item_path] = NodePosition(None, item.start_mark.line + 1)
                self._record(item, item_path, positions, duplicates, visited)
        elif isinstance(node, yaml.MappingNode):
            first_lines: dict[object, int] = {}
            for key_node, value_node in node.value:
                if key_node.tag == _MERGE_TAG or not isinstance(key_node, yaml.ScalarNode):
                    continue
                key = self.construct_object(key_node)
                key_line = key_node.start_mark.line + 1
                item_path = (*path, key)
                if key in first_lines:
                    duplicates.append(DuplicateKey(item_path, key_line, first_lines[key]))
                else:
                    first_lines[key] = key_line
                positions[item_path] = NodePosition(key_line, value_node.start_mark.line + 1)
                self._record(value_node, item_path, positions, duplicates, visited)


def load_yaml_with_positions(source: str) -> LoadedYaml:
    """Load one YAML document from ``source`` with positions, within the module's bounds;
    raises ``yaml.YAMLError`` (:class:`RejectedYaml` for refused input) and nothing else."""
    return PositionTrackingLoader(source).load_with_positions()

"""YAML loading that remembers where every value came from.

:class:`PositionTrackingLoader` is a ``yaml.SafeLoader`` that, besides the plain Python data,
records the 1-based line of every mapping key and value and every sequence item, keyed by
the item's path (``("backends", 2, "draft_decode", "supported")``), and reports keys that
appear twice in one mapping (PyYAML itself silently keeps the last one). Timestamps are not
resolved, so dates stay strings.
"""

from __future__ import annotations

from dataclasses import dataclass

import yaml

Path = tuple[object, ...]

_MERGE_TAG = "tag:yaml.org,2002:merge"


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


class PositionTrackingLoader(yaml.SafeLoader):
    """A ``SafeLoader`` that also records positions and duplicate keys of one document.

    Use :meth:`load_with_positions` instead of ``yaml.load``. Values reached through an
    alias get no positions of their own (look up the nearest recorded ancestor instead), and
    keys merged in with ``<<`` are not duplicate-checked, as overriding them is intended.
    Raises ``yaml.YAMLError`` for malformed input, like ``yaml.safe_load``.
    """

    yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:timestamp"]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }

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


def load_yaml_with_positions(source: str | bytes) -> LoadedYaml:
    """Load one YAML document from ``source`` with positions; raises ``yaml.YAMLError``."""
    return PositionTrackingLoader(source).load_with_positions()

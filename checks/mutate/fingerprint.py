"""Fingerprints of code: what a saved gate ran (:func:`code_fingerprint`) and what judged a
mutant (:func:`verify_fingerprint`).

A saved gate is reused only on the very files a mutant's run copies. A mutant's judgement
needs less: it stands as long as the code ``speccheck verify`` runs is the same. The mutation
tool itself, the status and docs writers and the equivalence arguments change what is
*reported* of a judgement, never the judgement, so a survivor judged before such a change
need not run again (``speccheck mutate --resume`` runs again only the survivors another
verify judged).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from pathlib import Path

import speccheck
from speccheck.checks.mutate.equivalents import EQUIVALENTS_FILE
from speccheck.checks.mutate.shadow import shadowed_files
from speccheck.checks.mutate.targets import TargetModule

VERIFY_INDEPENDENT: tuple[str, ...] = (
    "checks/mutate/", "checks/cli/mutate.py", "checks/status/", "checks/cli/status.py",
    "checks/docgen/",
)
"""speccheck's files (paths inside the package, a folder ending in ``/``) that a verify run
imports at most, never calls: the mutation tool, the status record and the docs writers."""
VERIFY_READS = frozenset({".py", ".yaml", ".yml", ".json"})
"""The kinds of file a verify run reads of a package: its code and its data (the matrix);
a README or a ``pyproject.toml`` beside them is not read."""
VERIFY_FINGERPRINT_LENGTH = 16
"""Hex digits kept of a verify fingerprint (it tells runs apart, it protects nothing)."""


def _hex_digest(files: Iterable[tuple[str, Path]]) -> str:
    digest = hashlib.sha256()
    for name, path in files:
        digest.update(f"{name}\0".encode())
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def _package_files(packages: Iterable[tuple[str, Path]]) -> Iterable[tuple[str, str, Path]]:
    """``(package, path inside it, file)`` for every file a mutant's run copies of
    ``packages`` (import name and folder), in a stable order."""
    for package, folder in sorted(set(packages)):
        for path in shadowed_files(folder):
            yield package, path.relative_to(folder).as_posix(), path


def _named(files: Iterable[tuple[str, str, Path]]) -> Iterable[tuple[str, Path]]:
    return ((f"{package}/{inside}", path) for package, inside, path in files)


def code_fingerprint(targets: Sequence[TargetModule]) -> str:
    """The SHA-256 of every file a mutant's run copies of ``targets``' packages, each with
    its path inside its package."""
    return _hex_digest(_named(_package_files((t.package, t.package_dir) for t in targets)))


def _judges(package: str, inside: str) -> bool:
    path = Path(inside)
    if path.suffix not in VERIFY_READS or path.name == EQUIVALENTS_FILE:
        return False
    return not (package == speccheck.__name__ and any(
        inside == skipped or (skipped.endswith("/") and inside.startswith(skipped))
        for skipped in VERIFY_INDEPENDENT))


def verify_fingerprint(targets: Sequence[TargetModule]) -> str:
    """The code that judges a mutant of ``targets``: the files verify reads
    (:data:`VERIFY_READS`) of speccheck's package and of the targets' packages, less
    :data:`VERIFY_INDEPENDENT` and the equivalence arguments, hashed with their paths
    (:data:`VERIFY_FINGERPRINT_LENGTH` hex digits). Equal fingerprints: a mutant judged
    under one is judged the same under the other."""
    own = Path(speccheck.__file__).resolve().parent
    packages = [(speccheck.__name__, own), *((t.package, t.package_dir) for t in targets)]
    files = (item for item in _package_files(packages) if _judges(*item[:2]))
    return _hex_digest(_named(files))[:VERIFY_FINGERPRINT_LENGTH]

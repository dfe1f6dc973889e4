"""Examples of ``speccheck verify`` (a step count K and a :class:`DraftBatch`) as JSON and as
the ``--reproduce`` blobs that failure reports print.

A blob is URL-safe base64 of zlib-compressed JSON. Blobs arrive on command lines, inline or
as ``@FILE`` (:func:`read_reproduce`: the form a report prints for a blob too long for one
argument, :func:`reproduce_command`), so decoding treats them as untrusted:
:func:`decode_example` either returns an example that satisfies every invariant of
:class:`DraftBatch` that does not depend on the runtime configuration, or raises
``ValueError`` with one line starting ``--reproduce:``; never another exception, and within
bounded time and memory. The bounds: at most
:data:`MAX_BLOB_CHARS` characters of blob and :data:`MAX_JSON_BYTES` bytes once inflated;
strict JSON types (an integer is a JSON integer, never a float, a string or ``true``; a list
is a JSON array, never a string); the value ranges and list lengths of :class:`ExampleData`;
nesting beyond what the schema needs fails in the JSON parser (pydantic's, which has a
recursion limit), not in Python's. Whether the batch fits a particular configuration
(``max_model_len``, the number of blocks) is checked by ``DraftBatch.validate`` where the
configuration is known.
"""

from __future__ import annotations

import base64
import functools
import json
import zlib
from pathlib import Path
from typing import Annotated, Any, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from speccheck.checks.verify.scale import MAX_NEW_TOKENS, MAX_REQUESTS
from speccheck.contract.bounded_read import UnreadableFile, printable_path, read_regular_file
from speccheck.speculator.batch import DraftBatch

Example = tuple[int, DraftBatch]
"""``(num_speculative_steps, batch)``."""

MAX_JSON_BYTES = 1 << 20
"""Most bytes a blob may inflate to (1 MiB)."""

MAX_BLOB_CHARS = 1_500_000
"""Longest blob accepted: base64 of what :data:`MAX_JSON_BYTES` of JSON compress to at
worst (zlib adds at most a few bytes per 16 KiB stored), with room to spare."""

MAX_ARGUMENT_CHARS = 100_000
"""Longest blob a reproduce command passes inline; a longer one (a serving-scale batch:
hundreds of kilobytes) goes to a file passed as ``@FILE``. Linux refuses a single
command-line argument over 128 KiB."""

REPRODUCE_DIR = Path("speccheck-reproduce")
"""Where, relative to the working directory, reproduce commands keep blobs too long to
pass inline (one file per blob, named by its CRC-32)."""

REPRODUCE_FILE = "@"
"""A ``--reproduce`` argument that starts so names a file holding the blob."""

MAX_STEPS = 64
"""Largest ``num_speculative_steps`` (K)."""

MAX_BLOCKS_PER_REQUEST = 1 << 16
"""Longest block-table row."""

MAX_POSITION = 1 << 24
"""Largest context length, token id and block id (16 Mi)."""

MAX_SEED = 2**63 - 1
"""Largest sampling seed."""

_Position = Annotated[int, Field(ge=0, le=MAX_POSITION)]
_Block = Annotated[int, Field(ge=1, le=MAX_POSITION)]
_Rows = Field(min_length=1, max_length=MAX_REQUESTS)


class ExampleData(BaseModel):
    """The JSON form of an example, strictly typed and bounded. Invariants checked here:
    every per-request list has one row per request, every request has at least one new
    token and one block, and no physical block belongs to two requests (block 0, the sink,
    to none)."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    num_speculative_steps: Annotated[int, Field(ge=1, le=MAX_STEPS)]
    context_lens: Annotated[list[_Position], _Rows]
    new_tokens: Annotated[
        list[Annotated[list[_Position], Field(min_length=1, max_length=MAX_NEW_TOKENS)]], _Rows
    ]
    block_table: Annotated[
        list[Annotated[list[_Block], Field(min_length=1, max_length=MAX_BLOCKS_PER_REQUEST)]],
        _Rows,
    ]
    seeds: Annotated[list[Annotated[int, Field(ge=0, le=MAX_SEED)]], _Rows]

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        requests = len(self.context_lens)
        for name in ("new_tokens", "block_table", "seeds"):
            rows = len(getattr(self, name))
            if rows != requests:
                raise PydanticCustomError(
                    "rows", "{name} has {rows} rows but context_lens has {requests}",
                    {"name": name, "rows": rows, "requests": requests},
                )
        blocks = [block for row in self.block_table for block in row]
        if len(blocks) != len(set(blocks)):
            raise PydanticCustomError("shared_blocks", "block_table rows share physical blocks")
        return self

    def example(self) -> Example:
        """The example this describes."""
        return self.num_speculative_steps, DraftBatch(
            tuple(self.context_lens),
            tuple(tuple(row) for row in self.new_tokens),
            tuple(tuple(row) for row in self.block_table),
            tuple(self.seeds),
        )


class BadExample(ValueError):
    """A ``--reproduce`` example this run cannot take: not an example, or outside the
    harness's limits. The message is one line (for the latter, naming the limit and the
    option that raises it); ``speccheck verify`` prints it and exits 2."""


def reproduce_command(prefix: str, blob: str) -> str:
    """The command that runs the example of ``blob`` alone: ``PREFIX --reproduce BLOB``
    (``prefix`` is a ``speccheck verify`` command line without ``--reproduce``). A blob
    longer than :data:`MAX_ARGUMENT_CHARS` is written to :data:`REPRODUCE_DIR` in the
    working directory, and the command reads it from there: ``--reproduce @FILE``."""
    if len(blob) <= MAX_ARGUMENT_CHARS:
        return f"{prefix} --reproduce {blob}"
    REPRODUCE_DIR.mkdir(exist_ok=True)
    path = REPRODUCE_DIR / f"{zlib.crc32(blob.encode()):08x}.blob"
    path.write_text(blob + "\n")
    return f"{prefix} --reproduce {REPRODUCE_FILE}{path}"


def reproduce_blob(command: str) -> str:
    """The blob of a command :func:`reproduce_command` made (neither blobs nor the files it
    writes have spaces in their names), read from its file where it names one."""
    return read_reproduce(command.rsplit(" --reproduce ", 1)[1])


def read_reproduce(argument: str) -> str:
    """The blob of a ``--reproduce`` argument: the argument itself, or for ``@FILE`` what
    the file holds (surrounding whitespace dropped), read no further than a blob may be
    long (a regular file only: a FIFO or a device is refused, never waited on). Raises
    ``ValueError`` with one line naming the file when it cannot be read, holds
    more than :data:`MAX_BLOB_CHARS` characters or is not ASCII; whether the text is a blob
    is :func:`decode_example`'s to say."""
    if not argument.startswith(REPRODUCE_FILE):
        return argument
    path = argument[len(REPRODUCE_FILE):]
    if not path:
        raise ValueError(f"--reproduce: {REPRODUCE_FILE} names no file (give {REPRODUCE_FILE}FILE)")
    shown = printable_path(path)
    try:
        raw = read_regular_file(path, MAX_BLOB_CHARS + 1)  # a blob and its newline
    except UnreadableFile as exc:
        raise ValueError(f"--reproduce: cannot read {shown}: {exc}") from None
    if len(raw) > MAX_BLOB_CHARS + 1:
        raise ValueError(f"--reproduce: {shown} holds more than {MAX_BLOB_CHARS} characters, "
                         "more than any example blob")
    try:
        return raw.decode("ascii").strip()
    except UnicodeDecodeError:
        raise ValueError(f"--reproduce: {shown} is not an example blob (not ASCII text)") from None


def example_json(example: Example) -> dict[str, Any]:
    """The JSON-serialisable form of ``example`` (lists, not tuples)."""
    k, batch = example
    return {"num_speculative_steps": k, "context_lens": list(batch.context_lens),
            "new_tokens": [list(r) for r in batch.new_tokens],
            "block_table": [list(r) for r in batch.block_table], "seeds": list(batch.seeds)}


def example_from_json(data: dict[str, Any]) -> Example:
    """The example :func:`example_json` made ``data`` from; raises ``ValueError`` with one
    line (``not an example: ...``) when ``data`` is not a valid :class:`ExampleData`."""
    try:
        return ExampleData.model_validate(data).example()
    except ValidationError as exc:
        raise ValueError(f"not an example: {_first_error(exc)}") from None


@functools.lru_cache(maxsize=1)
def _example_bytes(example: Example) -> bytes:
    """:func:`example_json` of ``example`` as UTF-8 JSON. The last example's is kept: a
    worker reads it twice per example (its progress line and its KV noise's seed), and at
    the GPU tier's scale it is hundreds of kilobytes."""
    return json.dumps(example_json(example)).encode()


def encode_example(example: Example) -> str:
    """A compact, URL-safe blob for ``--reproduce``. zlib's fastest level: a worker encodes
    every example it starts (its progress line), and at the GPU tier's scale the default
    level takes about 25 ms an example against 4 for a blob a sixth larger."""
    return base64.urlsafe_b64encode(zlib.compress(_example_bytes(example), 1)).decode()


def example_digest(example: Example) -> int:
    """A 32-bit digest of ``example`` (CRC-32 of its JSON): a seed that is a function of the
    example alone."""
    return zlib.crc32(_example_bytes(example))


def decode_example(blob: str) -> Example:
    """The example of a ``--reproduce`` blob. Raises ``ValueError`` with one line,
    ``--reproduce: not an example blob (WHY)``, for anything else (see the module
    docstring), and nothing but ``ValueError``."""
    if len(blob) > MAX_BLOB_CHARS:
        raise _not_a_blob(f"{len(blob)} characters; at most {MAX_BLOB_CHARS} are accepted")
    try:
        compressed = base64.urlsafe_b64decode(blob)
    except ValueError:
        raise _not_a_blob("not URL-safe base64") from None
    inflater = zlib.decompressobj()
    try:
        raw = inflater.decompress(compressed, MAX_JSON_BYTES + 1)
    except zlib.error:
        raise _not_a_blob("not zlib-compressed data") from None
    if len(raw) > MAX_JSON_BYTES:
        raise _not_a_blob(f"it inflates to more than {MAX_JSON_BYTES} bytes")
    if not inflater.eof:
        raise _not_a_blob("the compressed data is truncated")
    try:
        return ExampleData.model_validate_json(raw).example()
    except ValidationError as exc:
        raise _not_a_blob(_first_error(exc)) from None


def _not_a_blob(why: str) -> ValueError:
    return ValueError(f"--reproduce: not an example blob ({why})")


def _first_error(exc: ValidationError) -> str:
    """``FIELD[INDEX]: message`` of the first error, plus how many more there are; one line."""
    errors = exc.errors(include_url=False, include_input=False)
    first = errors[0]
    where = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in first["loc"])
    message = " ".join(first["msg"].split())
    text = f"{where.lstrip('.')}: {message}" if where else message
    more = len(errors) - 1
    return text + (f" (and {more} more problem{'s' if more != 1 else ''})" if more else "")

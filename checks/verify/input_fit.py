"""Whether an example (a ``--reproduce`` blob, typically) fits the harness a run builds:
:func:`check_fits` raises an :class:`ExampleDoesNotFit` that carries the limit the example
crosses, as data; :func:`speccheck.checks.verify.report.misfit_line` says it to a user."""

from __future__ import annotations

from dataclasses import dataclass

from speccheck.checks.verify.examples import Example
from speccheck.contract.builder import blocks_for
from speccheck.speculator.base import SpeculatorOptions


class ExampleDoesNotFit(ValueError):
    """An example crosses a limit of the run's harness; subclasses carry which one."""


@dataclass(eq=False)
class TooManyRequests(ExampleDoesNotFit):
    """More requests than the run serves (its largest capture size)."""

    requests: int
    most: int


@dataclass(eq=False)
class TooManyPrefillTokens(ExampleDoesNotFit):
    """More prefill tokens than the drafter holds: ``per_request`` per request of the
    largest capture size, ``most`` in all."""

    tokens: int
    most: int
    per_request: int


@dataclass(eq=False)
class PastMaxModelLen(ExampleDoesNotFit):
    """Request ``request`` reaches ``context + new_tokens`` positions, past ``max_model_len``."""

    request: int
    context: int
    new_tokens: int
    max_model_len: int


@dataclass(eq=False)
class BlockTableTooWide(ExampleDoesNotFit):
    """Request ``request``'s block-table row has ``blocks`` entries, more than the ``most`` a
    request holds at ``max_model_len`` and ``block_size``."""

    request: int
    blocks: int
    most: int
    max_model_len: int
    block_size: int


@dataclass(eq=False)
class BlockPastCache(ExampleDoesNotFit):
    """Block id ``block`` (request ``request``) is past the KV cache's ``live_blocks``."""

    block: int
    request: int
    live_blocks: int


@dataclass(eq=False)
class TokenOutsideVocabulary(ExampleDoesNotFit):
    """Token id ``token`` (request ``request``) is outside the drafter's vocabulary."""

    token: int
    request: int
    vocab_size: int


@dataclass(eq=False)
class LayoutMismatch(ExampleDoesNotFit):
    """The batch was made for another configuration: ``DraftBatch.validate`` rejects it for
    ``reason`` at ``block_size``, ``max_model_len`` and ``k`` draft steps."""

    block_size: int
    max_model_len: int
    k: int
    reason: str


def check_fits(
    example: Example, options: SpeculatorOptions, *, block_size: int, max_model_len: int,
    vocab_size: int, max_new_tokens: int,
) -> None:
    """Raise the :class:`ExampleDoesNotFit` of the first limit ``example`` crosses; return
    when it fits. The limits: requests and prefill tokens (``options``, from the capture
    sizes and ``max_new_tokens``), lengths and block-table rows (``max_model_len``,
    ``block_size``), block ids (the KV cache ``options`` sizes) and token ids (the drafter's
    ``vocab_size``). What else ``DraftBatch.validate`` rejects (block-table rows too short
    for the example's K) means the example was made for another configuration."""
    k, batch = example
    bs, mml = block_size, max_model_len
    prefill = sum(len(tokens) for tokens in batch.new_tokens)
    max_tokens = options.limits().max_num_tokens
    max_blocks = blocks_for(mml, bs)
    lengths = [ctx + len(new)
               for ctx, new in zip(batch.context_lens, batch.new_tokens, strict=True)]
    longest = max(range(batch.num_reqs), key=lengths.__getitem__)
    widest = max(range(batch.num_reqs), key=lambda r: len(batch.block_table[r]))
    top_block = max((b, r) for r, row in enumerate(batch.block_table) for b in row)
    top_token = max((t, r) for r, row in enumerate(batch.new_tokens) for t in row)
    if batch.num_reqs > options.max_num_reqs:
        raise TooManyRequests(batch.num_reqs, options.max_num_reqs)
    if prefill > max_tokens:
        raise TooManyPrefillTokens(prefill, max_tokens, max_new_tokens)
    if lengths[longest] > mml:
        raise PastMaxModelLen(longest, batch.context_lens[longest],
                              len(batch.new_tokens[longest]), mml)
    if len(batch.block_table[widest]) > max_blocks:
        raise BlockTableTooWide(widest, len(batch.block_table[widest]), max_blocks, mml, bs)
    if top_block[0] >= options.num_blocks:
        raise BlockPastCache(top_block[0], top_block[1], options.num_blocks - 1)
    if top_token[0] >= vocab_size:
        raise TokenOutsideVocabulary(top_token[0], top_token[1], vocab_size)
    try:
        batch.validate(max_model_len=mml, block_size=bs, num_blocks=options.num_blocks,
                       extra_positions=k - 1, max_num_reqs=options.max_num_reqs)
    except ValueError as exc:
        raise LayoutMismatch(bs, mml, k, str(exc)) from exc

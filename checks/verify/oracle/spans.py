"""The requests of one attention call, as the batch describes them on the host."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RequestSpan:
    """One request with query tokens in an attention call: its tokens are
    ``first_token .. first_token + query_len - 1`` of the call, at positions
    ``seq_len - query_len .. seq_len - 1`` (its query tokens are the last of its
    ``seq_len`` positions, whose keys and values the call writes first)."""

    request: int
    first_token: int
    query_len: int
    seq_len: int

    @property
    def tokens(self) -> slice:
        """The call's rows of this request's query tokens."""
        return slice(self.first_token, self.first_token + self.query_len)

    @property
    def first_position(self) -> int:
        """Position of the request's first query token."""
        return self.seq_len - self.query_len


def request_spans(query_start_loc: Sequence[int], seq_lens: Sequence[int]) -> list[RequestSpan]:
    """The requests of a call with ``query_start_loc`` (``num_reqs + 1`` cumulative query
    offsets) and ``seq_lens`` (``num_reqs`` lengths, the query tokens included) that own
    query tokens, in request order. Padding lanes (no query token) are left out. Raises
    ``ValueError`` for a request whose length is shorter than its query: its tokens would
    have no positions."""
    if len(query_start_loc) != len(seq_lens) + 1:
        raise ValueError(f"{len(query_start_loc)} query offsets for {len(seq_lens)} requests")
    spans = []
    for request, seq_len in enumerate(seq_lens):
        first, end = query_start_loc[request], query_start_loc[request + 1]
        if end == first:
            continue
        if end < first or seq_len < end - first:
            raise ValueError(f"request {request}: query tokens {first}..{end} do not fit its "
                             f"length {seq_len}")
        spans.append(RequestSpan(request, first, end - first, seq_len))
    return spans

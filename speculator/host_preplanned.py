"""Host work of the ``host_preplanned`` strategy (FlashInfer, whose planning cannot be
captured): plan every draft step's metadata before one run of the decode body, and re-plan
what a replay of the captured body reads.

A ``host_preplanned`` group plans each step (``plan_draft_steps``, ``replan_draft_steps``);
any other group of the same speculator builds step 1 once and refreshes in-graph between
steps (:meth:`~speccheck.speculator.decode_steps.DecodeSteps.host_preplanned`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from speccheck.contract.cudagraph import BatchExecutionDescriptor
from speccheck.contract.metadata import CommonAttentionMetadata
from speccheck.contract.token_count import (
    at_later_draft_step,
    attention_request_count,
    build_uniform_attention_metadata,
    draft_steps_seq_lens_upper_bound,
)

if TYPE_CHECKING:
    from speccheck.speculator.autoregressive import AutoregressiveSpeculator


class HostPreplanner:
    """Plans and re-plans the decode steps of one speculator's ``host_preplanned`` path."""

    def __init__(self, speculator: AutoregressiveSpeculator) -> None:
        self._spec = speculator

    def plan(
        self, desc: BatchExecutionDescriptor, num_reqs: int, base_seq_lens: np.ndarray,
        for_capture: bool = False,
    ) -> list[list[Any]]:
        """``[step - 1][group]`` metadata: planned per step for ``host_preplanned`` groups,
        built once (step 1) and refreshed in-graph for the others. Host work: one build,
        the later steps' common metadata derived from it. The build launches nothing: the
        query offsets are the decode lanes' (the first pass wrote them), which the per-step
        path, rebuilding everything as the verifier's oracle, writes again before every
        step."""
        spec = self._spec
        first = self._step_one(desc, num_reqs, base_seq_lens)
        commons = [first] + [
            at_later_draft_step(first, base_seq_lens, step) for step in range(2, spec.num_steps)
        ]
        per_group: list[list[Any]] = []
        for group in spec.groups:
            if group.host_preplanned:
                per_group.append(group.builder.plan_draft_steps(commons))
            else:
                build = group.build_for_cudagraph_capture if for_capture else group.build
                per_group.append([build(commons[0])] * len(commons))
        return [list(step_metadata) for step_metadata in zip(*per_group, strict=True)]

    def replan(
        self, desc: BatchExecutionDescriptor, num_reqs: int, base_seq_lens: np.ndarray,
        captured: list[list[Any]],
    ) -> None:
        """What a replay of the host_preplanned graph needs from the host, and nothing
        more: each ``host_preplanned`` group re-plans ``captured``, the metadata the graph
        was captured with, from the steps' host lengths alone (``replan_draft_steps``), and
        any other group builds step 1 (its build writes the persistent buffers the graph
        reads; the graph's refresh does the rest). No metadata object is made for the
        captured body, which would not read it."""
        spec = self._spec
        lengths = draft_steps_seq_lens_upper_bound(
            base_seq_lens, num_reqs, attention_request_count(desc, num_reqs), 1,
            spec.num_steps - 1, spec.max_model_len)
        first: CommonAttentionMetadata | None = None
        for index, group in enumerate(spec.groups):
            if group.host_preplanned:
                group.builder.replan_draft_steps(
                    [step_metadata[index] for step_metadata in captured], lengths)
                continue
            if first is None:
                first = self._step_one(desc, num_reqs, base_seq_lens)
            group.build(first)

    def _step_one(
        self, desc: BatchExecutionDescriptor, num_reqs: int, base_seq_lens: np.ndarray
    ) -> CommonAttentionMetadata:
        """Step 1's common metadata; launches nothing (see :meth:`plan`)."""
        spec = self._spec
        return build_uniform_attention_metadata(
            buffers=spec.buffers, batch_desc=desc, num_reqs=num_reqs, num_query_per_req=1,
            base_seq_lens_np=base_seq_lens, step=1, max_model_len=spec.max_model_len,
            offsets_on_device=True,
        )

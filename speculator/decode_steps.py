"""The capture-safe device bodies of the autoregressive speculator's decode steps, and the
one place where a draft step's metadata is refreshed.

Every body here runs eagerly or inside a captured graph alike: one decode step, every step
fused with in-graph refreshes between them, and every step on metadata planned ahead on
the host (the ``host_preplanned`` strategy). Each refresh goes through :meth:`DecodeSteps.
refresh`, which calls the speculator's ``refresh_hook`` (:func:`refresh_directly` where none
is set): the verifier sees every refresh on every path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from speccheck.contract.groups import AttentionGroup
from speccheck.speculator.sampling import finish_decode_step

if TYPE_CHECKING:
    from speccheck.speculator.autoregressive import AutoregressiveSpeculator


def refresh_directly(group: AttentionGroup, metadata: Any) -> None:
    """The refresh hook in force where the speculator has none set: the group's own
    refresh."""
    group.update_draft_decode_metadata(metadata)


class DecodeSteps:
    """The decode-step bodies of one speculator, over its persistent buffers."""

    def __init__(self, speculator: AutoregressiveSpeculator) -> None:
        self._spec = speculator

    def refresh(self, group_metadata: Sequence[Any], in_graph_only: bool = False) -> None:
        """Each group's in-graph refresh of its metadata (``group_metadata[i]`` is group
        ``i``'s), through the speculator's ``refresh_hook``, or :func:`refresh_directly`
        where none is set: the only call site of a refresh. ``in_graph_only`` skips the
        ``host_preplanned`` groups, whose steps were planned ahead. Capture-safe as the
        refreshes are."""
        spec = self._spec
        hook = spec.refresh_hook or refresh_directly
        for group, metadata in zip(spec.groups, group_metadata, strict=True):
            if in_graph_only and group.host_preplanned:
                continue
            hook(group, metadata)
            spec.record("refresh", id(metadata))

    def one_step(
        self, num_lanes: int, group_metadata: Sequence[Any], step: int, observe: bool = True
    ) -> None:
        """One decode step over ``num_lanes`` lanes: forward, sample, store, advance.
        Capture-safe. ``observe=False`` keeps the step observer out of the single-step
        graph, whose replays the per-step path observes from the host instead."""
        spec = self._spec
        if observe and spec.step_observer is not None:
            spec.step_observer(num_lanes, step, group_metadata, None)
        buffers = spec.buffers
        # Real lanes advance one position (clamped); padding lanes (position and length 0)
        # stay.
        finish_decode_step(
            spec.model.unprojected_logits(spec.run_model(num_lanes, group_metadata)),
            spec.options.sampling, spec.seeds[:num_lanes], buffers.positions[:num_lanes],
            buffers.seq_lens[:num_lanes], spec.is_real_req[:num_lanes], spec.current_step,
            spec.draft_tokens[:num_lanes], spec.draft_logits[:num_lanes],
            spec.input_ids[:num_lanes], advance=spec.config.advance_draft_positions,
            max_model_len=spec.max_model_len, lanes_done=spec.lanes_done, kernel=spec.kernel)
        if not spec.in_capture:
            spec.counters.eager_step_calls += 1
        spec.record("generate", step)

    def fused(self, num_lanes: int, group_metadata: Sequence[Any]) -> None:
        """Every decode step in one body, with ``group_metadata`` refreshed in place between
        steps (after the positions advanced and the slots were recomputed), never after the
        last; where the speculator's ``refresh_rebuilds_in_graph``, before step 1 too, from
        the lanes the first pass wrote."""
        spec = self._spec
        refresh_before_step_one = spec.refresh_rebuilds_in_graph
        advance = spec.config.advance_draft_positions
        for step in range(1, spec.num_steps):
            if step > 1 and advance:
                spec.compute_slot_mappings(num_lanes, step)
            if (step == 1 and refresh_before_step_one) or (step > 1 and advance):
                self.refresh(group_metadata)
            self.one_step(num_lanes, group_metadata, step)

    def host_preplanned(self, num_lanes: int, per_step: Sequence[Sequence[Any]]) -> None:
        """Every decode step in one body with metadata planned ahead per step
        (``per_step[i]`` is step ``i + 1``'s): first the device half of the host plans
        (:meth:`~speccheck.contract.builder.AttentionMetadataBuilder.
        finish_draft_step_plans`); between steps only the slot mappings are recomputed, and
        the groups that refresh in-graph are refreshed."""
        spec = self._spec
        for index, group in enumerate(spec.groups):
            if group.host_preplanned:
                group.finish_draft_step_plans([step_metadata[index] for step_metadata in per_step])
        for step in range(1, spec.num_steps):
            group_metadata = per_step[step - 1]
            self.one_step(num_lanes, group_metadata, step)
            if step == spec.num_steps - 1:
                continue
            spec.compute_slot_mappings(num_lanes, step + 1)
            self.refresh(group_metadata, in_graph_only=True)

"""The matrix models: strictness, cross-field rules, ordering, schema, and the shipped file."""

from __future__ import annotations

import copy
import importlib.resources
import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from speccheck.contract.matrix_loader import load_matrix
from speccheck.contract.matrix_model import (
    CONSISTENCY_ERROR_TYPE,
    BackendEntry,
    CudaGraphSupport,
    Matrix,
    MultipleOf,
    RefreshStrategy,
    render_matrix_json_schema,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
SHIPPED_BACKENDS = (
    "reference",
    "triton_attn",
    "fa3",
    "flashinfer",
    "flashinfer_fixed_plan",
    "triton_mla",
    "sparse_swa",
    "rocm_sparse_swa",
)


def entry(**overrides: Any) -> dict[str, Any]:
    """A valid backend entry as plain data, with ``overrides`` applied (``None`` deletes)."""
    data: dict[str, Any] = {
        "name": "alpha",
        "display_name": "Alpha",
        "description": "A test backend.",
        "implementation": None,
        "platforms": ["cuda"],
        "package": {"distribution": "alpha-kernels", "import_name": "alpha"},
        "cudagraph_support": "always",
        "draft_decode": {"supported": True, "refresh_strategy": "none_needed"},
    }
    data.update(overrides)
    return data


def draft(**overrides: Any) -> dict[str, Any]:
    data: dict[str, Any] = {"supported": True, "refresh_strategy": "none_needed"}
    data.update(overrides)
    return {key: value for key, value in data.items() if value is not None}


def violations(exc: ValidationError) -> list[tuple[tuple[Any, ...], str]]:
    """(full loc, message) of every cross-field violation in ``exc``."""
    found = []
    for error in exc.errors():
        if error["type"] == CONSISTENCY_ERROR_TYPE:
            for relative, message in error["ctx"]["violations"]:
                found.append(((*error["loc"], *relative), message))
    return found


def test_shipped_matrix_declares_the_eight_backends() -> None:
    matrix = load_matrix()
    assert matrix.names == SHIPPED_BACKENDS
    assert matrix.backend("fa3").draft_decode.supported == "dcp_world_size == 1"
    assert matrix.backend("rocm_sparse_swa").variant_of == "sparse_swa"
    assert matrix.backend("flashinfer").draft_decode.refresh_strategy is (
        RefreshStrategy.HOST_PREPLANNED
    )
    fixed_plan = matrix.backend("flashinfer_fixed_plan")
    assert fixed_plan.variant_of == "flashinfer"
    assert fixed_plan.draft_decode.supported is True
    assert fixed_plan.draft_decode.refresh_rebuilds
    sparse = matrix.backend("sparse_swa").draft_decode
    assert sparse.refreshed_fields == (
        "swa_indices", "swa_lens", "tile_scheduler_metadata", "split_offsets")
    assert sparse.invalidated_caches == ("sparse_index_cache", "sparse_index_cache_valid")
    mla = matrix.backend("triton_mla")
    assert mla.implementation == "speccheck.backends.triton_mla.builder:TritonMLAMetadataBuilder"
    assert mla.draft_decode.refreshed_fields == ("dcp_local_seq_lens",)
    assert matrix.backend("fa3").package.import_name == "fa3_fwd_interface"


def test_verify_defaults_are_runtime_fields_with_valid_values() -> None:
    assert BackendEntry.model_validate(
        entry(verify_defaults={"block_size": 64, "max_model_len": 64})
    ).verify_defaults == {"block_size": 64, "max_model_len": 64}
    with pytest.raises(ValidationError, match="'colour' is not a runtime field verify can set"):
        BackendEntry.model_validate(entry(verify_defaults={"colour": 1}))


def test_shipped_matrix_points_editors_at_the_schema() -> None:
    text = (importlib.resources.files("speccheck") / "matrix.yaml").read_text(encoding="utf-8")
    assert text.splitlines()[0] == "# yaml-language-server: $schema=./matrix.schema.json"


def test_unknown_backend_lookup_lists_the_valid_names() -> None:
    with pytest.raises(KeyError, match="Unknown attention backend 'fa4'. Valid options are: "
                       "reference, triton_attn"):
        load_matrix().backend("fa4")


def test_models_are_frozen() -> None:
    matrix = load_matrix()
    with pytest.raises(ValidationError):
        matrix.backends[0].name = "other"  # type: ignore[misc]
    assert isinstance(matrix.backends, tuple)


def test_cudagraph_support_is_ordered_and_documented() -> None:
    levels = list(CudaGraphSupport)
    assert [level.value for level in levels] == [
        "never", "uniform_single_token_decode", "uniform_batch", "always"
    ]
    assert sorted(reversed(levels)) == levels
    assert CudaGraphSupport.NEVER < CudaGraphSupport.UNIFORM_BATCH <= CudaGraphSupport.ALWAYS
    assert max(levels) is CudaGraphSupport.ALWAYS
    assert all(level.description and level.__doc__ == level.description for level in levels)


@pytest.mark.parametrize(
    ("overrides", "loc", "error_type"),
    [
        ({"colour": "red"}, ("colour",), "extra_forbidden"),
        ({"min_compute_capability": "90"}, ("min_compute_capability",), "int_type"),
        ({"min_compute_capability": 9.0}, ("min_compute_capability",), "int_type"),
        ({"platforms": "cuda"}, ("platforms",), "tuple_type"),
        ({"platforms": []}, ("platforms",), "too_short"),
        ({"platforms": ["tpu"]}, ("platforms", 0), "literal_error"),
        ({"name": "Alpha"}, ("name",), "string_pattern_mismatch"),
        ({"implementation": "no colon"}, ("implementation",), "string_pattern_mismatch"),
        ({"cudagraph_support": "sometimes"}, ("cudagraph_support",), "enum"),
        ({"draft_decode": draft(supported=1)}, ("draft_decode", "supported"), "bool_or_condition"),
        ({"draft_decode": draft(supported="yes please", reason="r")},
         ("draft_decode", "supported", "supported-condition"), "condition"),
        ({"draft_decode": draft(refresh_strategy="later")},
         ("draft_decode", "refresh_strategy"), "enum"),
        ({"constraints": {"block_sizes": 16}}, ("constraints", "block_sizes"), "size_spec"),
        ({"constraints": {"block_sizes": {"multiple_of": 0}}},
         ("constraints", "block_sizes", "size-multiple-of", "multiple_of"), "greater_than_equal"),
        ({"constraints": {"dtypes": ["float8"]}}, ("constraints", "dtypes", 0), "literal_error"),
        ({"constraints": {"causal_only": "yes"}}, ("constraints", "causal_only"), "bool_type"),
        ({"constraints": {"conditions": [{"condition": "dcp_world_size == 1"}]}},
         ("constraints", "conditions", 0, "reason"), "missing"),
        ({"verify_defaults": {"block_size": 1.5}}, ("verify_defaults", "block_size", "int"),
         "int_type"),
    ],
)
def test_entry_rejects_bad_fields(
    overrides: dict[str, Any], loc: tuple[Any, ...], error_type: str
) -> None:
    with pytest.raises(ValidationError) as excinfo:
        BackendEntry.model_validate(entry(**overrides))
    assert (loc, error_type) in [(error["loc"], error["type"]) for error in excinfo.value.errors()]


@pytest.mark.parametrize(
    ("overrides", "field", "fragment"),
    [
        ({"draft_decode": draft(reason="because")}, "reason",
         "must not be set when supported is true"),
        ({"draft_decode": draft(supported=False)}, "reason",
         "is required because supported is false"),
        ({"draft_decode": draft(supported="dcp_world_size == 1")}, "reason",
         "supported is the condition 'dcp_world_size == 1', which can be false"),
        ({"draft_decode": draft(refreshed_fields=["seq_lens"])}, "refreshed_fields",
         "must be empty when refresh_strategy is none_needed"),
        ({"draft_decode": draft(invalidated_caches=["cache"])}, "invalidated_caches",
         "must be empty when refresh_strategy is none_needed"),
        ({"draft_decode": draft(refresh_strategy="in_graph")}, "refreshed_fields",
         "must name at least one field"),
        ({"draft_decode": draft(refresh_strategy="host_preplanned")}, "supported",
         "must be false when refresh_strategy is host_preplanned"),
        ({"draft_decode": draft(refresh_strategy="in_graph", refreshed_fields=["a", "a"])},
         "refreshed_fields", "lists 'a' more than once"),
        ({"draft_decode": draft(refresh_strategy="in_graph", refreshed_fields=["a"],
                                invalidated_caches=["a"])},
         "invalidated_caches", "also a refreshed field"),
    ],
)
def test_draft_decode_contradictions_name_the_field(
    overrides: dict[str, Any], field: str, fragment: str
) -> None:
    with pytest.raises(ValidationError) as excinfo:
        BackendEntry.model_validate(entry(**overrides))
    found = violations(excinfo.value)
    assert any(
        loc == ("draft_decode", field) and fragment in message for loc, message in found
    ), found


def test_all_contradictions_of_one_model_are_reported_together() -> None:
    bad = draft(supported=False, refreshed_fields=["x"], invalidated_caches=["y"])
    with pytest.raises(ValidationError) as excinfo:
        BackendEntry.model_validate(entry(draft_decode=bad))
    fields = sorted(loc[-1] for loc, _ in violations(excinfo.value))
    assert fields == ["invalidated_caches", "reason", "refreshed_fields"]


@pytest.mark.parametrize(
    ("overrides", "field", "fragment"),
    [
        ({"platforms": ["rocm"], "min_compute_capability": 90}, "min_compute_capability",
         "only applies to cuda"),
        ({"platforms": ["cuda", "cuda"]}, "platforms", "lists 'cuda' more than once"),
        ({"variant_of": "alpha"}, "variant_of", "names the backend itself"),
        ({"constraints": {"dtypes": []}}, "constraints.dtypes", "allows nothing"),
        ({"constraints": {"head_sizes": [64, 64]}}, "constraints.head_sizes",
         "lists 64 more than once"),
        ({"constraints": {"block_sizes": {"multiple_of": 64, "max": 32}}},
         "constraints.block_sizes.max", "below multiple_of (64)"),
        ({"constraints": {"reasons": {"causal_only": "windows end at p"}}},
         "constraints.reasons.causal_only", "explains causal_only, which is not set"),
        ({"constraints": {"causal_only": False, "reasons": {"causal_only": "windows end at p"}}},
         "constraints.reasons.causal_only", "explains causal_only, which is not set"),
        ({"verify_defaults": {"colour": 1}}, "verify_defaults.colour",
         "'colour' is not a runtime field verify can set"),
        ({"verify_defaults": {"platform": "cpu"}}, "verify_defaults.platform",
         "'platform' is not a runtime field verify can set"),
        ({"verify_defaults": {"block_size": 0}}, "verify_defaults.block_size",
         "should be greater than or equal to 1, got 0"),
    ],
)
def test_entry_contradictions_name_the_field(
    overrides: dict[str, Any], field: str, fragment: str
) -> None:
    with pytest.raises(ValidationError) as excinfo:
        BackendEntry.model_validate(entry(**overrides))
    found = [
        (".".join(str(part) for part in loc if not str(part).startswith("size-")), message)
        for loc, message in violations(excinfo.value)
    ]
    assert any(loc == field and fragment in message for loc, message in found), found


def test_matrix_rejects_duplicate_names_and_unknown_variants() -> None:
    data = {
        "version": 1,
        "backends": [
            entry(),
            entry(),
            entry(name="beta", variant_of="gamma"),
            entry(name="delta", variant_of="beta"),
        ],
    }
    with pytest.raises(ValidationError) as excinfo:
        Matrix.model_validate(data)
    found = violations(excinfo.value)
    assert (("backends", 1, "name"), "'alpha' is already the name of backends[0]; backend "
            "names must be unique") in found
    assert (("backends", 2, "variant_of"), "refers to unknown backend 'gamma'; known backends "
            "are: alpha, beta, delta") in found
    assert any(loc == ("backends", 3, "variant_of") and "itself a variant of 'gamma'" in message
               for loc, message in found)


def test_matrix_needs_version_one_and_backends() -> None:
    with pytest.raises(ValidationError) as excinfo:
        Matrix.model_validate({"version": 2, "backends": []})
    assert {error["loc"] for error in excinfo.value.errors()} == {("version",), ("backends",)}


def test_size_specs_accept_lists_and_multiples() -> None:
    parsed = BackendEntry.model_validate(
        entry(constraints={"head_sizes": [64, 128], "block_sizes": {"multiple_of": 16}})
    )
    assert parsed.constraints.head_sizes == (64, 128)
    assert parsed.constraints.block_sizes == MultipleOf(multiple_of=16)


def test_every_field_has_a_description() -> None:
    schema = json.loads(render_matrix_json_schema())
    for name, definition in schema["$defs"].items():
        for field, spec in definition.get("properties", {}).items():
            assert spec.get("description"), f"{name}.{field} has no description"


def test_json_schema_is_stable_and_committed() -> None:
    text = render_matrix_json_schema()
    assert text == render_matrix_json_schema()
    assert json.loads(text)["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    committed = (REPO_ROOT / "matrix.schema.json").read_text(encoding="utf-8")
    assert committed == text, "matrix.schema.json is stale: run `speccheck schema --output " \
        "matrix.schema.json`"


def test_json_schema_documents_enum_members() -> None:
    schema = json.loads(render_matrix_json_schema())
    support = schema["$defs"]["CudaGraphSupport"]
    assert support["enum"] == ["never", "uniform_single_token_decode", "uniform_batch", "always"]
    assert len(support["markdownEnumDescriptions"]) == 4


def test_validation_does_not_mutate_its_input() -> None:
    data = {"version": 1, "backends": [entry()]}
    before = copy.deepcopy(data)
    Matrix.model_validate(data)
    assert data == before

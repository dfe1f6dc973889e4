"""Whether an example fits the run's harness: :func:`check_fits` raises a typed error that
carries the limit crossed, and the report says every kind of misfit in one line."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from speccheck.checks.selftest.mutants import DerivedBuilder, declaring_matrix
from speccheck.checks.verify import input_fit
from speccheck.checks.verify.context import MatrixContext
from speccheck.checks.verify.engine import VerifySettings
from speccheck.checks.verify.examples import Example
from speccheck.checks.verify.harness import HarnessSet
from speccheck.checks.verify.input_fit import ExampleDoesNotFit, check_fits
from speccheck.checks.verify.report import misfit_line
from speccheck.contract.matrix_loader import load_matrix
from speccheck.speculator.batch import DraftBatch
from tests.fixtures.configs import CPU_CONFIG


def _check(example: Example) -> None:
    """:func:`check_fits` against the self-test's harness (capture sizes 2 and 4, 3 new
    tokens per request, a vocabulary of 64, block size 4, ``max_model_len`` 32)."""
    shipped = load_matrix(None)
    settings = VerifySettings(
        "reference", CPU_CONFIG, steps=(4,), capture_sizes=(2, 4), vocab_size=64,
        builder_overrides=(("reference", DerivedBuilder),),
        matrices=MatrixContext(declaring_matrix(shipped, ()), None, shipped))
    options = HarnessSet(settings, torch.device("cpu")).options()
    check_fits(example, options, block_size=4, max_model_len=32, vocab_size=64,
               max_new_tokens=3)


@pytest.mark.parametrize(("example", "expected"), [
    ((2, DraftBatch((0,) * 5, ((1,),) * 5, tuple((b,) for b in range(1, 6)), (0,) * 5)),
     input_fit.TooManyRequests(requests=5, most=4)),
    ((2, DraftBatch((0,), (tuple(range(20)),), ((1, 2, 3, 4, 5, 6),), (0,))),
     input_fit.TooManyPrefillTokens(tokens=20, most=12, per_request=3)),
    ((2, DraftBatch((31,), ((1, 2),), (tuple(range(1, 9)),), (0,))),
     input_fit.PastMaxModelLen(request=0, context=31, new_tokens=2, max_model_len=32)),
    ((2, DraftBatch((0,), ((1,),), (tuple(range(1, 10)),), (0,))),
     input_fit.BlockTableTooWide(request=0, blocks=9, most=8, max_model_len=32, block_size=4)),
    ((2, DraftBatch((0,), ((1,),), ((999,),), (0,))),
     input_fit.BlockPastCache(block=999, request=0, live_blocks=32)),
    ((2, DraftBatch((0,), ((64,),), ((1,),), (0,))),
     input_fit.TokenOutsideVocabulary(token=64, request=0, vocab_size=64)),
])
def test_a_misfit_carries_the_limit_it_crosses(example: Example,
                                               expected: ExampleDoesNotFit) -> None:
    with pytest.raises(ExampleDoesNotFit) as caught:
        _check(example)
    assert type(caught.value) is type(expected)
    assert dataclasses.asdict(caught.value) == dataclasses.asdict(expected)  # type: ignore[call-overload]


def test_a_batch_made_for_another_configuration_carries_the_reason() -> None:
    with pytest.raises(input_fit.LayoutMismatch) as caught:
        _check((4, DraftBatch((3,), ((1,),), ((1,),), (0,))))
    assert (caught.value.block_size, caught.value.max_model_len, caught.value.k) == (4, 32, 4)
    assert caught.value.reason.startswith("request 0: block_table row has 1 blocks")


def test_a_fitting_example_passes() -> None:
    _check((2, DraftBatch((0,), ((1,),), ((1,),), (0,))))


@pytest.mark.parametrize("kind", ExampleDoesNotFit.__subclasses__(), ids=lambda c: c.__name__)
def test_every_misfit_has_one_line_of_wording(kind: type[ExampleDoesNotFit]) -> None:
    values = {f.name: "why" if f.type == "str" else 7
              for f in dataclasses.fields(kind)}  # type: ignore[arg-type]
    line = misfit_line(kind(**values))
    assert line.startswith("--reproduce: ") and "\n" not in line

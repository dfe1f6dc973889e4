"""The drafter's one-kernel layers (speculator/model_kernels.py) and Gumbel-max sampling
(speculator/sampling.py) against their PyTorch form: under the Triton interpreter on CPU (fp32 inputs: the interpreter's bf16 math is
wrong), compiled on CUDA in every dtype (marked ``cuda``), and compiled for sm_90 on any
machine."""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from speccheck.speculator import projection_kernels, sampling
from speccheck.speculator.model_kernels import (
    add_rms_norm,
    rms_norm,
    rms_norm_torch,
    rotary,
    rotary_inv_freq,
    rotary_qkv,
    rotary_torch,
    silu_mul,
    silu_mul_torch,
)
from speccheck.speculator.projection_kernels import (
    SKINNY_ROWS,
    Tiling,
    UnprojectedLogits,
    runs_skinny,
)
from speccheck.speculator.sampling import (
    SamplingMethod,
    finish_decode_step,
    gumbel_argmax,
    gumbel_noise,
)
from tests.fixtures.sm90_compile import run_without_interpreter

SMALL = settings(max_examples=15, deadline=None)
METHODS: tuple[SamplingMethod, ...] = ("argmax", "gumbel")


def _rows(seed: int, rows: int, width: int, device: str = "cpu",
          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (3 * torch.randn(rows, width, generator=gen)).to(device=device, dtype=dtype)


@SMALL
@given(rows=st.integers(0, 5), width=st.integers(1, 70), seed=st.integers(0, 99))
def test_rms_norm_kernel_matches_torch(rows: int, width: int, seed: int) -> None:
    wide = _rows(seed, rows, width + 3)
    x = wide[:, :width]  # rows with a stride wider than their width, as a split gives
    weight = _rows(seed + 1, 1, width)[0]
    torch.testing.assert_close(rms_norm(x, weight, 1e-6, kernel=True),
                               rms_norm_torch(x, weight, 1e-6), rtol=1e-5, atol=1e-5)


@SMALL
@given(tokens=st.integers(0, 4), heads=st.integers(1, 3), half=st.integers(1, 20),
       seed=st.integers(0, 99))
def test_rotary_kernel_matches_torch(tokens: int, heads: int, half: int, seed: int) -> None:
    dim = 2 * half
    fused = _rows(seed, tokens, heads * dim + 5)  # a slice of a wider projection
    x = fused[:, 5:].view(tokens, heads, dim)
    positions = torch.randint(0, 40000, (tokens,), generator=torch.Generator().manual_seed(seed))
    inv_freq = rotary_inv_freq(dim, 10000.0, torch.device("cpu"))
    out = rotary(x, positions, inv_freq, kernel=True)
    assert out.is_contiguous() and out.shape == x.shape
    torch.testing.assert_close(out, rotary_torch(x, positions, inv_freq), rtol=1e-4, atol=1e-3)


@SMALL
@given(rows=st.integers(0, 5), width=st.integers(1, 70), seed=st.integers(0, 99))
def test_add_rms_norm_kernel_matches_torch(rows: int, width: int, seed: int) -> None:
    """The sum, and the norm of the sum, as the two separate ops give them."""
    x = _rows(seed, rows, width + 2)[:, :width]
    delta = _rows(seed + 1, rows, width)
    weight = _rows(seed + 2, 1, width)[0]
    normed, summed = add_rms_norm(x, delta, weight, 1e-6, kernel=True)
    torch.testing.assert_close(summed, x + delta, rtol=0, atol=0)
    torch.testing.assert_close(normed, rms_norm_torch(x + delta, weight, 1e-6),
                               rtol=1e-5, atol=1e-5)


@SMALL
@given(tokens=st.integers(0, 4), heads=st.integers(1, 3), kv_heads=st.integers(1, 2),
       half=st.integers(1, 20), seed=st.integers(0, 99))
def test_rotary_qkv_kernel_matches_torch(tokens: int, heads: int, kv_heads: int, half: int,
                                         seed: int) -> None:
    """Queries and keys rotated, values copied, each into a contiguous tensor of its own."""
    dim = 2 * half
    wide = _rows(seed, tokens, (heads + 2 * kv_heads) * dim + 3)
    qkv = wide[:, : (heads + 2 * kv_heads) * dim]  # rows strided wider than their width
    positions = torch.randint(0, 40000, (tokens,), generator=torch.Generator().manual_seed(seed))
    inv_freq = rotary_inv_freq(dim, 10000.0, torch.device("cpu"))
    got = rotary_qkv(qkv, positions, inv_freq, heads, kv_heads, dim, kernel=True)
    want = rotary_qkv(qkv, positions, inv_freq, heads, kv_heads, dim, kernel=False)
    for g, w in zip(got, want, strict=True):
        assert g.is_contiguous() and g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-3)
    assert torch.equal(got[2], want[2])  # values are copied, not computed


def _decode_state(rows: int, steps: int, vocab: int, max_len: int,
                  seed: int) -> dict[str, torch.Tensor]:
    """The buffers :func:`finish_decode_step` reads and writes, drawn from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return {
        "seeds": torch.randint(0, 2**31 - 1, (rows,), generator=g),
        "positions": torch.randint(max_len - 3, max_len, (rows,), generator=g),
        "seq_lens": torch.randint(max_len - 2, max_len + 1, (rows,), generator=g).int(),
        "is_real": torch.rand(rows, generator=g) < 0.7,
        "draft_tokens": torch.randint(0, 9, (rows, steps), generator=g),
        "draft_logits": torch.randn(rows, steps, vocab, generator=g),
        "input_ids": torch.randint(0, 9, (rows,), generator=g),
    }


def _finished(logits: torch.Tensor | UnprojectedLogits, method: SamplingMethod, steps: int,
              step: int, advance: bool, seed: int, kernel: bool | None,
              device: str = "cpu") -> dict[str, torch.Tensor]:
    """The buffers drawn from ``seed`` after :func:`finish_decode_step` over ``logits``."""
    rows, vocab = (logits.shape if isinstance(logits, torch.Tensor)
                   else (logits.rows.shape[0], logits.weight.shape[0]))
    max_len = 50
    buffers = {name: t.to(device) for name, t in
               _decode_state(rows, steps, vocab, max_len, seed).items()}
    buffers["step"] = torch.tensor(step, device=device)
    buffers["lanes_done"] = torch.zeros((), dtype=torch.int32, device=device)
    finish_decode_step(logits, method, buffers["seeds"], buffers["positions"],
                       buffers["seq_lens"], buffers["is_real"], buffers["step"],
                       buffers["draft_tokens"], buffers["draft_logits"], buffers["input_ids"],
                       advance=advance, max_model_len=max_len,
                       lanes_done=buffers["lanes_done"], kernel=kernel)
    assert int(buffers["step"]) == step + 1 and int(buffers["lanes_done"]) == 0
    return buffers


def _assert_decode_step_forms_agree(logits: torch.Tensor, method: SamplingMethod, steps: int,
                                    step: int, advance: bool, seed: int) -> torch.Tensor:
    """Run :func:`finish_decode_step` as kernels and as tensor ops on twin buffers: every
    buffer equal afterwards. Returns the tokens."""
    got = _finished(logits, method, steps, step, advance, seed, kernel=True)
    want = _finished(logits, method, steps, step, advance, seed, kernel=False)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    return got["input_ids"]


@SMALL
@given(rows=st.integers(0, 4), vocab=st.integers(1, 2500), steps=st.integers(1, 3),
       method=st.sampled_from(["argmax", "gumbel"]), advance=st.booleans(),
       block=st.sampled_from([16, 64, 1024]), seed=st.integers(0, 99))
def test_decode_step_epilogue_kernel_matches_torch(rows: int, vocab: int, steps: int,
                                                   method: SamplingMethod, advance: bool,
                                                   block: int, seed: int) -> None:
    """Token and fp32 logits stored at the device step, token fed back, real lanes advanced
    and clamped, padding lanes left: every output buffer equal to the tensor-op form's.
    Small blocks split these vocabularies over up to 32 chunks, as 32000 is on a GPU."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randint(-3, 4, (rows, vocab), generator=gen).float()
    step = int(torch.randint(0, steps, (1,), generator=gen))
    with mock.patch.object(sampling, "_ARGMAX_BLOCK", block):
        _assert_decode_step_forms_agree(logits, method, steps, step, advance, seed + 1)


@pytest.mark.parametrize("lanes", [1, 3])
def test_the_step_moves_on_inside_the_kernel_only_when_asked(lanes: int) -> None:
    """Given the lane counter, every call moves the step on by one (as each replay of a
    captured step does: the tokens land in the next column each time) and leaves the
    counter zero; without it the step stays for the caller to move. One lane moves it
    without counting, several through the count."""
    logits = torch.randn(lanes, 40, generator=torch.Generator().manual_seed(0))
    state = _decode_state(lanes, 4, 40, 50, 0)
    step, done = torch.tensor(0), torch.zeros((), dtype=torch.int32)

    def finish(lanes_done: torch.Tensor | None) -> None:
        finish_decode_step(logits, "argmax", state["seeds"], state["positions"],
                           state["seq_lens"], state["is_real"], step, state["draft_tokens"],
                           state["draft_logits"], state["input_ids"], advance=False,
                           max_model_len=50, lanes_done=lanes_done, kernel=True)

    for expected in (1, 2, 3):
        finish(done)
        assert int(step) == expected and int(done) == 0
    finish(None)
    assert int(step) == 3
    assert (state["draft_tokens"][:, :4] == logits.argmax(dim=1)[:, None]).all()


@pytest.mark.parametrize(("vocab", "block"), [(200, 16), (333, 16), (5000, 1024)])
def test_split_argmax_ties_take_the_lowest_index(vocab: int, block: int) -> None:
    """Equal maxima in different chunks (adjacent across a chunk boundary, in the first
    and the last chunk, at the very end of a vocabulary that is no multiple of the block or
    the chunk), every entry equal, every entry -inf: the lowest index wins, as
    ``torch.argmax`` has it, in the Gumbel and the plain argmax, alone and in a decode step.
    The maxima are 1e9, which the Gumbel noise (|noise| < 32, half an ulp) leaves exact."""
    with mock.patch.object(sampling, "_ARGMAX_BLOCK", block):
        got_block, chunk, splits = sampling._split_plan(vocab)
        assert got_block == block and splits >= 3 and vocab % chunk and vocab % block
        last = (splits - 1) * chunk
        ties = [(chunk - 1, chunk), (chunk + 1, last + 1), (last - 1, vocab - 1),
                tuple(range(vocab)), ()]
        logits = torch.zeros(len(ties), vocab)
        for row, at in enumerate(ties):
            logits[row, list(at)] = 1e9
        logits[-1] = -float("inf")
        expected = torch.tensor([at[0] if at else 0 for at in ties])
        seeds = torch.arange(len(ties)) * 7919
        positions = torch.arange(len(ties)) * 31
        assert torch.equal(gumbel_argmax(logits, seeds, positions, kernel=True), expected)
        assert torch.equal(gumbel_argmax(logits, seeds, positions, kernel=False), expected)
        for method in ("argmax", "gumbel"):
            tokens = _assert_decode_step_forms_agree(logits, method, 2, 1, True, 0)
            assert torch.equal(tokens, expected), method


def _lm_head_tiles(block_n: int) -> contextlib.ExitStack:
    """The LM head's tensor-core kernel in tiles of ``block_n`` vocabulary entries by 16 of
    the hidden rows, at any row count (as a real vocabulary, of ``WIDE_OUTPUT`` entries or
    more, takes it on a GPU)."""
    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(projection_kernels, "tiling_for",
                                          lambda n, k: Tiling(block_n, 16, 4, 1)))
    stack.enter_context(mock.patch.object(projection_kernels, "WIDE_OUTPUT", 1))
    return stack


def _assert_lm_head_epilogue_agrees(hidden: torch.Tensor, weight: torch.Tensor,
                                    method: SamplingMethod, steps: int, step: int,
                                    advance: bool, seed: int) -> torch.Tensor:
    """The end of a decode step from unprojected logits, sampling in the LM head's
    epilogue, against the LM head's own kernel followed by :func:`finish_decode_step`'s
    kernels, and against the tensor-op forms: every buffer equal. Returns the tokens."""
    head = UnprojectedLogits(hidden, weight)
    assert runs_skinny(hidden, weight, True)
    args = (method, steps, step, advance, seed)
    with mock.patch.object(sampling, "_chunk_argmax", side_effect=AssertionError("unfused")):
        got = _finished(head, *args, kernel=True)
    for want in (_finished(head.project(kernel=True), *args, kernel=True),
                 _finished(head, *args, kernel=False)):
        for name in want:
            assert torch.equal(got[name], want[name]), name
    return got["input_ids"]


@SMALL
@given(rows=st.integers(1, SKINNY_ROWS), vocab=st.integers(1, 90), k=st.integers(1, 40),
       block_n=st.sampled_from([16, 32]), steps=st.integers(1, 3),
       method=st.sampled_from(["argmax", "gumbel"]), advance=st.booleans(),
       seed=st.integers(0, 99))
def test_lm_head_epilogue_matches_the_separate_kernels(rows: int, vocab: int, k: int,
                                                       block_n: int, steps: int,
                                                       method: SamplingMethod, advance: bool,
                                                       seed: int) -> None:
    """Integer hidden rows and weights, so that the logits are exact and most rows have
    equal maxima (in different tiles, often); vocabularies over up to 6 tiles, most
    ending in a partial one, hidden rows over up to 3 reduction steps."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randint(-2, 3, (rows, k), generator=gen).float()
    weight = torch.randint(-2, 3, (vocab, k), generator=gen).float()
    step = int(torch.randint(0, steps, (1,), generator=gen))
    with _lm_head_tiles(block_n):
        _assert_lm_head_epilogue_agrees(hidden, weight, method, steps, step, advance, seed + 1)


def test_lm_head_epilogue_ties_take_the_lowest_index() -> None:
    """Equal maxima in different tiles (adjacent across a tile boundary, in the first and
    the last tile, at the very end of a vocabulary that is no multiple of the tile), every
    entry equal: the lowest index wins, in the plain and the Gumbel argmax. One-hot hidden
    rows pick a weight column each: 2**30 at the tied entries (the Gumbel noise leaves it
    exact), small integers elsewhere."""
    ties = [(15, 16), (17, 81), (79, 82), tuple(range(83))]
    weight = torch.randint(-2, 3, (83, len(ties)), generator=torch.Generator().manual_seed(0))
    weight = weight.float()
    for row, at in enumerate(ties):
        weight[list(at), row] = 2.0**30
    expected = torch.tensor([at[0] for at in ties])
    with _lm_head_tiles(16):
        for method in METHODS:
            tokens = _assert_lm_head_epilogue_agrees(torch.eye(len(ties)), weight, method, 2,
                                                     1, True, 0)
            assert torch.equal(tokens, expected), method


@SMALL
@given(rows=st.integers(0, 4), width=st.integers(1, 2100), seed=st.integers(0, 99))
def test_silu_mul_kernel_matches_torch(rows: int, width: int, seed: int) -> None:
    gate_up = _rows(seed, rows, 2 * width)
    torch.testing.assert_close(silu_mul(gate_up, kernel=True), silu_mul_torch(gate_up),
                               rtol=1e-5, atol=1e-5)


def test_cpu_tensors_take_the_torch_form() -> None:
    x = _rows(0, 2, 8)
    assert torch.equal(rms_norm(x, torch.ones(8), 1e-6), rms_norm_torch(x, torch.ones(8), 1e-6))
    assert torch.equal(silu_mul(x), silu_mul_torch(x))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_kernels_match_torch(dtype: torch.dtype) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    x = _rows(1, 64, 2048, "cuda", dtype)
    weight = _rows(2, 1, 2048, "cuda", dtype)[0]
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype != torch.float32 else {"rtol": 1e-5, "atol": 1e-4}
    torch.testing.assert_close(rms_norm(x, weight, 1e-6), rms_norm_torch(x, weight, 1e-6), **tol)
    q = x[:, : 16 * 128].view(64, 16, 128)
    positions = torch.arange(64, device="cuda") * 500
    inv_freq = rotary_inv_freq(128, 10000.0, torch.device("cuda"))
    torch.testing.assert_close(rotary(q, positions, inv_freq), rotary_torch(q, positions, inv_freq),
                               **tol)
    torch.testing.assert_close(silu_mul(x), silu_mul_torch(x), **tol)
    delta = _rows(3, 64, 2048, "cuda", dtype)
    normed, summed = add_rms_norm(x, delta, weight, 1e-6)
    assert torch.equal(summed, x + delta)
    torch.testing.assert_close(normed, rms_norm_torch(x + delta, weight, 1e-6), **tol)
    qkv = _rows(4, 64, 24 * 128, "cuda", dtype)
    for got, want in zip(rotary_qkv(qkv, positions, inv_freq, 16, 4, 128),
                         rotary_qkv(qkv, positions, inv_freq, 16, 4, 128, kernel=False),
                         strict=True):
        torch.testing.assert_close(got, want, **tol)
    # The end of a decode step: the same tokens, fp32 logits and advanced lanes.
    logits = _rows(5, 64, 32000, "cuda", dtype)
    for method in ("argmax", "gumbel"):
        state = {
            "seeds": torch.arange(64, device="cuda") * 7919, "positions": positions.clone(),
            "seq_lens": (positions + 1).int(), "is_real": torch.arange(64, device="cuda") < 50,
            "draft_tokens": torch.zeros(64, 4, dtype=torch.int64, device="cuda"),
            "draft_logits": torch.zeros(64, 4, 32000, device="cuda"),
            "input_ids": torch.zeros(64, dtype=torch.int64, device="cuda"),
        }
        twin = {name: t.clone() for name, t in state.items()}
        step = torch.tensor(2, device="cuda")
        for buffers, kernel in ((state, True), (twin, False)):
            finish_decode_step(logits, method, buffers["seeds"], buffers["positions"],
                               buffers["seq_lens"], buffers["is_real"], step,
                               buffers["draft_tokens"], buffers["draft_logits"],
                               buffers["input_ids"], advance=True, max_model_len=32768,
                               kernel=kernel)
        for name, value in state.items():
            if name in ("draft_tokens", "input_ids") and method == "gumbel":
                continue  # compared below: log differs in its last bits between the forms
            assert torch.equal(value, twin[name]), (method, name)
        if method == "gumbel":
            scores = logits.float() + gumbel_noise(twin["seeds"], positions, 32000)
            chosen = scores.gather(1, state["input_ids"][:, None])[:, 0]
            assert bool((chosen >= scores.max(dim=1).values - 1e-4).all())
            assert torch.equal(state["draft_tokens"][:, 2], state["input_ids"])
    # Equal maxima in different chunks of the split scan (16 chunks of 2048 at vocabulary
    # 32000), 1e9 (inf in fp16) so that the noise leaves them equal: the lowest index wins.
    ties = ((2047, 2048), (4100, 31999), (0, 16000))
    tied = torch.zeros(len(ties), 32000, device="cuda", dtype=dtype)
    for row, at in enumerate(ties):
        tied[row, list(at)] = 1e9
    expected = torch.tensor([at[0] for at in ties], device="cuda")
    seeds, tied_positions = torch.arange(3, device="cuda") * 7919, positions[:3].clone()
    assert torch.equal(gumbel_argmax(tied, seeds, tied_positions), expected)
    for method in ("argmax", "gumbel"):
        input_ids = torch.zeros(3, dtype=torch.int64, device="cuda")
        finish_decode_step(tied, method, seeds, tied_positions, (tied_positions + 1).int(),
                           torch.ones(3, dtype=torch.bool, device="cuda"),
                           torch.tensor(0, device="cuda"),
                           torch.zeros(3, 1, dtype=torch.int64, device="cuda"),
                           torch.zeros(3, 1, 32000, device="cuda"), input_ids, advance=False,
                           max_model_len=32768)
        assert torch.equal(input_ids, expected), method


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_lm_head_epilogue_matches_the_separate_kernels(dtype: torch.dtype) -> None:
    """Sampling in the LM head's epilogue against the LM head's own kernel followed by
    :func:`finish_decode_step`'s kernels: every buffer bit-identical, both samplers, at one,
    a few and ``SKINNY_ROWS`` lanes, vocabularies 32000 and 128256. Lane 0's logits are
    greatest, and equal, at entries of three tiles (its hidden row copied into the weight
    there); the argmax is the first maximum of the stored logits."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    for vocab in (32000, 128256):
        weight = _rows(1, vocab, 2048, "cuda", dtype) / 150
        for rows in (1, 5, SKINNY_ROWS):
            hidden = _rows(2, rows, 2048, "cuda", dtype)
            weight[[63, 64, vocab - 1]] = hidden[0] / 64
            head = UnprojectedLogits(hidden, weight)
            assert runs_skinny(hidden, weight, None)
            for method in METHODS:
                got = _finished(head, method, 4, 2, True, 0, None, "cuda")
                want = _finished(head.project(), method, 4, 2, True, 0, None, "cuda")
                for name in want:
                    assert torch.equal(got[name], want[name]), (vocab, rows, method, name)
                if method == "argmax":
                    first = got["draft_logits"][:, 2].argmax(dim=-1)
                    assert torch.equal(got["input_ids"], first), (vocab, rows)


_AOT_SCRIPT = """
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from speccheck.speculator import model_kernels as k

target = GPUTarget("cuda", 90, 32)
for dtype in ("bf16", "fp16", "fp32"):
    compile(ASTSource(k._rms_norm_kernel, {"x_ptr": "*" + dtype, "w_ptr": "*" + dtype,
            "out_ptr": "*" + dtype, "x_row_stride": "i32", "out_row_stride": "i32",
            "width": "i32", "eps": "fp32", "BLOCK": "constexpr", "PDL": "constexpr"},
            {"BLOCK": 2048, "PDL": True}), target=target)
    compile(ASTSource(k._rotary_kernel, {"x_ptr": "*" + dtype, "pos_ptr": "*i64",
            "inv_freq_ptr": "*fp32", "out_ptr": "*" + dtype, "x_tok_stride": "i32",
            "x_head_stride": "i32", "num_heads": "i32", "half": "i32", "BLOCK": "constexpr"},
            {"BLOCK": 64}), target=target)
    compile(ASTSource(k._silu_mul_kernel, {"x_ptr": "*" + dtype, "out_ptr": "*" + dtype,
            "x_row_stride": "i32", "width": "i32", "BLOCK": "constexpr", "PDL": "constexpr"},
            {"BLOCK": 1024, "PDL": True}), target=target)
    compile(ASTSource(k._add_rms_norm_kernel, {"x_ptr": "*" + dtype, "d_ptr": "*" + dtype,
            "w_ptr": "*" + dtype, "sum_ptr": "*" + dtype, "out_ptr": "*" + dtype,
            "x_row_stride": "i32", "d_row_stride": "i32", "width": "i32", "eps": "fp32",
            "BLOCK": "constexpr", "PDL": "constexpr"}, {"BLOCK": 2048, "PDL": True}),
            target=target)
    compile(ASTSource(k._rotary_qkv_kernel, {"qkv_ptr": "*" + dtype, "pos_ptr": "*i64",
            "inv_freq_ptr": "*fp32", "q_ptr": "*" + dtype, "k_ptr": "*" + dtype,
            "v_ptr": "*" + dtype, "qkv_tok_stride": "i32", "num_heads": "i32",
            "num_kv_heads": "i32", "half": "i32", "BLOCK": "constexpr", "PDL": "constexpr"},
            {"BLOCK": 64, "PDL": True}), target=target)
    print(dtype, "ok")
from speccheck.speculator import sampling as s
for gumbel, store in ((True, False), (False, True), (True, True)):  # as the callers launch it
    pointer = {"step_ptr": "*i64", "draft_logits_ptr": "*fp32"}
    compile(ASTSource(s._chunk_argmax_kernel, {"logits_ptr": "*bf16", "seeds_ptr": "*i64",
            "positions_ptr": "*i64", **(pointer if store else dict.fromkeys(pointer, "constexpr")),
            "part_best_ptr": "*fp32", "part_index_ptr": "*i64", "logits_row_stride": "i32",
            "draft_logits_row_stride": "i32", "draft_logits_step_stride": "i32",
            "vocab": "i32", "chunk": "i32", "GUMBEL": "constexpr", "STORE_LOGITS": "constexpr",
            "BLOCK": "constexpr"}, {"GUMBEL": gumbel, "STORE_LOGITS": store, "BLOCK": 1024,
            **({} if store else dict.fromkeys(pointer))}), target=target)
    print("chunk argmax ok")
compile(ASTSource(s._store_argmax_kernel, {"part_best_ptr": "*fp32", "part_index_ptr": "*i64",
        "out_ptr": "*i64", "splits": "i32", "SPLITS": "constexpr"}, {"SPLITS": 16}),
        target=target)
print("store argmax ok")
# split plans of vocabulary 32000 and 128256, the LM head's tiles at 128256
for advance, splits in ((False, 16), (True, 32), (True, 2048)):
    compile(ASTSource(s._decode_step_finish_kernel, {"part_best_ptr": "*fp32",
            "part_index_ptr": "*i64", "positions_ptr": "*i64", "seq_lens_ptr": "*i32",
            "is_real_ptr": "*i1", "step_ptr": "*i64", "done_ptr": "*i32", "tokens_ptr": "*i64",
            "input_ids_ptr": "*i64", "tokens_row_stride": "i32", "splits": "i32",
            "max_model_len": "i32", "ADVANCE": "constexpr", "MOVE_ON": "constexpr",
            "ONE_LANE": "constexpr",
            "SPLITS": "constexpr", "PDL": "constexpr"},
            {"ADVANCE": advance, "MOVE_ON": True, "ONE_LANE": splits == 16, "SPLITS": splits,
             "PDL": True}), target=target)
    print("decode step finish ok")
from speccheck.speculator import projection_kernels as p
tiling = p.tiling_for(128256, 2048)
for dtype in ("bf16", "fp16"):
    for gumbel in (False, True):
        signature = {"x_ptr": "*" + dtype, "w_ptr": "*" + dtype, "rows": "i32", "n": "i32",
                     "k": "i32", "x_stride": "i32", "seeds_ptr": "*i64", "positions_ptr": "*i64",
                     "step_ptr": "*i64", "draft_logits_ptr": "*fp32", "part_best_ptr": "*fp32",
                     "part_index_ptr": "*i64", "draft_logits_row_stride": "i32",
                     "draft_logits_step_stride": "i32"}
        constants = {"GUMBEL": gumbel, "ROWS": p.SKINNY_ROWS, "BLOCK_N": tiling.block_n,
                     "BLOCK_K": tiling.block_k, "PDL": True}
        signature.update(dict.fromkeys(constants, "constexpr"))
        compile(ASTSource(s._lm_head_argmax_kernel, signature, constants), target=target,
                options={"num_warps": tiling.num_warps, "num_stages": tiling.num_stages})
        print(dtype, "lm head argmax ok")
"""


def test_kernels_compile_for_sm90() -> None:
    """``triton.compile`` for Hopper on any machine, the LM head with sampling in its
    epilogue too; a subprocess, because kernels decorated under ``TRITON_INTERPRET=1``
    cannot be compiled."""
    out = run_without_interpreter(_AOT_SCRIPT)
    assert out.count(" ok") == 3 + 3 + 1 + 3 + 4, out


@SMALL
@given(rows=st.integers(0, 4), vocab=st.integers(1, 2500), block=st.sampled_from([16, 64, 1024]),
       seed=st.integers(0, 99))
def test_gumbel_argmax_kernel_matches_torch(rows: int, vocab: int, block: int,
                                            seed: int) -> None:
    """Same noise, same maximum, first index on ties (the logits are integers here, so
    ties between equal noisy scores are as exact in both forms), the vocabulary split over
    up to 32 chunks."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randint(-3, 4, (rows, vocab), generator=gen).float()
    seeds = torch.randint(0, 2**31 - 1, (rows,), generator=gen)
    positions = torch.randint(0, 40000, (rows,), generator=gen)
    with mock.patch.object(sampling, "_ARGMAX_BLOCK", block):
        got = gumbel_argmax(logits, seeds, positions, kernel=True)
    want = gumbel_argmax(logits, seeds, positions, kernel=False)
    assert torch.equal(got, want)

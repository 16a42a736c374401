"""The decode-size GEMV (ops/linear.py) against the unfused ops it replaces: ``F.linear`` after
``ops.fused.add_rms_norm`` or ``ops.fused.silu_mul``.

Without a GPU the kernel runs in Triton's interpreter on CPU tensors (conftest sets
``TRITON_INTERPRET=1``; ``PRISM_OPS=triton`` sends CPU tensors to the kernels). The interpreter
multiplies bfloat16 tiles wrongly in ``tl.dot`` (checked below), so on the CPU the several-row
path runs in float32 and float16, and bfloat16 only at one row; on the GPU every path runs in all
three.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ops import fused
from ops import linear as lin

pytest.importorskip("triton")

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _inputs(rows, n, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(DEVICE, dtype)
    residual = torch.randn(rows, k, generator=g).to(DEVICE, dtype)
    gate_up = torch.randn(rows, 2 * k, generator=g).to(DEVICE, dtype)
    norm_w = (1 + 0.1 * torch.randn(k, generator=g)).to(DEVICE, dtype)
    weight = (torch.randn(n, k, generator=g) / k**0.5).to(DEVICE, dtype)
    return x, residual, gate_up, norm_w, weight


def _references(x, residual, gate_up, norm_w, weight, monkeypatch):
    monkeypatch.setenv("PRISM_OPS", "reference")
    normed, s = fused.add_rms_norm(x, residual, norm_w, 1e-6)
    plain_normed = fused.add_rms_norm(x, None, norm_w, 1e-6)[0]
    act = fused.silu_mul(*gate_up.chunk(2, dim=-1))
    out = {"linear": F.linear(x, weight), "norm": F.linear(normed, weight), "sum": s,
           "norm_no_residual": F.linear(plain_normed, weight), "silu": F.linear(act, weight)}
    monkeypatch.setenv("PRISM_OPS", "triton")
    return out


def _close(got, expected, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(got.float(), expected.float(), atol=1e-5, rtol=1e-5)
    elif dtype == torch.float16:  # at most one float16 rounding apart (summation order)
        torch.testing.assert_close(got.float(), expected.float(), atol=1e-4, rtol=1e-3)
    else:  # one bfloat16 rounding of the result apart, plus the interpreter's truncation
        scale = expected.float().abs().max().item()
        torch.testing.assert_close(got.float(), expected.float(), atol=2e-2 * scale, rtol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("n, k", [(40, 96), (64, 256)])
def test_each_prologue_matches_the_unfused_ops(rows, n, k, dtype, monkeypatch):
    """Forced through the GEMV (odd sizes mask the edges), each prologue gives the unfused result."""
    if dtype == torch.bfloat16 and rows > 1 and not CUDA:
        pytest.skip("the interpreter's bfloat16 tl.dot is wrong (test_interpreter_dot_is_wrong_in_bfloat16)")
    x, residual, gate_up, norm_w, weight = _inputs(rows, n, k, dtype)
    ref = _references(x, residual, gate_up, norm_w, weight, monkeypatch)
    settings = (16, 64, 4, 2)
    _close(lin._launch(lin._PLAIN, x, weight, settings)[0], ref["linear"], dtype)
    y, s = lin._launch(lin._ADD_RMS_NORM, x, weight, settings, residual=residual, norm_weight=norm_w, eps=1e-6)
    _close(y, ref["norm"], dtype)
    if CUDA or dtype != torch.bfloat16:  # the interpreter truncates bfloat16 casts
        assert torch.equal(s, ref["sum"])
    _close(s, ref["sum"], dtype)
    y, s = lin._launch(lin._ADD_RMS_NORM, x, weight, settings, norm_weight=norm_w, eps=1e-6)
    _close(y, ref["norm_no_residual"], dtype)
    assert s is x
    _close(lin._launch(lin._SILU_MUL, gate_up, weight, settings)[0], ref["silu"], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 9])
def test_public_functions_match_the_unfused_ops(rows, dtype, monkeypatch):
    """Whatever path :func:`gemv_settings` picks (GEMV at one row, unfused ops otherwise)."""
    x, residual, gate_up, norm_w, weight = _inputs(rows, 48, 160, dtype, seed=1)
    ref = _references(x, residual, gate_up, norm_w, weight, monkeypatch)
    _close(lin.linear(x, weight), ref["linear"], dtype)
    logits = lin.linear(x, weight, out_dtype=torch.float32)
    assert logits.dtype == torch.float32
    _close(logits, ref["linear"], dtype)
    assert torch.equal(logits, logits.to(dtype).float())  # rounded to the model dtype first, as the reference
    y, s = lin.add_rms_norm_linear(x, residual, norm_w, 1e-6, weight)
    _close(y, ref["norm"], dtype)
    _close(s, ref["sum"], dtype)
    _close(lin.silu_mul_linear(gate_up, weight), ref["silu"], dtype)


@pytest.mark.parametrize("dtype", [torch.float16] + ([torch.bfloat16] if CUDA else []))
@pytest.mark.parametrize("rows", [1, 3])
def test_prologues_round_as_the_separate_kernels(rows, dtype, monkeypatch):
    """With a one-hot weight each output is one prologue value times 1, so the GEMV's output is the
    prologue's rounded value itself: equal to the separate kernel's output. Skipping a rounding
    changes a quarter to a third of them by one step of the dtype; a compiled kernel's fast
    ``exp``/``rsqrt`` and the norm's summation order may change a few, so at most 2% may differ,
    by one step. (The interpreter truncates bfloat16 casts, so bfloat16 runs on the GPU only.)"""
    n, k = 48, 96
    x, residual, gate_up, norm_w, _ = _inputs(rows, n, k, dtype, seed=2)
    one_hot = torch.zeros(n, k, dtype=dtype, device=DEVICE)
    one_hot[torch.arange(n), torch.arange(n) * 2] = 1
    monkeypatch.setenv("PRISM_OPS", "reference")
    normed = fused.add_rms_norm(x, residual, norm_w, 1e-6)[0]
    act = fused.silu_mul(*gate_up.chunk(2, dim=-1))
    monkeypatch.setenv("PRISM_OPS", "triton")
    settings = (16, 64, 4, 2)
    y = lin._launch(lin._ADD_RMS_NORM, x, one_hot, settings, residual=residual, norm_weight=norm_w, eps=1e-6)[0]
    _rounded_alike(y, normed[:, ::2][:, :n])
    _rounded_alike(lin._launch(lin._SILU_MUL, gate_up, one_hot, settings)[0], act[:, ::2][:, :n])


def _rounded_alike(got, expected):
    assert (got != expected).float().mean().item() <= 0.02
    step = torch.finfo(expected.dtype).eps  # one step of the dtype, relative
    torch.testing.assert_close(got.float(), expected.float(), rtol=step, atol=1e-6)


def test_bias_and_cpu_tensors_take_the_unfused_path(monkeypatch):
    x, _, gate_up, _, weight = _inputs(1, 8, 16, torch.float32)
    bias = torch.randn(8).to(DEVICE)
    monkeypatch.setenv("PRISM_OPS", "triton")  # CPU tensors too would take the GEMV
    assert lin._plan(lin._PLAIN, x, weight) is not None
    assert lin._plan(lin._PLAIN, x, weight, bias) is None
    torch.testing.assert_close(lin.linear(x, weight, bias), F.linear(x, weight, bias))
    act = fused.silu_mul(*gate_up.chunk(2, dim=-1))
    torch.testing.assert_close(lin.silu_mul_linear(gate_up, weight, bias), F.linear(act, weight, bias))
    if not CUDA:
        monkeypatch.setenv("PRISM_OPS", "auto")
        assert lin._plan(lin._PLAIN, x, weight) is None


def test_settings_follow_the_measurements():
    """One row: the GEMV with the measured settings (8B shape) or a default; the norm prologue only
    on matrices small enough for its first pass to pay; several rows: plain large products only."""
    assert lin.gemv_settings(1, lin._ADD_RMS_NORM, 6144, 4096) == (8, 512, 4, 4)
    assert lin.gemv_settings(1, lin._ADD_RMS_NORM, 24576, 4096) is None  # 8B gate/up: norm kernel + plain GEMV
    assert lin.gemv_settings(1, lin._PLAIN, 24576, 4096) == (4, 1024, 4, 2)
    assert lin.gemv_settings(1, lin._SILU_MUL, 100, 72) == (4, 128, 4, 4)  # unmeasured: BLOCK_K covers K
    assert lin.gemv_settings(8, lin._PLAIN, 151936, 4096) is not None
    assert lin.gemv_settings(8, lin._PLAIN, 4096, 4096) is None
    assert lin.gemv_settings(8, lin._SILU_MUL, 151936, 4096) is None
    assert lin.gemv_settings(lin.MAX_ROWS + 1, lin._PLAIN, 151936, 4096) is None


@pytest.mark.skipif(CUDA, reason="documents the Triton interpreter's behaviour on the CPU")
def test_interpreter_dot_is_wrong_in_bfloat16():
    """Why the CPU tests keep several-row products out of bfloat16: if this starts failing, the
    interpreter was fixed and the bfloat16 cases above can run on the CPU too."""
    x = torch.randn(16, 64).bfloat16()
    w = torch.randn(32, 64).bfloat16()
    y = lin._launch(lin._PLAIN, x[:3], w, (16, 64, 4, 2))[0]
    assert not torch.allclose(y.float(), (x[:3].float() @ w.float().t()), atol=1.0)


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("rows", [1, 8])
def test_gpu_decode_shapes(rows, monkeypatch):
    """8B-sized products on the GPU through the public functions, bf16."""
    for n, k in ((6144, 4096), (4096, 12288), (24576, 4096)):
        x, residual, gate_up, norm_w, weight = _inputs(rows, n, k, torch.bfloat16, seed=n)
        ref = _references(x, residual[:, :k], gate_up, norm_w, weight, monkeypatch)
        _close(lin.linear(x, weight), ref["linear"], torch.bfloat16)
        y, s = lin.add_rms_norm_linear(x, residual, norm_w, 1e-6, weight)
        _close(y, ref["norm"], torch.bfloat16)
        assert torch.equal(s, ref["sum"])
        _close(lin.silu_mul_linear(gate_up, weight), ref["silu"], torch.bfloat16)
    x, _, _, _, head = _inputs(rows, 151936, 4096, torch.bfloat16, seed=3)  # the LM head, float32 logits
    logits = lin.linear(x, head, out_dtype=torch.float32)
    assert logits.dtype == torch.float32
    _close(logits, F.linear(x, head), torch.bfloat16)

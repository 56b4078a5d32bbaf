"""tensor_stats: exact values for every dtype, population std, NaN/inf handling, chunking, layouts."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardtrain.debug import tensor_stats
from shardtrain.debug import tensor_summary as stats_module

FLOATS = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
INTS = [torch.int8, torch.int16, torch.int32, torch.int64]


@pytest.mark.parametrize("dtype", FLOATS)
def test_float_stats_exact_with_nan_and_inf(dtype):
    t = torch.tensor([1.0, -2.0, 0.0, 3.0, math.nan, math.inf, -math.inf], dtype=dtype)
    s = tensor_stats(t)
    # moments over the finite values [1, -2, 0, 3]; population std: sqrt(((.5)^2 + 2.5^2 + .5^2 + 2.5^2) / 4)
    assert s["dtype"] == str(dtype).removeprefix("torch.") and s["shape"] == [7] and s["numel"] == 7
    assert (s["min"], s["max"], s["mean"]) == (-2.0, 3.0, 0.5)
    assert s["std"] == pytest.approx(math.sqrt(3.25), rel=1e-15)
    assert s["norm"] == pytest.approx(math.sqrt(14.0), rel=1e-15)
    # counts over all elements: +inf is positive, -inf negative, NaN neither
    assert (s["nan"], s["inf"], s["zero"], s["pos"], s["neg"]) == (1, 2, 1, 3, 2)


@pytest.mark.parametrize("dtype", INTS)
def test_integer_stats_exact(dtype):
    s = tensor_stats(torch.tensor([[1, -2], [0, 3]], dtype=dtype))
    assert s["shape"] == [2, 2] and s["numel"] == 4
    assert (s["min"], s["max"]) == (-2, 3) and isinstance(s["min"], int)
    assert s["mean"] == 0.5 and s["std"] == pytest.approx(math.sqrt(3.25), rel=1e-15)
    assert (s["nan"], s["inf"], s["zero"], s["pos"], s["neg"]) == (0, 0, 1, 2, 1)


def test_int64_extremes_are_exact_beyond_float64():
    big = 2**62 + 1  # not representable in float64
    s = tensor_stats(torch.tensor([big, -big], dtype=torch.int64))
    assert (s["min"], s["max"]) == (-big, big)


def test_uint8_and_bool():
    s = tensor_stats(torch.tensor([0, 255, 1], dtype=torch.uint8))
    assert (s["min"], s["max"], s["zero"], s["pos"], s["neg"]) == (0, 255, 1, 2, 0)
    assert s["mean"] == pytest.approx(256 / 3, rel=1e-15)
    b = tensor_stats(torch.tensor([True, False, True, True]))
    assert b["dtype"] == "bool" and (b["min"], b["max"], b["mean"]) == (0.0, 1.0, 0.75)
    assert b["std"] == pytest.approx(math.sqrt(0.1875), rel=1e-15) and b["norm"] == pytest.approx(math.sqrt(3))
    assert (b["nan"], b["inf"], b["zero"], b["pos"], b["neg"]) == (0, 0, 1, 3, 0)


def test_std_is_population_not_sample():
    s = tensor_stats(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert s["std"] == pytest.approx(math.sqrt(1.25), rel=1e-15)  # sample std would be sqrt(5/3)
    assert tensor_stats(torch.tensor([7.0]))["std"] == 0.0  # defined for one element


def test_float64_accuracy_on_fp32_and_bf16():
    # a large offset makes float32 accumulation of the variance lose digits; float64 must match numpy exactly
    g = torch.Generator().manual_seed(0)
    t = (torch.randn(100_000, generator=g) * 0.01 + 1000.0).float()
    ref = t.double().numpy()
    s = tensor_stats(t)
    assert s["mean"] == pytest.approx(ref.mean(), rel=1e-13)
    assert s["std"] == pytest.approx(ref.std(), rel=1e-9)
    assert s["norm"] == pytest.approx(float(np.sqrt((ref * ref).sum())), rel=1e-13)
    h = torch.randn(1000, generator=g).bfloat16()
    ref = h.double().numpy()
    sh = tensor_stats(h)
    assert sh["std"] == pytest.approx(ref.std(), rel=1e-12) and sh["max"] == ref.max()


def test_no_finite_values_and_empty():
    s = tensor_stats(torch.full((3,), math.nan))
    assert all(s[k] is None for k in ("min", "max", "mean", "std", "norm"))
    assert (s["nan"], s["zero"], s["pos"], s["neg"]) == (3, 0, 0, 0)
    e = tensor_stats(torch.empty(0, 4))
    assert e["numel"] == 0 and e["shape"] == [0, 4] and e["mean"] is None and e["pos"] == 0


def test_chunked_equals_single_pass(monkeypatch):
    g = torch.Generator().manual_seed(1)
    t = torch.randn(1001, generator=g) * 3 + 5
    t[[3, 500, 999]] = torch.tensor([math.nan, math.inf, -math.inf])
    whole = tensor_stats(t)
    monkeypatch.setattr(stats_module, "CHUNK", 7)  # 143 chunks, some with non-finite values
    chunked = tensor_stats(t)
    assert chunked.keys() == whole.keys()
    for key, value in whole.items():
        assert chunked[key] == (pytest.approx(value, rel=1e-12) if isinstance(value, float) else value), key


def test_non_contiguous_and_grad_tensors():
    x = torch.arange(12.0).reshape(3, 4).requires_grad_()
    view = x.t()[1:]  # non-contiguous view of a tensor that requires grad
    s = tensor_stats(view)
    ref = view.detach().contiguous().double()
    assert s["shape"] == [3, 3] and s["mean"] == ref.mean().item() and s["max"] == 11.0
    assert x.grad is None and x.grad_fn is None  # nothing was recorded into autograd


def test_complex_gets_metadata_only():
    s = tensor_stats(torch.ones(2, dtype=torch.complex64))
    assert s == {"shape": [2], "dtype": "complex64", "numel": 2}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.bool])
def test_stats_on_cuda_match_cpu(dtype):
    t = (torch.arange(-50, 50) % 7 - 3).to(dtype)
    on_gpu, on_cpu = tensor_stats(t.cuda()), tensor_stats(t)
    assert on_gpu.keys() == on_cpu.keys()
    for key, value in on_cpu.items():  # reduction order differs on the GPU: equal to the last few bits
        assert on_gpu[key] == (pytest.approx(value, rel=1e-13) if isinstance(value, float) else value), key


@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(
        st.one_of(
            st.floats(min_value=-1e4, max_value=1e4, allow_nan=False, allow_infinity=False),
            st.sampled_from([math.nan, math.inf, -math.inf, 0.0]),
        ),
        max_size=40,
    ),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16]),
)
def test_stats_match_a_float64_reference(values, dtype):
    t = torch.tensor(values, dtype=torch.float64).to(dtype)  # rounding to the dtype happens here, as in a model
    ref = t.double().numpy()
    finite = ref[np.isfinite(ref)]
    s = tensor_stats(t)
    assert (s["nan"], s["inf"]) == (int(np.isnan(ref).sum()), int(np.isinf(ref).sum()))
    assert (s["zero"], s["pos"], s["neg"]) == (int((ref == 0).sum()), int((ref > 0).sum()), int((ref < 0).sum()))
    if finite.size == 0:
        assert s["mean"] is None and s["std"] is None
        return
    assert (s["min"], s["max"]) == (finite.min(), finite.max())
    assert s["mean"] == pytest.approx(finite.mean(), rel=1e-12, abs=1e-12)
    assert s["std"] == pytest.approx(finite.std(), rel=1e-9, abs=1e-9)  # numpy's default std is the population one
    assert s["norm"] == pytest.approx(float(np.sqrt((finite * finite).sum())), rel=1e-12)

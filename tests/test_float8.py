"""Float8 matrix products on emulated GPUs (gpemu.float8, the cost model's FP8 peaks): torch's
outputs, a price at the GPU's FP8 tensor-core peak, torch's refusal on GPUs without FP8 tensor
cores; and torchao's float8 training (when torchao is installed)."""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any

import pytest
import torch

import gpemu
from gpemu.clock import VirtualClock
from gpemu.costmodel import Precision, default_model
from gpemu.costmodel.classify import OpClass, classify
from gpemu.costmodel.gpus import FP8_FROM_CAPABILITY, GPUS, gpu_sheet, sheet_from_spec
from gpemu.costmodel.precision import compute_peak

aten = torch.ops.aten
_SCALED_MM_REFUSED = (
    "torch._scaled_mm is only supported on CUDA devices with compute capability >= 9.0 or 8.9, or ROCm MI300+"
)


def _patch(gpu: str) -> Any:
    return gpemu.patch(gpu=gpu, summary=False, clock=VirtualClock(), replay=False)


def _spans(rt: Any, fn, *args):
    """(result, [(name, GPU seconds)]) of ``fn(*args)``'s kernels."""
    first = len(rt.recorder.spans)
    out = fn(*args)
    return out, [(s.name.split(".")[0], s.end - s.start) for s in rt.recorder.spans[first:]]


def _fp8_operands(m: int, k: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``a`` row-major and ``b`` column-major float8 (what cuBLASLt's FP8 GEMM takes), one scale."""
    a = torch.empty(m, k, device="cuda", dtype=torch.bfloat16).to(torch.float8_e4m3fn)
    b = torch.empty(n, k, device="cuda", dtype=torch.bfloat16).to(torch.float8_e4m3fn).t()
    return a, b, torch.ones((), device="cuda")


# ------------------------------------------------------------------------------ the cost model
def test_every_gpu_with_fp8_tensor_cores_has_an_fp8_peak_twice_its_bf16_one() -> None:
    """The datasheets' dense FP8 rate is twice the BF16 rate on Ada, Hopper and Blackwell; GPUs
    older than compute capability 8.9 have none."""
    for sheet in GPUS:
        if sheet.compute_capability >= FP8_FROM_CAPABILITY:
            assert sheet.fp8_tensor_flops == pytest.approx(2 * sheet.bf16_tensor_flops, rel=0.02), sheet.name
        else:
            assert sheet.fp8_tensor_flops == 0, sheet.name


def test_float8_operands_run_at_the_fp8_peak_and_a_gpu_without_one_at_its_fp16_path() -> None:
    h100, a100 = gpu_sheet("H100"), gpu_sheet("A100")
    assert compute_peak(h100, OpClass.GEMM, "float8_e4m3fn", Precision()) == ("tensor", h100.fp8_tensor_flops)
    assert compute_peak(a100, OpClass.GEMM, "float8_e5m2", Precision()) == ("tensor", a100.fp16_tensor_flops)


def test_a_gpu_added_with_ada_capability_takes_twice_its_bf16_rate_for_fp8() -> None:
    class Added:  # what `gpemu gpus add` records for a GPU the table does not have
        name, aliases, sm_count, memory_bytes = "Lab GPU", (), 100, 48 << 30
        memory_bandwidth, fp32_flops, fp16_flops = 1e12, 50e12, 200e12
        host_link_bandwidth_pinned = host_link_bandwidth_pageable = 20e9
        bf16_tensor_flops = 200e12
        compute_capability = (8, 9)

    assert sheet_from_spec(Added()).fp8_tensor_flops == 400e12
    Added.compute_capability = (8, 6)
    assert sheet_from_spec(Added()).fp8_tensor_flops == 0


def test_grouped_matrix_products_count_each_expert_once() -> None:
    """A mixture of experts' grouped GEMM: tokens x K by experts x K x N is one GEMM of all tokens."""
    a = torch.empty(512, 256, device="meta", dtype=torch.float8_e4m3fn)
    b = torch.empty(4, 1024, 256, device="meta", dtype=torch.float8_e4m3fn).transpose(-2, -1)
    scale_a, scale_b = torch.empty(512, device="meta"), torch.empty(4, 1024, device="meta")
    offs = torch.empty(4, device="meta", dtype=torch.int32)
    kw = {"offs": offs, "out_dtype": torch.bfloat16}
    out = aten._scaled_grouped_mm.default(a, b, scale_a, scale_b, **kw)
    op = classify(aten._scaled_grouped_mm.default, (a, b, scale_a, scale_b), kw, out)
    assert op.op_class is OpClass.GEMM and op.dtype == "float8_e4m3fn"
    assert (op.flops, op.reduction) == (2.0 * 512 * 1024 * 256, 256)


# ------------------------------------------------------------------------------ emulated GPUs
def test_an_fp8_gemm_on_an_h100_gives_torchs_output_and_is_priced_about_twice_as_fast_as_bf16() -> None:
    """A compute-bound shape (8192 cubed): the FP8 peak is twice the BF16 one, on the same curve."""
    rt = _patch("H100")
    n = 8192
    x = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    w = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    a, b, scale = _fp8_operands(n, n, n)
    before = torch.cuda.memory_allocated()
    out, fp8 = _spans(rt, torch._scaled_mm, a, b, scale, scale, None, None, torch.bfloat16)
    assert (out.shape, out.dtype, out.device, out.stride()) == ((n, n), torch.bfloat16, torch.device("cuda:0"), (n, 1))
    assert torch.cuda.memory_allocated() - before == n * n * 2
    _, bf16 = _spans(rt, torch.mm, x, w)
    assert [name for name, _ in fp8] == ["_scaled_mm"] and [name for name, _ in bf16] == ["mm"]
    assert 1.85 < bf16[0][1] / fp8[0][1] <= 2.0 * 1.001


def test_scaled_mm_output_dtype_defaults_to_the_operands_and_checks_layout_as_torch() -> None:
    _patch("L4")
    a, b, scale = _fp8_operands(64, 128, 32)
    assert torch._scaled_mm(a, b, scale, scale).dtype == torch.float8_e4m3fn
    with pytest.raises(RuntimeError, match="mat2 must be col_major"):
        torch._scaled_mm(a, b.t().contiguous().t().contiguous(), scale, scale, out_dtype=torch.bfloat16)


@pytest.mark.parametrize("gpu", ["A100", "V100", "T4"])
def test_gpus_without_fp8_tensor_cores_refuse_scaled_mm_as_torch_does(gpu: str) -> None:
    _patch(gpu)
    a, b, scale = _fp8_operands(64, 128, 32)
    for _ in range(2):  # (the refusal is not cached away)
        with pytest.raises(RuntimeError, match=re.escape(_SCALED_MM_REFUSED)):
            torch._scaled_mm(a, b, scale, scale, out_dtype=torch.bfloat16)


def test_torchs_public_scaled_mm_v2_is_priced_as_scaled_mm_and_refused_on_an_a100() -> None:
    """``torch.nn.functional.scaled_mm`` (``_scaled_mm_v2``, recipes by enum): the same kernel."""
    from torch.nn.functional import ScalingType, scaled_mm

    tensorwise = ScalingType.TensorWise
    rt = _patch("H100")
    a, b, scale = _fp8_operands(1024, 2048, 512)
    v2_call = functools.partial(scaled_mm, a, b, scale, tensorwise, scale, tensorwise, output_dtype=torch.bfloat16)
    out, v2 = _spans(rt, v2_call)
    _, v1 = _spans(rt, torch._scaled_mm, a, b, scale, scale, None, None, torch.bfloat16)
    assert (out.shape, out.dtype) == ((1024, 512), torch.bfloat16)
    assert [n for n, _ in v2] == ["_scaled_mm_v2"] and v2[0][1] == pytest.approx(v1[0][1], rel=1e-9)
    gpemu.unpatch()
    _patch("A100")
    a, b, scale = _fp8_operands(1024, 2048, 512)
    with pytest.raises(NotImplementedError, match=re.escape(_SCALED_MM_REFUSED)):
        scaled_mm(a, b, scale, tensorwise, scale, tensorwise, output_dtype=torch.bfloat16)


def test_grouped_fp8_gemms_run_on_hopper_and_are_refused_on_ada() -> None:
    """torch's grouped form wants compute capability 9.x or 10.x: an L40S (8.9) is refused."""
    for gpu, runs in (("H100", True), ("L40S", False)):
        _patch(gpu)
        a = torch.empty(512, 256, device="cuda", dtype=torch.bfloat16).to(torch.float8_e4m3fn)
        b = torch.empty(4, 1024, 256, device="cuda", dtype=torch.bfloat16).to(torch.float8_e4m3fn).transpose(-2, -1)
        scales = torch.ones(512, device="cuda"), torch.ones(4, 1024, device="cuda")
        offs = torch.tensor([128, 256, 384, 512], device="cuda", dtype=torch.int32)
        if runs:
            out = torch._scaled_grouped_mm(a, b, *scales, offs=offs, out_dtype=torch.bfloat16)
            assert (out.shape, out.dtype) == ((512, 1024), torch.bfloat16)
        else:
            with pytest.raises(ValueError, match=re.escape("compute capability = [9.0, 10.0]")):
                torch._scaled_grouped_mm(a, b, *scales, offs=offs, out_dtype=torch.bfloat16)
        gpemu.unpatch()


def test_the_cost_model_alone_prices_fp8_on_the_same_curve_as_bf16() -> None:
    """Without the emulator: the ratio approaches the peaks' ratio as the GEMM grows."""
    model = default_model()
    ratios = []
    for n in (1024, 8192):
        mm = classify(aten.mm.default, (torch.empty(n, n, device="meta", dtype=torch.bfloat16),) * 2)
        scaled = dataclasses.replace(mm, dtype="float8_e4m3fn")
        ratios.append(model.op_seconds(mm, "H100") / model.op_seconds(scaled, "H100"))
    assert 1.5 < ratios[0] < ratios[1] <= 2.0 * 1.001


# ------------------------------------------------------------------------------ torchao
def _mlp_step_ms(gpu: str, float8: bool, width: int = 4096, tokens: int = 8192) -> float:
    """The steady-state step (forward, backward, AdamW) of a compiled bf16 MLP block on ``gpu``,
    with torchao's float8 linear layers or without, in emulated milliseconds (CUDA events)."""
    from torchao.float8 import convert_to_float8_training

    _patch(gpu)
    mlp = torch.nn.Sequential(
        torch.nn.Linear(width, 4 * width, bias=False), torch.nn.GELU(), torch.nn.Linear(4 * width, width, bias=False)
    )
    mlp = mlp.cuda().to(torch.bfloat16)
    if float8:
        convert_to_float8_training(mlp)
        assert type(mlp[0]).__name__ == "Float8Linear"
    step_fn = torch.compile(mlp)
    opt = torch.optim.AdamW(mlp.parameters(), lr=1e-3)
    x = torch.empty(tokens, width, device="cuda", dtype=torch.bfloat16)
    times = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step_fn(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    gpemu.unpatch()
    return times[-1]


@pytest.mark.slow
def test_torchao_float8_training_on_an_h100_beats_bf16_and_is_refused_on_an_a100() -> None:
    """torchao's Float8Linear, compiled as torchao recommends: its six FP8 GEMMs cost half of bf16's
    (bf16 autograd skips the first layer's input gradient: five), its amax reductions and casts
    add memory-bound kernels, AdamW is the same; the step is 1.11x faster (measured,
    docs/compile.md). On an A100 the first float8 GEMM raises torch's error."""
    pytest.importorskip("torchao.float8")
    bf16, fp8 = _mlp_step_ms("H100", float8=False), _mlp_step_ms("H100", float8=True)
    assert 1.05 < bf16 / fp8 < 1.2
    with pytest.raises(RuntimeError, match=re.escape(_SCALED_MM_REFUSED)):
        _mlp_step_ms("A100", float8=True)

"""Hopper's convolutions (issue 29): a GPU priced with Ampere's curves gets what cuDNN delivers of its
tensor cores (gpus.TENSOR_CONV_SHARE, measured by the H100's op sweep), not its datasheet's 3.2x."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest
import torch

from gpemu.costmodel import Precision, classify, default_model
from gpemu.costmodel.gpus import TENSOR_CONV_SHARE, gpu_sheet, tensor_conv_share
from gpemu.db.op_measurements import OpMeasurement

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
H100_DATA = BENCHMARKS / "data" / "h100-2026-11-26.json"
aten = torch.ops.aten


def _sweep() -> list[OpMeasurement]:
    rows = json.loads(H100_DATA.read_text())["op_measurements"]
    fields = OpMeasurement.__dataclass_fields__
    return [OpMeasurement(**{k: v for k, v in r.items() if k in fields}) for r in rows]


def test_the_hopper_shares_are_what_the_h100_op_sweep_measured():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        hopper_share = importlib.import_module("hopper_share")
    finally:
        sys.path.remove(str(BENCHMARKS))
    ratios = {r.kind: r for r in hopper_share.kind_ratios("H100", _sweep())}
    assert set(TENSOR_CONV_SHARE["hopper"]) < set(ratios)
    for kind, r in ratios.items():
        # the shipped price of each kind's (and pass's) larger kernels is their measured time (within 5%)
        assert r.n >= 8 and r.priced_over_measured == pytest.approx(1.0, rel=0.05), kind


def _conv3x3(batch: int = 128, channels: int = 256, size: int = 28):
    x = torch.empty(batch, channels, size, size, device="meta")
    w = torch.empty(channels, channels, 3, 3, device="meta")
    args = (x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    return classify(aten.convolution.default, args, {}, aten.convolution.default(*args))


def test_a_large_tf32_3x3_convolution_is_not_priced_at_the_peak_ratio():
    model, conv = default_model(), _conv3x3()
    a100, h100 = gpu_sheet("A100"), gpu_sheet("H100")
    speedup = model.op_seconds(conv, a100) / model.op_seconds(conv, h100)
    peaks = h100.tf32_tensor_flops / a100.tf32_tensor_flops  # 3.2x
    assert 1.2 < speedup < 0.7 * peaks
    # fp16 convolutions take the same share; GEMMs none (their published plateau already holds)
    half = Precision("float16")
    assert model.op_seconds(conv, a100, half) / model.op_seconds(conv, h100, half) < 0.7 * peaks


def test_a_gpu_priced_with_its_own_curves_takes_no_share():
    shares = TENSOR_CONV_SHARE["hopper"]
    assert tensor_conv_share("hopper", "conv_spatial.bwd", "ampere") == shares["conv_spatial.bwd"]
    # a bare kind is its forward; the backward's kernels (data and weight gradients) take their own
    assert tensor_conv_share("hopper", "conv_spatial", "ampere") == shares["conv_spatial.fwd"]
    assert shares["conv_spatial.fwd"] != shares["conv_spatial.bwd"]
    assert tensor_conv_share("hopper", "conv_spatial.fwd", "hopper") == 1.0
    assert tensor_conv_share("hopper", "conv_spatial", "calibrated:NVIDIA H100 80GB HBM3") == 1.0
    assert tensor_conv_share("ampere", "conv_spatial", "turing") == 1.0

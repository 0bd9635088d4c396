"""gpemu.costmodel: op classification and FLOPs, datasheets, precisions, the calibrated model.

Fast (no fitting): the shipped parameters are loaded, a few small models are recorded on meta."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch.utils.flop_counter import flop_registry

from examples import tvmodels
from gpemu.costmodel import GPUS, OpClass, Precision, classify, default_model, gpu_sheet, record_step
from gpemu.costmodel import curve as C
from gpemu.costmodel.gpus import DONORS, GENERATIONS
from gpemu.costmodel.model import PARAMS_PATH, CostModel, curve_key
from gpemu.costmodel.precision import compute_peak

aten = torch.ops.aten


def meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, device="meta", dtype=dtype)


def conv_ops(c_in, c_out, groups, k=3, n=8, hw=14, dtype=torch.float32):
    """Forward and backward features of one convolution (meta tensors)."""
    x, w = meta(n, c_in, hw, hw, dtype=dtype), meta(c_out, c_in // groups, k, k, dtype=dtype)
    args = (x, w, None, [1, 1], [k // 2, k // 2], [1, 1], False, [0, 0], groups)
    out = aten.convolution.default(*args)
    fwd = classify(aten.convolution.default, args, {}, out)
    bargs = (out, x, w, None, [1, 1], [k // 2, k // 2], [1, 1], False, [0, 0], groups, [True, True, False])
    bout = aten.convolution_backward.default(*bargs)
    bwd = classify(aten.convolution_backward.default, bargs, {}, bout)
    return fwd, bwd, args, out, bargs, bout


# ------------------------------------------------------------------------------ FLOPs, classes
def test_depthwise_backward_is_two_forward_convolutions_not_groups_times_more():
    fwd, bwd, *_rest, bargs, bout = conv_ops(64, 64, groups=64)
    assert fwd.op_class is OpClass.CONV_DEPTHWISE and bwd.op_class is OpClass.CONV_DEPTHWISE
    assert fwd.flops == 2 * 8 * 14 * 14 * 64 * 9
    assert bwd.flops == 2 * fwd.flops and bwd.backward
    # torch's own formula counts the weight gradient as if ungrouped (the bug this corrects)
    torch_count = flop_registry[aten.convolution_backward](*bargs, out_val=bout)
    assert torch_count > 30 * fwd.flops


def test_grouped_and_dense_backward_flops_and_masks():
    fwd, bwd, *_ = conv_ops(128, 128, groups=32)
    assert fwd.op_class is OpClass.CONV_GROUPED and fwd.groups == 32 and fwd.reduction == 4 * 9
    assert bwd.flops == 2 * fwd.flops
    dense_f, dense_b, args, out, bargs, bout = conv_ops(32, 64, groups=1)
    assert dense_f.op_class is OpClass.CONV and dense_f.flops == flop_registry[aten.convolution](*args, out_val=out)
    # for a dense convolution torch's backward formula is right, and equal to ours
    assert dense_b.flops == 2 * dense_f.flops == flop_registry[aten.convolution_backward](*bargs, out_val=bout)
    # first layer: no input gradient requested -> one convolution's worth, and the weight is not read
    first = list(bargs)
    first[-1] = [False, True, False]
    one = classify(aten.convolution_backward.default, tuple(first), {}, aten.convolution_backward.default(*first))
    assert one.flops == dense_f.flops and one.nbytes < dense_b.nbytes


def test_representative_ops_are_classified():
    a, b = meta(64, 128), meta(128, 32)
    x4 = meta(8, 16, 32, 32)
    cases = {
        OpClass.GEMM: [
            (aten.mm.default, (a, b)),
            (aten.addmm.default, (meta(32), a, b)),
            (aten.bmm.default, (meta(4, 64, 128), meta(4, 128, 32))),
        ],
        OpClass.NORM: [
            (aten.native_batch_norm.default, (x4, meta(16), meta(16), meta(16), meta(16), True, 0.1, 1e-5)),
            (aten.native_layer_norm.default, (meta(8, 64), [64], meta(64), meta(64), 1e-5)),
        ],
        OpClass.ELEMENTWISE: [
            (aten.relu_.default, (x4,)),
            (aten.add.Tensor, (x4, x4)),
            (aten.threshold_backward.default, (x4, x4, 0.0)),
            (aten.gelu.default, (x4,)),
        ],
        OpClass.REDUCTION: [
            (aten._softmax.default, (a, 1, False)),
            (aten._log_softmax.default, (a, 1, False)),
            (aten.sum.dim_IntList, (x4, [2, 3])),
        ],
        OpClass.POOLING: [
            (aten.max_pool2d_with_indices.default, (x4, [3, 3], [2, 2], [1, 1])),
            (aten._adaptive_avg_pool2d.default, (x4, [1, 1])),
        ],
        OpClass.EMBEDDING: [
            (aten.embedding.default, (meta(1000, 64), torch.zeros(8, dtype=torch.long, device="meta")))
        ],
        OpClass.COPY: [(aten.cat.default, ([x4, x4], 1)), (aten.clone.default, (x4,))],
        OpClass.FREE: [
            (aten.view.default, (x4, [-1])),
            (aten.t.default, (a,)),
            (aten.detach.default, (x4,)),
            (aten.empty.memory_format, ([4, 4],)),
        ],
    }
    for cls, ops in cases.items():
        for op, args in ops:
            out = op(*args)
            feat = classify(op, args, {}, out)
            assert feat.op_class is cls, (op, feat.op_class)
    mm = classify(aten.mm.default, (a, b), {}, aten.mm.default(a, b))
    assert mm.flops == 2 * 64 * 128 * 32 and mm.reduction == 128 and mm.nbytes == 4 * (64 * 128 + 128 * 32 + 64 * 32)
    add = classify(aten.add.Tensor, (x4, x4), {}, x4)
    assert add.nbytes == 2 * x4.numel() * 4  # x read once, output written once
    q = meta(2, 4, 128, 64)
    fa = classify(aten._scaled_dot_product_flash_attention.default, (q, q, q), {}, None)
    assert fa.op_class is OpClass.ATTENTION and fa.flops == 2 * 2 * 4 * 2 * 128 * 128 * 64
    fb = classify(aten._scaled_dot_product_flash_attention_backward.default, (q, q, q, q), {}, None)
    assert fb.backward and fb.flops == pytest.approx(2.5 * fa.flops)


def test_record_step_separates_forward_backward_and_skips_free_ops():
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(inplace=True),
        torch.nn.Flatten(),
        torch.nn.Linear(8 * 6 * 6, 10),
    )
    step = record_step(model.train(), (torch.empty(4, 3, 8, 8),))
    fwd = [o.name for o in step.forward]
    bwd = [o.name for o in step.backward]
    assert "convolution" in fwd and "native_batch_norm" in fwd and "relu" in fwd and "addmm" in fwd
    assert "convolution_backward" in bwd and "native_batch_norm_backward" in bwd and "threshold_backward" in bwd
    assert all(o.backward for o in step.backward) and not any(o.backward for o in step.forward)
    assert all(o.op_class is not OpClass.FREE for o in step.forward + step.backward)
    assert next(p for p in model.parameters()).device.type == "cpu"  # the module itself is untouched


# ------------------------------------------------------------------------------ GPUs, precision
def test_datasheet_table_is_complete_and_self_consistent():
    names = {g.short_name for g in GPUS}
    for want in (
        "H100",
        "H100-PCIe",
        "H200",
        "B200",
        "A100-80GB",
        "L40S",
        "L4",
        "A10G",
        "RTX4090",
        "T4",
        "K80",
        "M40",
        "P100",
        "V100",
        "RTX6000",
        "A100",
    ):
        assert want in names
    for g in GPUS:
        assert g.generation in GENERATIONS and g.generation in DONORS
        for f in (
            "memory_bytes",
            "memory_bandwidth",
            "sm_count",
            "fp32_flops",
            "host_link_bandwidth_pinned",
            "host_link_bandwidth_pageable",
        ):
            assert getattr(g, f) > 0, (g.name, f)
        assert g.bf16_tensor_flops in (0, g.fp16_tensor_flops)  # dense rates; bf16 = fp16 where both exist
        if g.generation in ("kepler", "maxwell", "pascal"):
            assert g.fp16_tensor_flops == 0 and g.tf32_tensor_flops == 0
        if g.generation in ("volta", "turing"):
            assert g.fp16_tensor_flops > 0 and g.bf16_tensor_flops == 0 and g.tf32_tensor_flops == 0
        if g.generation in ("ampere", "ada", "hopper", "blackwell"):
            assert g.tf32_tensor_flops > 0 and g.bf16_tensor_flops >= 1.97 * g.tf32_tensor_flops
    p100 = gpu_sheet("p100")
    assert p100.fp16_flops > 1.9 * p100.fp32_flops and p100.fp16_tensor_flops == 0  # 2x FP16, no tensor cores
    assert gpu_sheet("Tesla V100-PCIE-32GB") is gpu_sheet("v100")
    with pytest.raises(KeyError):
        gpu_sheet("no such gpu")


def test_precision_paths():
    a100, v100, p100 = gpu_sheet("A100"), gpu_sheet("V100"), gpu_sheet("P100")
    fp32 = Precision()
    assert compute_peak(a100, OpClass.CONV, "float32", fp32) == ("tensor", 156e12)  # cuDNN TF32 on by default
    assert compute_peak(a100, OpClass.GEMM, "float32", fp32) == ("simt", 19.5e12)  # matmul TF32 off by default
    assert compute_peak(a100, OpClass.GEMM, "float32", Precision(allow_tf32_matmul=True))[0] == "tensor"
    assert compute_peak(a100, OpClass.GEMM, "bfloat16", fp32) == ("tensor", 312e12)
    assert compute_peak(v100, OpClass.GEMM, "float16", fp32) == ("tensor", 112e12)
    assert compute_peak(v100, OpClass.GEMM, "bfloat16", fp32)[0] == "simt"  # no bf16 tensor cores
    assert compute_peak(p100, OpClass.CONV, "float16", fp32) == ("simt", 18.7e12)
    with pytest.raises(ValueError):
        Precision("int8")
    torch.backends.cudnn.allow_tf32, old = False, torch.backends.cudnn.allow_tf32
    try:
        assert Precision.from_torch(torch.bfloat16) == Precision(
            "bfloat16", torch.backends.cuda.matmul.allow_tf32, False
        )
    finally:
        torch.backends.cudnn.allow_tf32 = old


# ------------------------------------------------------------------------------ the calibrated model
@pytest.fixture(scope="module")
def model() -> CostModel:
    return default_model()


def test_bf16_gemm_gains_the_tensor_core_ratio_elementwise_only_the_bytes(model):
    n = 8192
    a16, a32 = meta(n, n, dtype=torch.bfloat16), meta(n, n)
    f32 = classify(aten.mm.default, (a32, a32), {}, meta(n, n))
    f16 = classify(aten.mm.default, (a16, a16), {}, meta(n, n, dtype=torch.bfloat16))
    t32, t16 = model.op_seconds(f32, "A100"), model.op_seconds(f16, "A100")
    ratio = t32 / t16
    # 312 / 19.5 TFLOP/s = 16, times the ratio of the published plateaus (0.86 tensor, 0.80 SIMT)
    assert 0.5 * 16 < ratio < 2 * 16, ratio
    x32, x16 = meta(64, 256, 56, 56), meta(64, 256, 56, 56, dtype=torch.bfloat16)
    e32 = classify(aten.add.Tensor, (x32, x32), {}, x32)
    e16 = classify(aten.add.Tensor, (x16, x16), {}, x16)
    r = model.op_seconds(e32, "A100") / model.op_seconds(e16, "A100")
    assert 1.6 < r <= 2.0, r  # half the bytes; a bandwidth-bound op cannot gain more
    # fp32 ops priced in bf16 (autocast) move half the bytes and use the tensor peak
    assert model.op_seconds(e32, "A100", Precision("bfloat16")) == pytest.approx(model.op_seconds(e16, "A100"))
    assert model.op_seconds(f32, "A100", Precision("bfloat16")) == pytest.approx(t16)
    # TF32 switch for cuDNN: convolutions slow down without it on the A100
    conv = conv_ops(256, 256, 1, n=64, hw=28)[0]
    assert model.op_seconds(conv, "A100", Precision(allow_tf32_cudnn=False)) > 1.5 * model.op_seconds(conv, "A100")


def test_every_gpu_prices_every_key_finite_and_positive(model):
    ops = [conv_ops(64, 64, g, k=k)[i] for g in (1, 8, 64) for k in (1, 3) for i in (0, 1)]
    x = meta(32, 64, 28, 28)
    ops += [
        classify(aten.relu_.default, (x,), {}, x),
        classify(aten.mm.default, (meta(256, 512), meta(512, 512)), {}, meta(256, 512)),
    ]
    for g in GPUS:
        for prec in (Precision(), Precision("bfloat16"), Precision("float16")):
            for op in ops:
                t = model.op_seconds(op, g, prec)
                assert math.isfinite(t) and t > 0, (g.name, op, prec)
    faster = model.op_seconds(ops[2], "H100") < model.op_seconds(ops[2], "A100") < model.op_seconds(ops[2], "K80")
    assert faster


def test_fitted_model_reproduces_a_held_in_measurement(model):
    import gpemu
    from gpemu.db import open_profile_db

    db = open_profile_db(gpemu.EmuConfig.from_env())
    with torch.device("meta"):
        net = tvmodels.resnet18().train()
    ops = record_step(net, (torch.empty(64, 3, 224, 224),))
    estimate = {}
    for gpu in ("V100", "A100", "K80"):
        estimate[gpu] = model.ops_seconds(ops.forward, gpu) + model.ops_seconds(ops.backward, gpu)
        name = gpu_sheet(gpu).name
        real = db.lookup(name, "resnet18", 64, "forward").value + db.lookup(name, "resnet18", 64, "backward").value
        assert abs(estimate[gpu] / real - 1) < 0.2, (gpu, estimate[gpu], real)
    h100 = model.module_seconds(net, (torch.empty(64, 3, 224, 224),), "H100")
    # faster than the A100 whose curves it borrows (more SMs, 3x the TF32 peak, 2x the bandwidth)
    assert 0 < h100.total < estimate["A100"] and math.isfinite(h100.total)
    assert h100.uncertainty is not None and "±" in str(h100.uncertainty)
    assert h100.uncertainty.basis.startswith("leave-one-GPU-out")
    assert model.uncertainty("V100").basis.startswith("leave-one-model-out")
    assert model.uncertainty("T4").basis.startswith("leave-one-GPU-out")  # Turing, but not the measured one


def test_queue_overlaps_host_and_gpu_time():
    assert C.queue_seconds([(1.0, 0.1)] * 5) == pytest.approx(5.1)  # host-bound: the host's time
    assert C.queue_seconds([(0.1, 1.0)] * 5) == pytest.approx(5.1)  # GPU-bound: the GPU's time
    assert C.queue_seconds([(0.1, 3.0), (1.0, 0.1), (1.0, 0.1)]) == pytest.approx(3.3)  # host banked time
    c = C.Curve(e=0.5, x0=1e6, p=1.0, h=1e-5)
    assert c.efficiency(1e9) == pytest.approx(0.5 / 1.001)
    big = C.kernel_seconds(1e12, 1e13, 100, c)
    assert big == pytest.approx(1e12 / (1e13 * 0.5) * (1 + 1e6 * 100 / 1e12))


def test_the_shape_term_slows_the_work_not_the_filling():
    """A shallow reduction (small K) runs its work slower; a tiny kernel still costs about its
    fill time, whatever its depth (the product of the two priced MNIST's 1-channel first layer's
    backward at 6 ms on an A100)."""
    c = C.Curve(e=1.0, x0=1e6, p=1.0, h=0.0, k0=1000.0)
    sms, peak = 100, 1e13
    fill = sms * c.x0 / peak
    shallow, deep = 1 / 9, 0.0
    tiny = C.kernel_seconds(1e4, peak, sms, c, shallow)
    assert fill < tiny < 1.05 * fill
    huge = 1e14
    ratio = C.kernel_seconds(huge, peak, sms, c, shallow) / C.kernel_seconds(huge, peak, sms, c, deep)
    assert ratio == pytest.approx(1 + 1000 / 9, rel=1e-3)
    # the fitting form and its derivatives agree with the scalar form (finite differences)
    import numpy as np

    work, z = np.array([1e6, 1e9, 1e12]), np.array([shallow, 0.01, deep])
    args = dict(
        le=np.log(np.full(3, 0.8)), lx0=np.log(np.full(3, 1e6)), p=np.full(3, 0.7), lk0=np.log(np.full(3, 300.0))
    )
    g, *grads = C.kernel_arrays(work, np.full(3, peak), sms, args["le"], args["lx0"], args["p"], args["lk0"], z)
    curve = C.Curve(0.8, 1e6, 0.7, 0.0, 300.0)
    scalar = [C.kernel_seconds(w, peak, sms, curve, zz) for w, zz in zip(work, z, strict=True)]
    assert np.allclose(g, scalar, rtol=1e-12)
    for name, d in zip(("le", "lx0", "p", "lk0"), grads, strict=False):
        bumped = dict(args)
        bumped[name] = args[name] + 1e-6
        g2 = C.kernel_arrays(work, np.full(3, peak), sms, **bumped, z=z, grads=False)[0]
        assert np.allclose((g2 - g) / 1e-6, d, rtol=1e-4, atol=1e-18), name


def test_mnist_and_cifar_first_layers_cost_microseconds_not_milliseconds(model):
    """Inputs of 1 or 3 channels at 28-32 pixels, batch 128: well below a millisecond per
    convolution pass on an A100 (nothing measured here checks the figure; this bounds the form,
    under which they priced at 2-6 ms)."""
    for c_in, hw in ((1, 28), (3, 32)):
        fwd, bwd, *_ = conv_ops(c_in, 64, 1, k=3, n=128, hw=hw)
        for op in (fwd, bwd):
            assert model.op_seconds(op, "A100") < 0.5e-3, (c_in, op.name, model.op_seconds(op, "A100"))


def test_shipped_parameters_cover_the_measured_generations():
    doc = json.loads(PARAMS_PATH.read_text())
    assert set(doc["generations"]) == {"kepler", "maxwell", "pascal", "volta", "turing", "ampere"}
    for gen, g in doc["generations"].items():
        assert gpu_sheet(g["gpu"]).generation == gen
        assert {
            "conv_spatial.fwd",
            "conv_spatial.bwd",
            "conv1x1.fwd",
            "conv_strided.bwd",
            "norm.fwd",
            "elementwise.bwd",
        } <= set(g["curves"])
    assert doc["generations"]["ampere"]["curves"]["conv_spatial.fwd"]["path"] == "tensor"
    assert doc["generations"]["volta"]["curves"]["conv_spatial.fwd"]["path"] == "simt"
    u = doc["uncertainty"]["measured_gpu"]["overall"]
    assert 0 < u["p50"] < u["p90"] < 1
    # GEMM curves: the published plateau, a ramp of at most KERNEL_RAMP_MAX at that rate, and a
    # host time of tens of microseconds (what the fit may and may not set)
    from gpemu.costmodel.published import GEMM_PLATEAU_SIMT, KERNEL_RAMP_MAX

    for gen, g in doc["generations"].items():
        sheet = gpu_sheet(g["gpu"])
        for phase in ("fwd", "bwd"):
            c = g["curves"][f"gemm.{phase}"]
            assert c["path"] == "simt" and c["e"] == GEMM_PLATEAU_SIMT, (gen, c)
            assert c["x0"] * sheet.sm_count / (sheet.fp32_flops * c["e"]) <= KERNEL_RAMP_MAX * 1.001, (gen, c)
            assert c["h"] <= 5e-5 and c["k0"] <= 64.001, (gen, c)
    assert {"measured_gpu", "datasheet_gpu", "transferred_gpu"} <= set(doc["uncertainty"])
    assert curve_key(conv_ops(8, 8, 1, k=3)[1]) == "conv_spatial.bwd"
    assert curve_key(conv_ops(8, 8, 1, k=1)[0]) == "conv1x1.fwd"


def test_the_library_imports_nothing_else_of_gpemu():
    """A pure library at the bottom of the core layers: no module of gpemu.costmodel imports
    another gpemu module (the database, the runtime, tensors; its fit is gpemu.profiler.costfit)."""
    import ast
    from pathlib import Path

    import gpemu.costmodel as pkg

    for path in Path(pkg.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module]
            for n in names:
                assert n.split(".")[0] != "gpemu" or n.startswith("gpemu.costmodel"), (path.name, n)


def _costmodel_imports() -> dict[str, set[str]]:
    """Module -> the library's modules it imports, as the type checker reads them: ``from . import
    curve`` reads the package (its ``__init__``) as well as ``curve``."""
    import ast
    from pathlib import Path

    import gpemu.costmodel as pkg

    graph: dict[str, set[str]] = {}
    for path in Path(pkg.__file__).parent.glob("*.py"):
        name = "" if path.stem == "__init__" else path.stem
        deps = graph.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                if node.module:
                    deps.add(node.module.split(".")[0])
                else:
                    deps.update({""} | {a.name for a in node.names})
    return graph


def test_the_library_has_no_import_cycle():
    """No module of gpemu.costmodel needs, through its imports, the package ``__init__`` that
    imports it (``from . import curve`` in model.py made model, classify, precision, record,
    table and the package one knot the type checker had to check together)."""
    graph = _costmodel_imports()

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt == goal:
                    return True
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return False

    assert graph[""] >= {"classify", "gpus", "model"}  # the package imports its parts ...
    assert [m for m in graph if reaches(m, m)] == []  # ... and none of them leads back to itself


def test_op_tables_scale_with_the_batch_exactly():
    """Recorded at batch 2 and 4, a model's features at batch 16 equal a recording at 16."""
    from gpemu.costmodel.table import affine_table, table_from_ops

    nn = torch.nn
    with torch.device("meta"):
        net = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 16, 3, groups=16),
            nn.Conv2d(16, 32, 1),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Dropout(),
            nn.Linear(32, 10),
        ).train()

    def ops(n):
        s = record_step(net, (torch.empty(n, 3, 32, 32),))
        return s.forward + s.backward

    tab = affine_table(ops(2), 2, ops(4), 4)
    direct = table_from_ops(ops(16))
    assert len(tab) == len(direct) > 15
    assert torch.allclose(torch.tensor(tab.flops(16)), torch.tensor(direct.flops0))
    assert torch.allclose(torch.tensor(tab.nbytes(16)), torch.tensor(direct.bytes0))
    assert (tab.bytes0 > 0).any() and (tab.flops1 > 0).mean() > 0.9  # weights do not scale, activations do


# ------------------------------------------------------------------------------ the matmul family
def gemm_op(m: int, k: int, n: int, dtype=torch.float32):
    """Features of one ``m x k @ k x n`` GEMM (meta tensors)."""
    a, b = meta(m, k, dtype=dtype), meta(k, n, dtype=dtype)
    return classify(aten.mm.default, (a, b), {}, meta(m, n, dtype=dtype))


def tflops(model, op, gpu, prec: Precision | None = None) -> float:
    return op.flops / model.op_seconds(op, gpu, prec or Precision()) / 1e12


def test_large_gemms_level_off_at_the_published_plateau_never_above(model):
    from gpemu.costmodel.published import GEMM_PLATEAU_SIMT, PUBLISHED_GEMMS, tensor_plateau

    sheet = gpu_sheet("A100")
    big = gemm_op(8192, 8192, 8192)
    # fp32 on the FMA units: close to the published plateau (the ramp and depth terms cost a few
    # percent at this size), never above it
    assert 0.85 * GEMM_PLATEAU_SIMT * 19.5 < tflops(model, big, "A100") <= GEMM_PLATEAU_SIMT * 19.5
    bf = gemm_op(8192, 8192, 8192, torch.bfloat16)
    assert tflops(model, bf, "A100") <= tensor_plateau(sheet.generation) * 312.0
    # the published measurements the plateaus come from (never fitted to): within 25%
    precs = {"float32": Precision(), "tf32": Precision(allow_tf32_matmul=True), "bfloat16": Precision()}
    for pub in PUBLISHED_GEMMS:
        dtype = torch.bfloat16 if pub.dtype == "bfloat16" else torch.float32
        got = tflops(model, gemm_op(pub.m, pub.k, pub.n, dtype), pub.gpu, precs[pub.dtype])
        assert abs(got / pub.tflops - 1) < 0.25, (pub, got)


def test_gemm_rate_is_monotone_in_size_and_time_grows(model):
    for gpu, dtype in (
        ("A100", torch.float32),
        ("A100", torch.bfloat16),
        ("H100", torch.bfloat16),
        ("V100", torch.float32),
    ):
        rates, times = [], []
        for n in (128, 256, 512, 1024, 2048, 4096, 8192):
            op = gemm_op(n, n, n, dtype)
            times.append(model.op_seconds(op, gpu))
            rates.append(op.flops / times[-1])
        assert all(b >= a for a, b in zip(rates, rates[1:], strict=False)), (gpu, dtype, rates)
        assert all(b > a for a, b in zip(times, times[1:], strict=False)), (gpu, dtype, times)


def test_bf16_gemm_speedup_on_a100_is_bounded_by_the_tensor_core_ratio(model):
    # a transformer-sized GEMM (8 x 1024 tokens, d = 768 -> 3072): bf16 gains most of the
    # 312 / 19.5 = 16x peak ratio, but not more than the plateaus allow (0.86 x 312 over 0.8 x 19.5)
    f32, b16 = gemm_op(8192, 768, 3072), gemm_op(8192, 768, 3072, torch.bfloat16)
    r = model.op_seconds(f32, "A100") / model.op_seconds(b16, "A100")
    assert 6 < r <= (0.86 * 312) / (0.8 * 19.5) * 1.001, r
    tf = model.op_seconds(f32, "A100", Precision(allow_tf32_matmul=True))
    assert model.op_seconds(b16, "A100") < tf < model.op_seconds(f32, "A100")  # TF32: half bf16's peak


def test_skinny_gemms_are_bound_by_their_bytes(model):
    from gpemu.costmodel.model import floor_seconds

    for gpu, dtype in (("A100", torch.float32), ("H100", torch.bfloat16)):
        gemv = gemm_op(1, 4096, 4096, dtype)  # one token through a 4096 x 4096 layer: streams 32/64 MB
        t = model.op_seconds(gemv, gpu)
        assert t >= floor_seconds(gemv.nbytes, gpu_sheet(gpu).memory_bandwidth) * 0.999
        assert gemv.flops / t < 0.1 * compute_peak(gpu_sheet(gpu), OpClass.GEMM, str(dtype)[6:], Precision())[1]


def attention_op(backward: bool, dtype=torch.float32, b=8, h=12, s=1024, d=64):
    from gpemu.costmodel import flops as FL
    from gpemu.costmodel.classify import OpFeatures

    shape = (b, h, s, d)
    f = (FL.attention_backward_flops if backward else FL.attention_forward_flops)(shape, shape, shape)
    el = torch.empty((), dtype=dtype).element_size()
    return OpFeatures(
        "_scaled_dot_product_flash_attention" + ("_backward" if backward else ""),
        OpClass.ATTENTION,
        backward,
        f,
        4.0 * b * h * s * d * el * (2 if backward else 1),
        str(dtype)[6:],
    )


def test_fused_attention_runs_below_the_gemm_rate_and_gains_from_bf16(model):
    from gpemu.costmodel.published import ATTENTION_FACTOR, tensor_plateau

    ceiling = tensor_plateau("ampere") * 312.0  # a large bf16 GEMM's rate on the A100, TFLOP/s
    for backward in (False, True):
        a32, a16 = attention_op(backward), attention_op(backward, torch.bfloat16)
        # per FLOP slower than a large GEMM by its factor (the flash kernels' published rates), and
        # at GPT-2-small's size not far below that
        factor = ATTENTION_FACTOR["bwd" if backward else "fwd"]
        assert 0.5 * factor * ceiling < tflops(model, a16, "A100") <= factor * ceiling
        assert model.op_seconds(a32, "A100") > 5 * model.op_seconds(a16, "A100")


def test_transformer_step_in_bf16_is_faster_than_fp32_by_less_than_the_peak_ratio(model):
    # one GPT-2-small block at 8 x 1024 tokens: GEMMs gain ~14x from bf16 tensor cores, the
    # bandwidth-bound rest only 2x (half the bytes), so the step gains between those
    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln = torch.nn.LayerNorm(768)
            self.fc, self.out = torch.nn.Linear(768, 3072), torch.nn.Linear(3072, 768)

        def forward(self, x):
            return x + self.out(torch.nn.functional.gelu(self.fc(self.ln(x))))

    with torch.device("meta"):
        block = Block().train()
    ops = record_step(block, (torch.empty(8, 1024, 768),))
    step = {
        p: model.ops_seconds(ops.forward, "A100", p) + model.ops_seconds(ops.backward, "A100", p)
        for p in (Precision(), Precision("bfloat16"))
    }
    r = step[Precision()] / step[Precision("bfloat16")]
    assert 2.0 < r < 16.0, r
    assert (
        model.module_seconds(block, (torch.empty(8, 1024, 768),), "H100", Precision("bfloat16")).total
        < step[Precision("bfloat16")]
    )


def test_a_measured_time_carried_to_another_gpu_has_the_transfer_error(model):
    u = model.uncertainty("H100", transferred=True)
    assert u is not None and "carried" in u.basis and 0 < u.p50 <= u.p90
    assert model.uncertainty("V100", transferred=True).basis == u.basis  # any carried time: the same figure


def test_uncertainty_of_a_kind_of_work_no_measured_model_is_dominated_by_says_so(model):
    conv, gemm = model.uncertainty("A100", "dense_conv"), model.uncertainty("A100", "gemm")
    assert "nothing checked" not in conv.basis
    assert "nothing checked" in gemm.basis and gemm.p50 > 0  # a transformer: the CNNs' figure, flagged


def test_an_added_gpu_is_priced_with_its_own_generation_and_tensor_cores() -> None:
    # A GPU added from its datasheet (gpemu gpus add) keeps its generation and tensor-core peaks:
    # without them it was priced as an Ampere card with no tensor cores (bf16 no faster than fp32).
    from gpemu.costmodel.gpus import sheet_from_spec
    from gpemu.db import GpuSpec  # (a test may use the db: the layering rule is the library's)

    h100 = gpu_sheet("H100")
    spec = GpuSpec(
        name="My Hopper",
        aliases=("MYH",),
        memory_bytes=h100.memory_bytes,
        fp32_flops=h100.fp32_flops,
        fp16_flops=h100.fp16_flops,
        memory_bandwidth=h100.memory_bandwidth,
        host_link_bandwidth_pinned=h100.host_link_bandwidth_pinned,
        host_link_bandwidth_pageable=h100.host_link_bandwidth_pageable,
        sm_count=h100.sm_count,
        generation="hopper",
        compute_capability=(9, 0),
        tf32_tensor_flops=h100.tf32_tensor_flops,
        fp16_tensor_flops=h100.fp16_tensor_flops,
        bf16_tensor_flops=h100.bf16_tensor_flops,
    )
    sheet = sheet_from_spec(spec)
    assert (sheet.generation, sheet.compute_capability) == ("hopper", (9, 0))
    assert sheet.bf16_tensor_flops == h100.bf16_tensor_flops and sheet.tf32_tensor_flops == h100.tf32_tensor_flops
    model = default_model()
    layer, x = torch.nn.Linear(4096, 4096), (torch.empty(2048, 4096),)
    bf16 = model.module_seconds(layer, x, sheet, Precision("bfloat16"))
    fp32 = model.module_seconds(layer, x, sheet, Precision())
    assert bf16.total < fp32.total / 4  # tensor cores, as for the shipped H100
    # Unknown fields are still inferred: no generation given -> ampere, no tensor figures -> none.
    bare = sheet_from_spec(
        GpuSpec(**{**spec.__dict__, "generation": None, "bf16_tensor_flops": None, "compute_capability": None})
    )
    assert bare.generation == "ampere" and bare.bf16_tensor_flops == 0.0 and bare.compute_capability == (0, 0)


def test_without_tensor_core_curves_a_convolution_keeps_its_standing_against_a_gemm(model):
    """Leave-one-GPU-out for the A100 removes the only tensor-core curves: its TF32 convolutions
    are then carried over from the donor's SIMT curves by the GEMM rule (same fraction of a large
    GEMM's rate, capped at the tensor-core GEMM plateau), not priced as SIMT work."""
    from gpemu.costmodel.model import tensor_from_simt
    from gpemu.costmodel.published import tensor_plateau

    sheet = gpu_sheet("A100")
    blind = model.without("ampere")
    conv = conv_ops(256, 256, 1, n=64, hw=28)[0]
    tf32, fp32 = Precision(), Precision(allow_tf32_cudnn=False)
    simt = blind.op_seconds(conv, sheet, fp32)
    carried = blind.op_seconds(conv, sheet, tf32)
    # faster than SIMT work, but by less than the 8x of the peaks (156 / 19.5 TFLOP/s)
    assert simt / 8 < carried < simt / 1.5, (simt, carried)
    # never faster than the A100's own calibrated tensor-core curve prices a dense convolution
    # by more than the plateaus allow
    assert carried > 0.5 * model.op_seconds(conv, sheet, tf32)
    pr = blind.priced(sheet, conv.op_class, conv.dtype, tf32, curve_key(conv))
    assert pr.curve.path == "tensor" and pr.curve.e <= tensor_plateau("ampere") and pr.floor
    # a GEMM curve carried over gets the tensor-core GEMM plateau itself
    gemm = blind.resolve(sheet, "gemm.fwd", "simt").curve
    assert tensor_from_simt(gemm, sheet, 156e12).e == pytest.approx(tensor_plateau("ampere"))
    # a weaker kernel stays weaker by the same factor
    half = C.Curve(e=gemm.e / 2, x0=gemm.x0, p=gemm.p, h=gemm.h)
    assert tensor_from_simt(half, sheet, 156e12).e == pytest.approx(tensor_plateau("ampere") / 2)


def test_parameter_bookkeeping_ops_are_those_the_measured_loop_records():
    """The per-parameter kernels that come off a shipped backward (scaled from one recorded
    parameter) are the ops the measured loop records for those parameters: zero, accumulate, then
    the SGD step's add / mul_ / add_ / add_, each moving bytes in proportion to the parameter."""
    from gpemu.costmodel.measured_loop import parameter_bookkeeping_ops, record_measured_step

    with torch.device("meta"):
        net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Flatten(), torch.nn.Linear(8 * 30 * 30, 10))
    shapes = [tuple(p.shape) for p in net.parameters()]
    ops = parameter_bookkeeping_ops(shapes)
    _, recorded = record_measured_step(net, torch.empty(2, 3, 32, 32, device="meta"))
    names = [o.name for o in recorded]
    # the loop's backward holds exactly these kernels besides the loss and the model's backward
    for o in ops:
        assert o in recorded, o
    assert names.count("zero") == len(shapes) and names.count("mul") >= len(shapes)
    sizes = [math.prod(s) for s in shapes]
    # zero_ writes its gradient without reading it (1x), accumulating reads two and writes one (3x)
    assert [o.nbytes for o in ops[: 2 * len(shapes)]] == [b * n * 4 for n in sizes for b in (1, 3)]


def test_measured_loss_ops_are_the_loss_the_measured_loop_records():
    """The loss that comes off a shipped backward (the program's own loss is charged on its own) is
    the cross entropy the measured loop records over the model's 1000 ImageNet logits: its forward
    ops open the loop's backward column, and its backward ops are in it too."""
    from gpemu.costmodel.measured_loop import MEASURED_CLASSES, measured_loss_ops, record_measured_step

    with torch.device("meta"):
        net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 4 * 4, MEASURED_CLASSES))
    _, recorded = record_measured_step(net, torch.empty(8, 3, 4, 4, device="meta"))
    loss = measured_loss_ops(8)
    assert loss and all(o.backward for o in loss)
    for o in loss:
        assert o in recorded, o
    # the loss's forward comes first in the column, before any gradient is zeroed
    assert recorded[0] == loss[0]
    # it grows with the batch (one row of 1000 logits per sample)
    assert sum(o.nbytes for o in measured_loss_ops(64)) > 4 * sum(o.nbytes for o in loss)


def test_a_kepler_gpu_priced_with_another_generation_s_curves_delivers_its_share():
    """Curves carried to a GPU of another generation price it against its own datasheet peaks,
    scaled by what each SM generation delivers of them (gpemu.costmodel.published.DELIVERED_SHARE):
    a Kepler lane delivers 1/1.35 of a Maxwell one, so the K80 priced with Maxwell's curves is
    1.35x slower than the same datasheet would be as a Maxwell GPU, for arithmetic and for
    memory-bound work alike; with its own curves, or between later generations, nothing changes."""
    from dataclasses import replace

    from gpemu.costmodel.classify import OpFeatures
    from gpemu.costmodel.published import carried_share

    conv = OpFeatures("convolution", OpClass.CONV, False, 2e10, 5e7, kernel=3, stride=1, reduction=576)
    relu = OpFeatures("relu", OpClass.ELEMENTWISE, False, 1e7, 8e7)
    k80 = gpu_sheet("K80")
    blind = default_model().without("kepler")
    as_maxwell = replace(k80, generation="maxwell", name="K80 as a Maxwell GPU", aliases=())
    for op in (conv, relu):
        assert blind.op_seconds(op, k80) == pytest.approx(1.35 * blind.op_seconds(op, as_maxwell), rel=1e-9)
        # its own generation's curves: its datasheet as it is
        assert default_model().priced(k80, op.op_class, "float32", Precision(), curve_key(op)).generation == "kepler"
    own = default_model().priced(k80, OpClass.CONV, "float32", Precision(), curve_key(conv))
    assert own.peak == k80.fp32_flops and own.bandwidth == k80.memory_bandwidth
    # later generations deliver alike: the V100 priced with Turing's curves keeps its datasheet
    v100 = gpu_sheet("V100")
    carried = default_model().without("volta").priced(v100, OpClass.CONV, "float32", Precision(), curve_key(conv))
    assert carried.generation == "turing" and carried.peak == v100.fp32_flops
    assert carried_share("kepler", "calibrated:Tesla K80") == 1.0
    assert carried_share("maxwell", "kepler") == pytest.approx(1.35)


def test_compute_capability_of_a_gpu_that_does_not_say_its_own():
    """Its own, else the table's GPU of that name, else its generation's usual one, else that of
    the generation an unknown GPU is priced as (the A100's 8.0)."""
    import dataclasses

    from gpemu.costmodel.gpus import DEFAULT_GENERATION, compute_capability, generation_capability
    from gpemu.db.specs import shipped_gpus

    t4 = next(s for s in shipped_gpus() if s.short_name == "T4")
    unsaid = dataclasses.replace(t4, compute_capability=None)
    assert compute_capability(t4) == compute_capability(unsaid) == (7, 5)
    assert compute_capability(dataclasses.replace(t4, compute_capability=(7, 2))) == (7, 2)
    other = dataclasses.replace(unsaid, name="Lab Card", aliases=("LAB",))
    assert compute_capability(other) == (7, 5)  # turing's usual
    assert compute_capability(dataclasses.replace(other, generation="ada")) == (8, 9)
    assert compute_capability(dataclasses.replace(other, generation=None)) == (8, 0)
    assert generation_capability(DEFAULT_GENERATION) == gpu_sheet("A100").compute_capability == (8, 0)
    assert generation_capability("rubin") is None

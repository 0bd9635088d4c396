"""gpemu.fusion's grouping alone: which ops one Inductor kernel holds, what it reads and writes at
its boundary, and the order extern kernels launch in around it."""

from __future__ import annotations

from gpemu.costmodel import OpClass
from gpemu.fusion import Kernel, KernelGroups, OpRecord


def _op(name, cls, reads, writes, size=100, out_size=100):
    return OpRecord(name, cls, False, 0.0, "float32", 0, reads, writes, size, out_size)


def test_a_pointwise_chain_is_one_kernel_of_its_boundary_bytes():
    live = {3}
    groups = KernelGroups(lambda b: b in live)
    E = OpClass.ELEMENTWISE
    assert groups.add(_op("mul", E, {1: 400}, {2: 400})) == []
    assert groups.add(_op("add", E, {2: 400, 9: 400}, {3: 400})) == []
    (k,) = groups.close()
    # read 1 and 9 from outside; 2 was freed inside (never written), 3 is alive
    assert k == Kernel(k.ops, 800, 400, True) and [op.name for op in k.ops] == ["mul", "add"]


def test_extern_kernels_wait_for_the_group_they_read_and_do_not_split_it():
    groups = KernelGroups(lambda b: True)
    E, G = OpClass.ELEMENTWISE, OpClass.GEMM
    groups.add(_op("gelu_backward", E, {1: 400, 2: 400}, {3: 400}))
    assert groups.add(_op("mm", G, {3: 400, 7: 400}, {8: 400})) == []  # waits for the group
    assert [k.ops[0].name for k in groups.add(_op("mm", G, {5: 400}, {6: 400}))] == ["mm"]  # independent
    groups.add(_op("sum", OpClass.REDUCTION, {3: 400}, {4: 4}))  # the bias gradient joins
    closed = groups.add(_op("relu", E, {8: 400}, {10: 400}))  # needs the waiting mm's result
    assert [[op.name for op in k.ops] for k in closed] == [["gelu_backward", "sum"], ["mm"]]


def test_ops_of_another_iteration_size_start_a_new_kernel():
    groups = KernelGroups(lambda b: True)
    E = OpClass.ELEMENTWISE
    groups.add(_op("mul", E, {1: 400}, {2: 400}))
    closed = groups.add(_op("add", E, {2: 400}, {3: 800}, size=200, out_size=200))  # a larger loop
    assert [[op.name for op in k.ops] for k in closed] == [["mul"]]

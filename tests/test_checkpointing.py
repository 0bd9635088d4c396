"""Activation checkpointing (torch.utils.checkpoint), both forms: the recompute is charged and
the memory is that of a GPU run with checkpointing, for unknown and for measured models, on the
recorded call and on every replay."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import gpemu
from gpemu.clock import VirtualClock


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(256, 1024), nn.Linear(1024, 256)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class Net(nn.Module):
    def __init__(self, reentrant: bool | None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.reentrant = reentrant  # None: no checkpointing

    def forward(self, x):
        for block in self.blocks:
            x = block(x) if self.reentrant is None else checkpoint(block, x, use_reentrant=self.reentrant)
        return x


def _steps(reentrant: bool | None, model_name: str | None, hooks: bool = False) -> list[tuple[float, int]]:
    """(emulated seconds, peak bytes above the start) of three training steps."""
    rt = gpemu.patch(gpu="A100", summary=False, clock=VirtualClock(), model=model_name)
    try:
        net = Net(reentrant).cuda()
        if hooks:
            net.register_forward_hook(lambda *a: None)  # the outer model runs op by op every time
        x = torch.zeros(32, 64, 256, device="cuda", requires_grad=True)
        out = []
        for _ in range(3):
            torch.cuda.synchronize()
            t0, base = rt.engine.now(), torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            net(x).sum().backward()
            torch.cuda.synchronize()
            out.append((rt.engine.now() - t0, torch.cuda.max_memory_allocated() - base))
            # (as a training loop does: a backward into existing gradients also charges their adds)
            net.zero_grad()
            x.grad = None
        return out
    finally:
        gpemu.unpatch()


@pytest.mark.parametrize("model_name", [None, "resnet50"])
def test_recompute_is_charged_and_memory_drops(model_name) -> None:
    plain = _steps(None, model_name)
    for reentrant in (True, False):
        ck = _steps(reentrant, model_name)
        # every step the same (the replays exactly; the recorded one, run op by op, within 2%: it
        # charges its pass's issue gaps as a replay does, tests/test_replay_pricing.py)
        assert ck[1][0] == pytest.approx(ck[2][0]) and ck[1][0] == pytest.approx(ck[0][0], rel=0.02)
        extra = ck[2][0] - plain[2][0]
        assert extra > 0, (reentrant, model_name)  # the recomputed forward is charged
        if model_name is None:  # priced by ops: at most one more forward (of the blocks)
            assert extra < 0.5 * plain[2][0]
        assert ck[2][1] < plain[2][1]  # activations are not kept across the forward
    # the reentrant form recomputes every block whole; the other stops once it has what it needs
    assert _steps(True, model_name)[2][0] > _steps(False, model_name)[2][0]


def test_checkpointed_blocks_are_not_replayed_during_backward() -> None:
    """An outer model that runs op by op (hooks) recomputes its blocks in every backward: they
    run op by op there (the non-reentrant form matches the tensors they save), every step alike."""
    for reentrant in (True, False):
        steps = _steps(reentrant, None, hooks=True)
        assert steps[1][0] == pytest.approx(steps[2][0]) and steps[1][1] == steps[2][1]


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Linear(64, 256, bias=False), nn.Linear(256, 64, bias=False)

    def forward(self, x):
        return self.w2(torch.relu(self.w1(x)))


class _TpBlock(nn.Module):
    """A transformer-like block: its norm has no hooks (a unit the replay fast path may take), its
    MLP is tensor-parallel (DTensor's hooks: the block runs op by op)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.mlp = nn.RMSNorm(64), _Mlp()

    def forward(self, x):
        return x + self.mlp(self.norm(x))


def _tp_steps(checkpointed: bool) -> list[float]:
    """Emulated seconds of three steps of two TP blocks, each under non-reentrant checkpointing
    without early stop (torchtitan's default), on a folded world of two ranks."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.utils.checkpoint import set_checkpoint_early_stop

    rt = gpemu.patch(gpu="H100", world_size=2, summary=False, clock=VirtualClock())
    dist.init_process_group("nccl")
    try:
        blocks = nn.ModuleList([_TpBlock() for _ in range(2)]).cuda()
        mesh = init_device_mesh("cuda", (2,))
        for block in blocks:
            parallelize_module(block.mlp, mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
        x = torch.ones(4, 16, 64, device="cuda", requires_grad=True)
        out = []
        with set_checkpoint_early_stop(False):
            for _ in range(3):
                torch.cuda.synchronize()
                t0 = rt.engine.now()
                y = x
                for block in blocks:
                    y = checkpoint(block, y, use_reentrant=False) if checkpointed else block(y)
                y.sum().backward()
                torch.cuda.synchronize()
                out.append(rt.engine.now() - t0)
        return out
    finally:
        dist.destroy_process_group()
        gpemu.unpatch()


def test_a_checkpointed_tp_block_recomputes_what_its_forward_saved() -> None:
    """A unit replayed inside a checkpointed forward saved no tensors, and its recompute (op by
    op, in the backward) saved more: torch's CheckpointError from the second step on. Under
    saved-tensor hooks calls run op by op, as a GPU saves: every step alike, the recompute charged."""
    ck = _tp_steps(True)
    assert ck[1] == pytest.approx(ck[2])  # (the first step also pays DTensor's first dispatches)
    assert ck[2] > _tp_steps(False)[2]  # the recomputed forward is charged

"""An emulated tensor's storage as CUDA's: ``share_memory()`` a no-op, ``resize_`` freeing and
growing emulated memory (FSDP2's unsharded parameters: per-rank memory follows the sharding)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

import gpemu
from gpemu.clock import VirtualClock
from gpemu.ports import free_port


@pytest.fixture
def rt():
    r = gpemu.patch(gpu="A100", summary=False, clock=VirtualClock())
    yield r
    gpemu.unpatch()


def test_share_memory_of_a_cuda_model_is_a_no_op(rt) -> None:
    model = nn.Linear(64, 64).cuda()
    before = torch.cuda.memory_allocated()
    assert model.share_memory() is model
    storage = model.weight.untyped_storage()
    assert storage.device == torch.device("cuda:0") and storage.is_cuda
    assert model.weight.is_shared() and torch.cuda.memory_allocated() == before
    assert storage.data_ptr() == model.weight.data_ptr() != 0


def test_storage_resize_frees_and_grows_emulated_memory(rt) -> None:
    t = torch.empty(1024, 1024, device="cuda")
    view = t.view(-1)[:10]
    mb = 4 * 2**20
    base = torch.cuda.memory_allocated()
    storage = t.untyped_storage()
    storage.resize_(0)
    assert torch.cuda.memory_allocated() == base - mb and storage.size() == 0
    torch.cuda.reset_peak_memory_stats()
    storage.resize_(mb)
    assert torch.cuda.memory_allocated() == base and storage.size() == mb
    assert view.untyped_storage().data_ptr() == storage.data_ptr()  # views share the allocation
    too_big = 1 << 50
    with pytest.raises(torch.cuda.OutOfMemoryError):
        storage.resize_(too_big)
    assert torch.cuda.memory_allocated() == base  # nothing changed
    del t, view, storage
    assert torch.cuda.memory_allocated() == base - mb


def _fsdp_rank(rank: int, port: int, out_dir: str, data_dir: str) -> None:
    import torch.distributed as dist

    os.environ["GPEMU_DATA_DIR"] = data_dir
    gpemu.patch(gpu="A100", num_gpus=2, summary=False)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    from torch.distributed.fsdp import fully_shard

    with torch.device("cuda"):
        model = nn.Sequential(*[nn.Linear(1024, 1024, bias=False) for _ in range(8)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    model(torch.zeros(8, 1024, device="cuda")).sum().backward()
    result = {
        "after_backward": torch.cuda.memory_allocated(),
        "grads": [p.grad is not None for p in model.parameters()],
    }
    # The step's DTensor ops propagate their sharding on fake tensors: no memory for those.
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    torch.cuda.reset_peak_memory_stats()
    opt.step()
    result.update(after_step=torch.cuda.memory_allocated(), step_peak=torch.cuda.max_memory_allocated())
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


@pytest.mark.torchrun
def test_fsdp2_per_rank_memory_follows_its_sharding(tmp_path: Path, _gpemu_data_dir: Path) -> None:
    """8 Linear(1024, 1024) on 2 ranks: after forward and backward each rank holds its half of
    the parameters and of the gradients (FSDP2 freed the unsharded ones with resize_(0)); a fused
    AdamW step adds its halves of the two states and nothing more (its ops' sharding propagation
    makes fake tensors)."""
    import torch.multiprocessing as mp

    mp.spawn(_fsdp_rank, args=(free_port(), str(tmp_path), str(_gpemu_data_dir)), nprocs=2, join=True)
    half = 8 * 1024 * 1024 * 4 // 2  # each rank's share of the parameters, in bytes
    for rank in range(2):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert all(r["grads"])
        assert 2 * half <= r["after_backward"] < 2 * half + 2**20, r  # parameters + gradients (+ a little)
        assert 4 * half <= r["after_step"] <= r["step_peak"] < 4 * half + 2**20, r  # + AdamW's two states

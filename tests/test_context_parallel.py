"""Context parallelism (``torch.distributed.tensor.experimental.context_parallel``) on a folded
world of two ranks (torch's fake process group, in process): its in-place buffer sharding and
ring attention with each fused kernel under causal load balancing."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

import gpemu
from gpemu.clock import VirtualClock

WORLD = 2


@pytest.fixture
def mesh() -> Iterator[object]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    gpemu.patch(gpu="H100", world_size=WORLD, summary=False, clock=VirtualClock())
    dist.init_process_group("nccl")
    try:
        yield init_device_mesh("cuda", (WORLD,))
    finally:
        dist.destroy_process_group()
        gpemu.unpatch()


def test_buffers_are_sharded_in_place_and_restored(mesh: object) -> None:
    """context_parallel resizes each buffer in place to its rank's shard (``resize_``, then
    ``copy_``) and back on exit; the emulator had refused an in-place change of shape."""
    from torch.distributed.tensor.experimental import context_parallel

    tokens = torch.arange(2 * 64, device="cuda").view(2, 64)
    before, address = torch.cuda.memory_allocated(), tokens.data_ptr()
    with context_parallel(mesh, buffers=[tokens], buffer_seq_dims=[1]):
        # causal load balancing (head-tail): rank 0 holds the first and the last of four chunks
        assert tokens.shape == (2, 32) and tokens.device == torch.device("cuda", 0)
        whole = torch.arange(2 * 64).view(2, 64)
        assert tokens.tolist() == torch.cat([whole[:, :16], whole[:, 48:]], dim=1).tolist()
        assert tokens.data_ptr() == address  # shrunk in place: the storage is kept
    assert tokens.shape == (2, 64) and tokens.tolist() == whole.tolist()
    assert tokens.data_ptr() == address and torch.cuda.memory_allocated() == before


def test_resize_grows_the_storage_as_cuda_does() -> None:
    gpemu.patch(gpu="H100", summary=False, clock=VirtualClock())
    try:
        t = torch.ones(4, 256, device="cuda")
        base = torch.cuda.memory_allocated()
        t.resize_(2, 256)
        assert t.shape == (2, 256) and t.is_contiguous() and torch.cuda.memory_allocated() == base
        assert t.tolist() == [[1.0] * 256] * 2  # the kept storage's first elements
        t.resize_(16, 256)  # more than the storage holds: a new, larger allocation
        assert t.shape == (16, 256) and torch.cuda.memory_allocated() == base + 3 * 4 * 256 * 4
        with pytest.raises(RuntimeError, match="cannot resize variables that require grad"):
            torch.ones(4, device="cuda", requires_grad=True).resize_(2)
    finally:
        gpemu.unpatch()


@pytest.mark.parametrize("backend", ["EFFICIENT_ATTENTION", "FLASH_ATTENTION", "CUDNN_ATTENTION"])
def test_ring_attention_under_causal_load_balancing(mesh: object, backend: str) -> None:
    """Each fused kernel through CP's ring, forward and backward: the partial steps attend with
    half of the local queries, and merge their log-sum-exp into the other half's."""
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    x = torch.randn(2, 4, 256, 16, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(16, 16, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with context_parallel(mesh, buffers=[x], buffer_seq_dims=[2]):
        q = x @ w
        with sdpa_kernel(getattr(SDPBackend, backend)):
            out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        out.sum().backward()
    assert out.shape == (2, 4, 128, 16) and w.grad is not None and w.grad.shape == (16, 16)


def test_memory_efficient_ring_needs_halves_of_whole_lse_tiles(mesh: object) -> None:
    """CUDA's memory-efficient kernel pads its log-sum-exp to a multiple of 32 query rows, so CP's
    partial step merges a padded block into half of an unpadded one unless a rank's half of the
    sequence is a multiple of 32: torch fails there on a GPU, and so here (48-token halves)."""
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    x = torch.randn(2, 4, 192, 16, device="cuda", dtype=torch.bfloat16)
    with context_parallel(mesh, buffers=[x], buffer_seq_dims=[2]):
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION), pytest.raises(RuntimeError, match="broadcast"):
            F.scaled_dot_product_attention(x, x, x, is_causal=True)

"""examples/serving_paged.py under gpemu: a paged KV cache (one preallocated pool of fixed-size
blocks, a block table per request) takes the GPU memory its blocks take, runs out of memory as on
a GPU, and its continuous-batching loop gives the serving metrics."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

import gpemu
from gpemu.clock import VirtualClock
from gpemu.observe import compute_summary, records_from_runtime

LAYERS, HEADS, BLOCK, HEAD_DIM = 2, 2, 16, 16


def _example() -> ModuleType:
    path = Path(__file__).resolve().parent.parent / "examples" / "serving_paged.py"
    spec = importlib.util.spec_from_file_location("serving_paged", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # (its dataclasses look their module up)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def gpu():
    rt = gpemu.patch(gpu="A100", summary=False, clock=VirtualClock())
    yield rt
    gpemu.unpatch()


def _pool(ex: ModuleType, blocks: int) -> object:
    return ex.PagedKV(LAYERS, blocks, HEADS, BLOCK, HEAD_DIM, torch.float16)


def test_a_block_pool_takes_its_blocks_memory_and_runs_out_as_on_a_gpu(gpu) -> None:
    ex = _example()
    per_block = ex.PagedKV.block_bytes(LAYERS, HEADS, BLOCK, HEAD_DIM, torch.float16)
    assert per_block == 2 * LAYERS * HEADS * BLOCK * HEAD_DIM * 2
    before = torch.cuda.memory_allocated()
    pool = _pool(ex, 100)
    assert torch.cuda.memory_allocated() - before == 100 * per_block
    del pool
    # vLLM's sizing fills what is left of the GPU; one block more per layer does not fit
    blocks = ex.pool_blocks(None, 1.0, per_block)
    free, _ = torch.cuda.mem_get_info()
    assert blocks == free // per_block
    with pytest.raises(torch.cuda.OutOfMemoryError):
        _pool(ex, blocks + 2 * LAYERS * 1024)
    assert torch.cuda.memory_allocated() == before  # (the pool's first layers went back)


@pytest.mark.slow
@pytest.mark.parametrize("blocks", [400, 8])  # 8 blocks: too few for all at once, preempted
def test_continuous_batching_over_a_paged_cache_serves_every_request(gpu, blocks: int) -> None:
    ex = _example()
    torch.manual_seed(0)
    model = ex.Decoder(vocab=64, dim=HEADS * HEAD_DIM, layers=LAYERS, heads=HEADS, hidden=64).half().cuda().eval()
    pool = _pool(ex, blocks)
    requests = ex.make_requests(6, rate=50.0, seed=1)
    for r in requests:
        r.prompt, r.output = r.prompt // 8, r.output // 4  # (a short run)
    server = ex.Server(model, pool, max_batch=8)
    with torch.no_grad():
        ex.serve(server, requests)
    assert all(r.done is not None and r.made == r.output for r in requests)
    assert sorted(pool.free) == list(range(blocks))  # every block back in the pool
    assert 0 < server.peak_blocks <= blocks
    assert (server.preemptions > 0) == (blocks == 8)
    s = compute_summary(records_from_runtime(gpu))["serving"]
    assert s["prefills"] == len(requests) + server.preemptions
    assert s["decode_steps"] > 0 and 0 < s["tpot"]["p50_s"] <= s["tpot"]["p99_s"]
    # the KV cache gpemu saw held: the whole pool, from the first call
    assert s["kv_cache_peak_bytes"] == blocks * ex.PagedKV.block_bytes(LAYERS, HEADS, BLOCK, HEAD_DIM, torch.float16)

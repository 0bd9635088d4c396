"""FlexAttention on emulated tensors: the HOP runs forward and backward as one fused kernel, priced
with its block mask's sparsity; block masks made on the emulated GPU hold their real counts."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import flex_attention as api

import gpemu
from gpemu.clock import VirtualClock
from gpemu.device import host_shadow
from gpemu.flex_attention import block_density

# torch's own advice to compile flex_attention (the emulated kernel is the fused one either way)
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def sliding_window(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < 256)


@pytest.fixture
def rt():
    rt = gpemu.patch(gpu="H100", summary=False, clock=VirtualClock())
    yield rt
    gpemu.unpatch()


def _qkv(batch=2, heads=16, kv_heads=4, length=2048, dim=128, grad=True):
    def make(h):
        return torch.empty(batch, h, length, dim, device="cuda", dtype=torch.bfloat16, requires_grad=grad)

    return make(heads), make(kv_heads), make(kv_heads)


def _kernels(rt, since: int) -> dict[str, float]:
    return {s.name: s.end - s.start for s in rt.recorder.spans[since:] if s.name.startswith("flex_attention")}


def test_forward_and_backward_run_as_one_fused_kernel(rt):
    q, k, v = _qkv()
    first = len(rt.recorder.spans)
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = api.flex_attention(q, k, v, enable_gqa=True)
    peak = torch.cuda.max_memory_allocated() - base
    assert type(out).__name__ == "EmuTensor" and out.shape == q.shape and out.dtype == q.dtype
    assert out.stride() == q.stride()  # the kernel writes in the query's layout
    # no scores in memory: the output and the kernel's two fp32 statistics (and the default block mask)
    assert peak <= q.numel() * 2 + 2 * (2 * 16 * 2048 * 4) + 4 * 512
    out.sum().backward()
    assert (q.grad.shape, k.grad.shape, v.grad.shape) == (q.shape, k.shape, v.shape)
    kernels = _kernels(rt, first)
    assert set(kernels) == {"flex_attention", "flex_attention_backward"}
    assert kernels["flex_attention_backward"] > 1.5 * kernels["flex_attention"] > 0


def test_block_masks_made_on_the_gpu_hold_their_real_counts(rt):
    gpu_mask = api.create_block_mask(sliding_window, None, None, 4096, 4096, device="cuda")
    host_mask = api.create_block_mask(sliding_window, None, None, 4096, 4096, device="cpu")
    assert gpu_mask.kv_num_blocks.is_cuda
    assert gpu_mask.sparsity() == pytest.approx(host_mask.sparsity())
    assert torch.equal(gpu_mask.kv_num_blocks.cpu(), host_mask.kv_num_blocks)
    assert block_density(gpu_mask.as_tuple()) == pytest.approx(1 - host_mask.sparsity() / 100)


def test_a_block_mask_computed_in_pieces_matches_the_whole(rt, monkeypatch):
    import gpemu.flex_attention as flex

    monkeypatch.setattr(flex, "HOST_MASK_ELEMENTS", 1 << 18)  # 4096 x 4096 in pieces of 64 rows
    monkeypatch.setattr(flex, "HOST_MASK_BUDGET", 1 << 30)  # (all of it counted)
    gpu_mask = api.create_block_mask(causal, 2, None, 4096, 4096, device="cuda")
    host_mask = api.create_block_mask(causal, 2, None, 4096, 4096, device="cpu")
    for name in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"):
        assert torch.equal(getattr(gpu_mask, name).cpu(), getattr(host_mask, name)), name


def test_the_kernel_is_priced_with_its_block_masks_sparsity(rt):
    q, k, v = _qkv(length=4096)
    times = {}
    for name, mask_mod in (("dense", None), ("causal", causal), ("window", sliding_window)):
        mask = None if mask_mod is None else api.create_block_mask(mask_mod, None, None, 4096, 4096, device="cuda")
        first = len(rt.recorder.spans)
        api.flex_attention(q, k, v, block_mask=mask, enable_gqa=True).sum().backward()
        times[name] = _kernels(rt, first)
    for kernel in ("flex_attention", "flex_attention_backward"):
        causal_share = times["causal"][kernel] / times["dense"][kernel]
        assert 0.45 < causal_share < 0.65  # a causal mask computes 528 of 1024 blocks
        assert times["window"][kernel] < 0.2 * times["dense"][kernel]  # 95 of 1024 blocks


def test_a_mask_reading_known_gpu_tensors_holds_its_real_counts(rt):
    # packed documents as torchtitan masks them: ids computed on the GPU from positions the data
    # loader copied there, read by the mask_mod (as the kernel reads them on a GPU)
    lengths = (300, 700, 1048)
    positions = torch.cat([torch.arange(n) for n in lengths])
    on_gpu = torch.cumsum((positions.cuda() == 0).int(), dim=0) - 1
    on_host = torch.cumsum((positions == 0).int(), dim=0) - 1

    def packed(ids):
        return api.and_masks(causal, lambda b, h, q_idx, kv_idx: ids[q_idx] == ids[kv_idx])

    gpu_mask = api.create_block_mask(packed(on_gpu), None, None, 2048, 2048, device="cuda")
    host_mask = api.create_block_mask(packed(on_host), None, None, 2048, 2048, device="cpu")
    assert torch.equal(gpu_mask.kv_num_blocks.cpu(), host_mask.kv_num_blocks)
    density = block_density(gpu_mask.as_tuple())
    assert density == pytest.approx(1 - host_mask.sparsity() / 100) and density < 0.3  # causal alone: 0.53


def test_a_mask_of_placeholder_values_is_priced_dense_and_said(rt, capsys):
    documents = torch.randint(0, 4, (4096,), dtype=torch.int32, device="cuda")  # values the host does not know

    def same_document(b, h, q_idx, kv_idx):
        return documents[q_idx] == documents[kv_idx]

    mask = api.create_block_mask(same_document, None, None, 4096, 4096, device="cuda")
    assert block_density(mask.as_tuple()) is None
    q, k, v = _qkv(length=4096, grad=False)
    api.flex_attention(q, k, v, block_mask=mask, enable_gqa=True)
    assert "priced as if every block were computed" in capsys.readouterr().err


def test_unpatch_removes_the_rules():
    from torch._C import DispatchKey
    from torch._higher_order_ops.flex_attention import flex_attention, flex_attention_backward

    autograd = flex_attention.py_kernels[DispatchKey.Autograd]
    create = api.create_block_mask
    with gpemu.emulate(gpu="A100", summary=False, clock=VirtualClock()):
        from gpemu.device import EmuTensor

        assert EmuTensor in flex_attention.python_key_table and EmuTensor in flex_attention_backward.python_key_table
    assert EmuTensor not in flex_attention.python_key_table
    assert EmuTensor not in flex_attention_backward.python_key_table
    assert flex_attention.py_kernels[DispatchKey.Autograd] is autograd and api.create_block_mask is create


def test_a_large_mask_is_priced_by_a_sample_of_its_rows(rt):
    # torchtitan packs a batch into one 16k-token sequence of documents and makes its mask every
    # step: counted whole on the host, seconds a step; a sample of rows prices the kernels
    import gpemu.flex_attention as flex

    length, document = 16384, 512
    assert length * length > flex.HOST_MASK_BUDGET
    ids = torch.arange(length, device="cuda") // document  # known values, computed on the GPU

    def packed(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (ids[q_idx] == ids[kv_idx])

    def causal_only(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    for mask_mod, exact in ((packed, 32 * 10 / 128**2), (causal_only, 128 * 129 / 2 / 128**2)):
        mask = api.create_block_mask(mask_mod, None, None, length, length, device="cuda")
        assert host_shadow(mask.kv_num_blocks) is None  # not counted whole
        assert block_density(mask.as_tuple()) == pytest.approx(exact, rel=0.3), mask_mod.__name__

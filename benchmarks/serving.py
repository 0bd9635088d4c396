"""Serving on emulated GPUs (issue 33): TTFT and TPOT of transformers' ``generate()`` for GPT-2
small and a Llama-3-8B-shaped model in bf16 (random weights from a config: no download), on A100
and H100, batch 1/8/32, 128- and 2048-token prompts; the emulator's wall time per decode step;
each decode step's GPU time against the bandwidth bound implied by the bytes it must read.

    python benchmarks/serving.py                      # the whole table (a few minutes)
    python benchmarks/serving.py --models gpt2 --gpus A100 --batches 1 --prompts 128

Columns:

* **TTFT**: the prefill call, issue to the end of its GPU work; **TPOT p50/p99**: the decode
  steps, end to end (gpemu.serving), on the virtual clock (no host time but the modelled one:
  an eager step that is host-bound, as HF's is at batch 1, shows the host issue time the cost
  model prices for its kernels);
* **step GPU**: the GPU's busy time in one decode step at the prompt's length: its kernels' spans
  summed (op by op, replay off, on a virtual clock; not the step's wall time, which is the host's
  issue time when HF's eager loop is host-bound, nor the calibration hosts' issue gaps that an
  op-by-op pass is charged without a modelled host: the bound is about the bytes the GPU reads,
  so it compares the time the GPU spends reading them); **bound**: the bytes it must read
  (the weights but the input embedding's table, the KV cache) over the GPU's memory
  bandwidth; the ratio of the two (**static**: the same step with HF's ``StaticCache``, which
  writes the new keys and values in place instead of copying the cache); **GEMM**: the step's
  matrix products against the time to read the weights they multiply at that bandwidth (how
  close the memory-bound part is priced);
* **wall/step**: this machine's wall time per replayed decode step (from one model call's start
  to the next's), HF's own loop included (its ops on known values run on this machine's CPU, as the
  emulator computes them); **in model**: of it, the wall time inside the model's outermost call
  (gpemu's patched ``Module.__call__``: the replay, which runs none of the model's code: the
  emulator's host time per replayed step, the target being <= 1 ms); medians over the replayed
  steps; **kBC/step**: the same call's Python bytecodes in thousands (traced as
  benchmarks/opcodes.py does: a count the machine's load does not move), the median step.

``--host PRESET`` runs everything behind a modelled host (gpemu's ``host`` setting: ``this``, a
speed such as ``0.7x``, ``h100-xeon``); GPU prices are then kernel time only.

The paged-KV rows run examples/serving_paged.py's continuous-batching server (a pool of 16-token
blocks sized by vLLM's rule, 90% of the GPU's memory): **blocks** in the pool, bytes per block
(**/block**, all layers' keys and values), blocks in use at the **peak**, preemptions (**pre**),
TTFT and TPOT from each request's arrival (queueing included), gpemu's per-call metrics
(**call TTFT/TPOT**) and the KV cache it saw held (the pool); the last row asks for a pool that
does not fit.

GPT-2's position table is extended to 2,112 positions for the 2048-token prompts (GPT-2 small
has 1,024). A case that does not fit the GPU's memory shows the emulated OOM.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, NamedTuple

import torch
from _common import machine
from opcodes import BytecodeCounter

import gpemu
from gpemu.clock import VirtualClock
from gpemu.costmodel import gpu_sheet
from gpemu.serving import serving_summary

NEW_TOKENS = 40


class Case(NamedTuple):
    """One row of the table."""

    model: str
    gpu: str
    batch: int
    prompt: int


def build(name: str) -> Any:
    """A model with random weights made directly on the emulated GPU, in bf16."""
    import transformers

    transformers.logging.set_verbosity_error()
    if name == "gpt2":
        cfg = transformers.GPT2Config(n_positions=2048 + 64)
        cls: Any = transformers.GPT2LMHeadModel
    else:
        cfg = transformers.LlamaConfig(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
            max_position_embeddings=8192,
            rope_theta=500000.0,
        )
        cls = transformers.LlamaForCausalLM
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            return cls(cfg).eval()
    finally:
        torch.set_default_dtype(torch.float32)


class Timed(NamedTuple):
    """Wall seconds of a generate()'s model calls: when each started, how long it took; with
    ``count``, each call's Python bytecodes instead of its time."""

    starts: list[float]
    inside: list[float]


def _generate(model: Any, case: Case, new: int, count: bool = False) -> Timed:
    ids = torch.randint(0, 50000, (case.batch, case.prompt)).cuda()
    timed_calls = Timed([], [])
    patched = torch.nn.Module.__call__  # (gpemu's: the replay)
    counter = BytecodeCounter()

    def timed(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if self is not model:
            return patched(self, *args, **kwargs)
        counter.counts.clear()
        if count:
            counter.start()
        t = time.perf_counter()
        try:
            return patched(self, *args, **kwargs)
        finally:
            inside = time.perf_counter() - t
            counter.stop()
            timed_calls.starts.append(t)
            timed_calls.inside.append(counter.total if count else inside)

    torch.nn.Module.__call__ = timed  # type: ignore[method-assign]
    try:
        out = model.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
    finally:
        torch.nn.Module.__call__ = patched  # type: ignore[method-assign]
    assert out.shape == (case.batch, case.prompt + new), out.shape
    return timed_calls


def serve_rows(name: str, gpu: str, cases: list[Case], host: str) -> dict[Case, dict[str, Any]]:
    """TTFT, TPOT, KV peak and wall per replayed step of each case (one patch, one model)."""
    rt = gpemu.patch(gpu=gpu, summary=False, clock=VirtualClock(), host=host)
    rows: dict[Case, dict[str, Any]] = {}
    try:
        model = build(name)
        for case in cases:
            try:
                _generate(model, case, NEW_TOKENS)  # records and finds the decode steps' line
                first = len(rt.model_time.serving.steps)
                calls = _generate(model, case, NEW_TOKENS)
                s = serving_summary(rt.model_time.serving.steps[first:])
                # replayed decode steps (the prefill and the first decode step left out): medians
                # (this machine is shared: a mean takes in other programs' bursts)
                gaps = [b - a for a, b in zip(calls.starts[2:], calls.starts[3:], strict=False)]
                counted = _generate(model, case, 12, count=True).inside[2:]
                rows[case] = {
                    "serving": s,
                    "wall_step": statistics.median(gaps),
                    "wall_call": statistics.median(calls.inside[2:]),
                    "bytecodes": statistics.median(counted),
                }
            except torch.cuda.OutOfMemoryError:
                rows[case] = {"oom": True}
    finally:
        gpemu.unpatch()
    return rows


class StepKernels(NamedTuple):
    """One decode step's kernels back to back."""

    seconds: float  # all of them
    gemm_seconds: float  # its matrix products (the weights' reads)
    weight_bytes: int  # the weights a step reads (all but the input embedding's table)
    kv_bytes: int  # its KV cache
    static_seconds: float  # the same step with HF's static cache (written in place, no copy)


_GEMMS = ("mm.default", "addmm.default", "bmm.default")


def step_gpu_seconds(name: str, gpu: str, cases: list[Case], host: str) -> dict[Case, StepKernels]:
    """One decode step's kernels back to back at the prompt's length, and the bytes it must read:
    every weight once but the input embedding's table (one row per token), and the KV cache; with
    HF's dynamic cache (``cat``: a new cache every step) and its static one (written in place)."""
    rt = gpemu.patch(gpu=gpu, summary=False, clock=VirtualClock(), replay=False, host=host)
    out: dict[Case, StepKernels] = {}
    try:
        import transformers

        model = build(name)
        table = model.get_input_embeddings().weight
        weights = sum(p.numel() * p.element_size() for p in model.parameters()) - table.numel() * table.element_size()
        for case in cases:
            try:
                ids = torch.randint(0, 50000, (case.batch, case.prompt)).cuda()
                cache: Any = transformers.DynamicCache(config=model.config)
                ops = _decode_step_ops(rt, model, cache, ids)
                kv = sum(t.untyped_storage().nbytes() for layer in cache.layers for t in (layer.keys, layer.values))
                del cache
                cache = transformers.StaticCache(config=model.config, max_cache_len=case.prompt + 16)
                static = _decode_step_ops(rt, model, cache, ids)
                del cache
                gemm = sum(sp.end - sp.start for sp in ops if sp.name in _GEMMS)
                seconds = sum(sp.end - sp.start for sp in ops)
                out[case] = StepKernels(seconds, gemm, weights, kv, sum(sp.end - sp.start for sp in static))
            except torch.cuda.OutOfMemoryError:
                pass
    finally:
        gpemu.unpatch()
    return out


def _decode_step_ops(rt: Any, model: Any, cache: Any, ids: torch.Tensor) -> list:
    """The ops (GPU spans) of one decode step after a prefill of ``ids`` into ``cache``: its
    kernels, not the time they waited for the host issuing them."""
    prompt = ids.shape[1]
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        torch.cuda.synchronize()
        n0 = len(rt.recorder.spans)
        model(ids[:, :1], past_key_values=cache, use_cache=True, cache_position=torch.tensor([prompt]).cuda())
        torch.cuda.synchronize()
    # (kernels only: without a modelled host an op-by-op pass is also charged the calibration
    # hosts' issue gaps as one span of its own, gpemu.model_pricing.charge_issue_gaps: GPU time a
    # real GPU would spend waiting for its host, not reading bytes)
    return [sp for sp in list(rt.recorder.spans)[n0:] if sp.kind == "op" and not sp.name.endswith(_GAPS)]


_GAPS = ": host issue gaps"


def paged_row(gpu: str, requests: int, blocks: int | None = None) -> str:
    """examples/serving_paged.py's server on ``gpu`` (a 1 B-parameter Llama-shaped decoder in fp16,
    16 layers, a pool of 16-token blocks sized by vLLM's rule unless ``blocks`` is given): its
    pool, TTFT/TPOT from arrival (queueing included), blocks in use, and gpemu's serving metrics."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "examples" / "serving_paged.py"
    spec = importlib.util.spec_from_file_location("serving_paged", path)
    assert spec is not None and spec.loader is not None
    ex = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = ex
    spec.loader.exec_module(ex)
    rt = gpemu.patch(gpu=gpu, summary=False, clock=VirtualClock())
    try:
        torch.manual_seed(0)
        model = ex.Decoder(vocab=32000, dim=2048, layers=16, heads=16, hidden=5632).half().cuda().eval()
        per_block = ex.PagedKV.block_bytes(16, 16, 16, 128, torch.float16)
        n = ex.pool_blocks(blocks, 0.9, per_block)
        try:
            cache = ex.PagedKV(16, n, 16, 16, 128, torch.float16)
        except torch.cuda.OutOfMemoryError:
            return f"{gpu:<9} pool of {n} blocks ({n * per_block / 2**30:.1f} GiB): out of memory on the emulated GPU"
        reqs = ex.make_requests(requests, 6.0, 0)
        server = ex.Server(model, cache, 32)
        with torch.no_grad():
            ex.serve(server, reqs)
        s = serving_summary(rt.model_time.serving.steps)
        del cache
    finally:
        gpemu.unpatch()
    ttft = sorted(r.first_token - r.arrival for r in reqs)
    tpot = sorted((r.done - r.first_token) / max(1, r.made - 1) for r in reqs)
    return (
        f"{gpu:<9} {n:>7} {per_block / 2**20:>6.2f}Mi {server.peak_blocks:>5} {server.preemptions:>4} "
        f"{statistics.median(ttft) * 1e3:>8.1f}ms {statistics.median(tpot) * 1e3:>7.2f}ms "
        f"{s['ttft']['p50_s'] * 1e3:>8.2f}ms {s['tpot']['p50_s'] * 1e3:>7.2f}ms "
        f"{s['kv_cache_peak_bytes'] / 2**30:>7.2f}Gi"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="gpt2,llama3-8b")
    ap.add_argument("--gpus", default="A100,H100")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompts", default="128,2048")
    ap.add_argument("--paged", type=int, default=16, help="requests for the paged-KV server (0: none)")
    ap.add_argument("--only-paged", action="store_true", help="the paged-KV server's rows alone")
    ap.add_argument("--host", default="none", help="gpemu's modelled host (none, this, 0.7x, h100-xeon)")
    a = ap.parse_args()
    print(f"# {machine()}")
    if a.paged:
        print(f"# examples/serving_paged.py: {a.paged} requests at 6/s, 1 B Llama-shaped fp16, 16-token blocks")
        print(
            f"{'gpu':<9} {'blocks':>7} {'/block':>8} {'peak':>5} {'pre':>4} {'TTFT p50':>10} {'TPOT p50':>9} "
            f"{'call TTFT':>10} {'call TPOT':>9} {'KV held':>9}"
        )
        for gpu in a.gpus.split(","):
            print(paged_row(gpu, a.paged))
        print(paged_row(a.gpus.split(",")[0], a.paged, blocks=1_000_000))
    if a.only_paged:
        return
    print(f"# transformers generate(), bf16, greedy, {NEW_TOKENS} new tokens, virtual clock, host {a.host}")
    head = (
        f"{'model':<10} {'gpu':<9} {'batch':>5} {'prompt':>6} {'TTFT':>9} {'TPOT p50':>9} {'TPOT p99':>9} "
        f"{'tok/s':>8} {'KV peak':>9} {'step GPU':>9} {'bound':>9} {'ratio':>6} {'GEMM':>6} {'static':>6} "
        f"{'wall/step':>9} {'in model':>9} {'kBC/step':>8}"
    )
    print(head)
    for name in a.models.split(","):
        for gpu in a.gpus.split(","):
            cases = [Case(name, gpu, int(b), int(p)) for p in a.prompts.split(",") for b in a.batches.split(",")]
            rows = serve_rows(name, gpu, cases, a.host)
            kernels = step_gpu_seconds(name, gpu, cases, a.host)
            bandwidth = gpu_sheet(gpu).memory_bandwidth
            for case in cases:
                print(_line(case, rows[case], kernels.get(case), bandwidth))


def _line(case: Case, row: dict[str, Any], kernels: StepKernels | None, bandwidth: float) -> str:
    lead = f"{case.model:<10} {case.gpu:<9} {case.batch:>5} {case.prompt:>6}"
    if row.get("oom"):
        return f"{lead} out of memory on the emulated GPU"
    s = row["serving"]
    ms = 1e3
    line = (
        f"{lead} {s['ttft']['p50_s'] * ms:>7.2f}ms {s['tpot']['p50_s'] * ms:>7.2f}ms {s['tpot']['p99_s'] * ms:>7.2f}ms "
        f"{s['tokens_per_s']:>8.0f} {s['kv_cache_peak_bytes'] / 2**30:>7.2f}Gi"
    )
    if kernels is not None:
        bound = (kernels.weight_bytes + kernels.kv_bytes) / bandwidth
        gemm = kernels.gemm_seconds / (kernels.weight_bytes / bandwidth)
        line += f" {kernels.seconds * ms:>7.2f}ms {bound * ms:>7.2f}ms {kernels.seconds / bound:>6.2f} {gemm:>6.2f}"
        line += f" {kernels.static_seconds / bound:>6.2f}"
    else:
        line += f" {'-':>9} {'-':>9} {'-':>6} {'-':>6} {'-':>6}"
    line += f" {row['wall_step'] * ms:>7.2f}ms {row['wall_call'] * ms:>7.2f}ms {row['bytecodes'] / 1e3:>8.1f}"
    return line


if __name__ == "__main__":
    main()

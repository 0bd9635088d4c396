"""Inference and serving (issue 33): decode steps replayed by shape class, priced at their real
cache length; KV-cache memory as on a GPU; serving metrics."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

import gpemu
from gpemu.clock import VirtualClock


class KVCache:
    """A server's own cache object: per layer, key and value tensors that grow by the new tokens."""

    def __init__(self, layers: int) -> None:
        self.keys: list = [None] * layers
        self.values: list = [None] * layers
        self.length = 0

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys[layer] is None:
            self.keys[layer], self.values[layer] = k, v
        else:
            self.keys[layer] = torch.cat([self.keys[layer], k], dim=2)
            self.values[layer] = torch.cat([self.values[layer], v], dim=2)
        if layer == len(self.keys) - 1:
            self.length += k.shape[2]
        return self.keys[layer], self.values[layer]


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, cache: KVCache, layer: int) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        k, v = cache.update(layer, k, v)
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=t > 1)
        x = x + self.out(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(x)


class TinyDecoder(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(_Block(dim, heads) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        x = self.emb(ids)
        for i, blk in enumerate(self.blocks):
            x = blk(x, cache, i)
        return self.head(x[:, -1])


def _decode(steps: int, replay: bool, prompt: int, batch: int = 2, dim: int = 32) -> tuple[list[float], KVCache, dict]:
    """Prefill then ``steps`` greedy decode steps; each step's emulated time (virtual clock)."""
    rt = gpemu.patch(gpu="A100", summary=False, clock=VirtualClock(), replay=replay)
    try:
        torch.manual_seed(0)
        model = TinyDecoder(dim=dim).cuda().eval()
        cache = KVCache(len(model.blocks))
        times = []
        with torch.no_grad():
            tok = model(torch.randint(0, 64, (batch, prompt)).cuda(), cache).argmax(-1, keepdim=True)
            for _ in range(steps):
                torch.cuda.synchronize()
                t0 = rt.engine.now()
                tok = model(tok, cache).argmax(-1, keepdim=True)
                torch.cuda.synchronize()
                times.append(rt.engine.now() - t0)
        return times, cache, rt.replay.info() if rt.replay is not None else {}
    finally:
        gpemu.unpatch()


@pytest.mark.slow
def test_decode_steps_are_one_shape_class_priced_at_their_cache_length() -> None:
    """A decode step whose shapes differ only in the cache length is replayed (not recorded
    again), its cache grows as op by op, and each step costs what it costs op by op there."""
    # (sizes where the step is bound by the GPU's work, not by the host issuing it: an op-by-op
    # step on a virtual clock is charged no host time)
    fast, cache, info = _decode(24, replay=True, prompt=4096, batch=32, dim=512)
    slow, ref_cache, _ = _decode(24, replay=False, prompt=4096, batch=32, dim=512)
    assert info["shape_class"] >= 18, info  # a few recordings find the line, then replays
    assert cache.length == ref_cache.length == 4096 + 24
    assert [k.shape for k in cache.keys] == [k.shape for k in ref_cache.keys]
    assert all(k.device.type == "cuda" for k in cache.keys + cache.values)
    # each step at its own length: the same growth per token as op by op (attention over the
    # cache, the cache's copy); the level within the host issue time a replay prices as a whole
    # pass (op by op on a virtual clock: none)
    assert fast[-1] - fast[-2] == pytest.approx(slow[-1] - slow[-2], rel=1e-3)
    assert fast[-1] - fast[8] == pytest.approx(slow[-1] - slow[8], rel=1e-3)
    assert fast[-1] - fast[-2] > 0
    for a, b in zip(fast, slow, strict=True):
        assert a == pytest.approx(b, rel=0.03)


@pytest.mark.slow
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_transformers_generate_replays_its_decode_steps(cache: str) -> None:
    transformers = pytest.importorskip("transformers")
    rt = gpemu.patch(gpu="A100", summary=False, clock=VirtualClock())
    try:
        cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=100, n_positions=128)
        model = transformers.GPT2LMHeadModel(cfg).cuda().eval()
        prompt = torch.randint(1, 90, (2, 8)).cuda()
        out = model.generate(prompt, max_new_tokens=40, do_sample=False, pad_token_id=0, cache_implementation=cache)
        assert out.shape == (2, 48)
        assert rt.replay.info()["shape_class"] >= 30
    finally:
        gpemu.unpatch()


def _serve(rt, steps: int, batch: int = 2, prompt: int = 16, dim: int = 32) -> KVCache:
    model = TinyDecoder(dim=dim).cuda().eval()
    cache = KVCache(len(model.blocks))
    with torch.no_grad():
        tok = model(torch.randint(0, 64, (batch, prompt)).cuda(), cache).argmax(-1, keepdim=True)
        for _ in range(steps):
            tok = model(tok, cache).argmax(-1, keepdim=True)
    torch.cuda.synchronize()
    return cache


def test_serving_metrics_of_a_generation_loop(tmp_path) -> None:
    from gpemu.observe import compute_summary, format_summary, records_from_runtime
    from gpemu.trace import write_trace
    from gpemu.trace_reader import load_trace

    rt = gpemu.patch(gpu="A100", summary=False, clock=VirtualClock())
    try:
        cache = _serve(rt, steps=30, batch=2, prompt=16, dim=32)
        records = records_from_runtime(rt)
    finally:
        gpemu.unpatch()
    s = compute_summary(records)["serving"]
    assert (s["prefills"], s["decode_steps"], s["prompt_tokens"], s["generated_tokens"]) == (1, 30, 32, 62)
    # the cache after the last step: 2 layers x (keys, values), each (batch, heads, 46, dim/heads) fp32
    assert s["kv_cache_peak_bytes"] == sum(k.untyped_storage().nbytes() for k in cache.keys + cache.values)
    assert s["kv_cache_peak_bytes"] == 2 * 2 * 2 * 46 * 32 * 4
    assert 0 < s["tpot"]["p50_s"] <= s["tpot"]["p99_s"] and s["ttft"]["count"] == 1
    assert s["tokens_per_s"] == pytest.approx(62 / (records.serving[-1].end - records.serving[0].start))
    assert "serving" in format_summary(compute_summary(records))
    back = load_trace(write_trace(records, tmp_path / "t.json"))  # what `gpemu report` reads
    again = compute_summary(back)["serving"]
    assert again["kv_cache_peak_bytes"] == s["kv_cache_peak_bytes"] and again["decode_steps"] == 30
    assert again["tpot"]["p99_s"] == pytest.approx(s["tpot"]["p99_s"], rel=1e-6)
    assert again["ttft"]["p50_s"] == pytest.approx(s["ttft"]["p50_s"], rel=1e-3)


def test_a_training_loop_is_no_serving_run() -> None:
    from gpemu.observe import summary

    rt = gpemu.patch(gpu="A100", summary=False, clock=VirtualClock())
    try:
        model = TinyDecoder().cuda()
        for _ in range(3):
            model(torch.randint(0, 64, (2, 8)).cuda(), KVCache(2)).sum().backward()
        with torch.no_grad():  # evaluation over whole sequences: prefills only
            model(torch.randint(0, 64, (2, 8)).cuda(), KVCache(2))
        assert summary(rt)["serving"] is None
    finally:
        gpemu.unpatch()


def test_a_growing_kv_cache_runs_out_of_memory_as_on_a_gpu() -> None:
    """Replayed decode steps allocate the cache's new memory first: at the GPU's capacity a real
    OOM, and the cache is as before the step (a server can evict and go on)."""
    rt = gpemu.patch(gpu="A100", summary=False, clock=VirtualClock())
    try:
        torch.cuda.set_per_process_memory_fraction(128 * 2**20 / rt.memory[0].total)
        model = TinyDecoder(dim=256, heads=4).cuda().eval()
        cache = KVCache(len(model.blocks))
        with torch.no_grad():
            tok = model(torch.randint(0, 64, (8, 128)).cuda(), cache).argmax(-1, keepdim=True)
            with pytest.raises(torch.cuda.OutOfMemoryError):
                for _ in range(2000):
                    tok = model(tok, cache).argmax(-1, keepdim=True)
        assert rt.replay.info()["shape_class"] > 100  # (the OOM came from a replayed step)
        # per layer, keys and values (8, 4, length, 64) fp32: 8 KiB each per token
        assert 128 + 100 < cache.length < 128 * 2**20 // (2 * 2 * 8 * 1024)
        assert [k.shape[2] for k in cache.keys] == [cache.length] * 2
    finally:
        gpemu.unpatch()


def test_a_lookup_or_an_in_place_scatter_is_priced_by_the_rows_it_touches() -> None:
    """A decode step's embedding lookup reads one row per token, not the table; writing a token
    into a preallocated cache touches that token's rows, not the cache."""
    from gpemu.costmodel import classify

    aten = torch.ops.aten
    table = torch.empty(128256, 4096, dtype=torch.bfloat16, device="meta")
    ids = torch.empty(1, 1, dtype=torch.long, device="meta")
    out = torch.empty(1, 1, 4096, dtype=torch.bfloat16, device="meta")
    assert classify(aten.embedding.default, (table, ids), {}, out).nbytes == 8 + 2 * 4096 * 2
    cache = torch.empty(16, 8, 4096, 128, dtype=torch.float16, device="meta")
    slots = torch.empty(16, 1, dtype=torch.long, device="meta")
    new = torch.empty(16, 1, 8, 128, dtype=torch.float16, device="meta")
    put = classify(aten.index_put_.default, (cache, [slots, None, slots], new), {}, cache).nbytes
    assert put == 2 * 16 * 8 + 2 * new.numel() * 2
    whole = classify(aten.index_put.default, (cache, [slots, None, slots], new), {}, cache).nbytes
    assert whole > 2 * cache.numel() * 2  # out of place: a new cache, all of it written


@pytest.mark.subprocess
def test_the_batching_policy_example_runs_to_its_end(tmp_path) -> None:
    """examples/serving_policies.py under `gpemu run --clock virtual`: every request served under
    both policies, continuous batching gives the first token sooner, the run is a serving run."""
    import json
    import re
    import subprocess
    import sys
    from pathlib import Path

    examples = Path(__file__).resolve().parent.parent / "examples"
    metrics = tmp_path / "metrics.json"
    cli = [sys.executable, "-c", "import sys; from gpemu.cli import main; sys.exit(main())"]
    proc = subprocess.run(
        [*cli, "run", "--gpu", "A100", "--clock", "virtual", "--no-summary", "--metrics", str(metrics), "--"]
        + [sys.executable, "serving_policies.py", "--requests", "3", "--layers", "2", "--slots", "2"],
        cwd=examples,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ttft = {m[0]: float(m[1]) for m in re.findall(r"^(static|continuous)\s+TTFT p50\s+([\d.]+) ms", proc.stdout, re.M)}
    assert set(ttft) == {"static", "continuous"} and ttft["continuous"] < ttft["static"]
    serving = json.loads(metrics.read_text())["serving"]
    assert serving["prefills"] == 6 and serving["decode_steps"] > 0 and serving["kv_cache_peak_bytes"] > 0


@pytest.mark.parametrize("with_cache", [True, False])
def test_a_decode_step_captured_in_a_cuda_graph_replays_its_kernels_alone(with_cache: bool) -> None:
    """A replayed step charges a pass with the host's launch gaps; captured into a CUDA graph
    (a decode loop's usual form), the graph's replay runs the same kernels back to back."""
    rt = gpemu.patch(gpu="A100", summary=False, clock=VirtualClock())
    try:
        model = TinyDecoder(dim=64).cuda().eval()
        tok = torch.zeros(4, 1, dtype=torch.long, device="cuda")
        cache = KVCache(2) if with_cache else None

        def step() -> torch.Tensor:
            if cache is None:  # (a static-shape call: the exact-shape replay)
                return model.head(model.emb(tok))
            cache.keys, cache.values = [None, None], [None, None]
            return model(tok, cache)

        with torch.no_grad():
            for _ in range(6):  # recordings, then replays
                step()
            torch.cuda.synchronize()
            t0 = rt.engine.now()
            step()
            torch.cuda.synchronize()
            eager = rt.engine.now() - t0
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            torch.cuda.synchronize()
            t0 = rt.engine.now()
            graph.replay()
            torch.cuda.synchronize()
            replayed = rt.engine.now() - t0
        assert rt.replay.info()["replayed"] >= 3
        assert 0 < replayed < 0.8 * eager
    finally:
        gpemu.unpatch()


class _NoCacheLM(TinyDecoder):
    """nanoGPT's model in sample.py: every call reads the whole sequence so far, no cache."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(ids, KVCache(len(self.blocks)))


@pytest.mark.slow
def test_a_loop_without_cache_is_one_shape_class_along_its_length() -> None:
    """nanoGPT's sample.py: each call's sequence one token longer; replayed by shape class after a
    few recordings, each call priced at its own length."""
    rt = gpemu.patch(gpu="A100", summary=False, clock=VirtualClock())
    try:
        model = _NoCacheLM(dim=256).cuda().eval()
        idx = torch.randint(0, 64, (4, 512)).cuda()
        times = []
        with torch.no_grad():
            for _ in range(16):
                torch.cuda.synchronize()
                t0 = rt.engine.now()
                nxt = model(idx).argmax(-1, keepdim=True)
                torch.cuda.synchronize()
                times.append(rt.engine.now() - t0)
                idx = torch.cat([idx, nxt], dim=1)
        assert idx.shape == (4, 528)
        assert rt.replay.info()["shape_class"] >= 10
        assert times[-1] > times[-2] > times[-3]  # a longer sequence costs more
    finally:
        gpemu.unpatch()


def test_an_op_by_op_call_and_its_replays_wait_alike_for_the_host() -> None:
    """A forward of many small kernels is bound by the host issuing them: run op by op (a prefill,
    a first call) it ends where its replays end, not when its kernels alone would."""
    rt = gpemu.patch(gpu="A100", summary=False, clock=VirtualClock())
    try:
        model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(24)]).cuda().eval()
        x = torch.randn(2, 16).cuda()
        took, kernels = [], []
        with torch.no_grad():
            for _ in range(3):
                torch.cuda.synchronize()
                t0, n0 = rt.engine.now(), len(rt.recorder.spans)
                model(x)
                torch.cuda.synchronize()
                took.append(rt.engine.now() - t0)
                spans = list(rt.recorder.spans)[n0:]
                kernels.append(sum(s.end - s.start for s in spans if s.kind == "op" and "issue gaps" not in s.name))
        assert rt.replay.info()["replayed"] >= 2
        # (op by op: its kernels and the pass's host issue gaps, gpemu.model_pricing.charge_issue_gaps)
        assert kernels[0] > 0 and took[0] > 1.5 * kernels[0]
        assert took[0] == pytest.approx(took[1], rel=1e-6) and took[1] == pytest.approx(took[2], rel=1e-6)
    finally:
        gpemu.unpatch()


def test_serving_metrics_without_replay() -> None:
    """Replay off (every call op by op): the same token steps, KV cache and a TPOT as with it."""
    from gpemu.observe import compute_summary, records_from_runtime

    rt = gpemu.patch(gpu="A100", summary=False, clock=VirtualClock(), replay=False)
    try:
        cache = _serve(rt, steps=6, batch=2, prompt=10, dim=32)  # (16 positions: whole 512-byte blocks)
        s = compute_summary(records_from_runtime(rt))["serving"]
    finally:
        gpemu.unpatch()
    assert (s["prefills"], s["decode_steps"], s["generated_tokens"]) == (1, 6, 14)
    assert s["kv_cache_peak_bytes"] == sum(k.untyped_storage().nbytes() for k in cache.keys + cache.values)
    assert 0 < s["tpot"]["p50_s"] <= s["tpot"]["p99_s"]


def _replayed_step_bytecodes(batch: int, prompt: int) -> list[int]:
    """Python bytecodes inside the model's call of each replayed decode step (traced as
    benchmarks/opcodes.py does: a count no machine load moves)."""
    rt = gpemu.patch(gpu="A100", summary=False, clock=VirtualClock())
    counts: list[int] = []
    tally = [0]

    def opcode(frame, event, arg):  # noqa: ANN001, ANN202
        if event == "opcode":
            tally[0] += 1
        return opcode

    def tracer(frame, event, arg):  # noqa: ANN001, ANN202
        if event == "call":
            frame.f_trace_opcodes = True
            frame.f_trace_lines = False
            return opcode
        return None

    try:
        torch.manual_seed(0)
        model = TinyDecoder(layers=4).cuda().eval()
        cache = KVCache(len(model.blocks))
        with torch.no_grad():
            tok = model(torch.randint(0, 64, (batch, prompt)).cuda(), cache).argmax(-1, keepdim=True)
            for _ in range(12):
                replayed = rt.replay.classes.stats["replayed"]
                tally[0] = 0
                sys.settrace(tracer)
                try:
                    out = model(tok, cache)
                finally:
                    sys.settrace(None)
                if rt.replay.classes.stats["replayed"] > replayed:
                    counts.append(tally[0])
                tok = out.argmax(-1, keepdim=True)
    finally:
        gpemu.unpatch()
    return counts


def test_a_replayed_decode_steps_work_does_not_grow_with_batch_or_context() -> None:
    """The emulator's host work per replayed decode step is reading the cache along its kept walk
    and making the tensors the step makes: the same at batch 1 x 8 as at batch 8 x 512."""
    short, long = _replayed_step_bytecodes(1, 8), _replayed_step_bytecodes(8, 512)
    assert len(short) >= 6 and len(long) >= 6  # (after the recordings that find the line)
    assert sorted(long)[len(long) // 2] <= 1.02 * sorted(short)[len(short) // 2]


def _gpu_busy_per_step(replay: bool, steps: int = 10) -> list[float]:
    """The GPU's busy time in each decode step (its spans' lengths) behind a modelled host."""
    rt = gpemu.patch(gpu="A100", summary=False, clock=VirtualClock(), replay=replay, host="h100-xeon")
    busy = []
    try:
        torch.manual_seed(0)
        model = TinyDecoder(dim=64, layers=3).cuda().eval()
        cache = KVCache(len(model.blocks))
        with torch.no_grad():
            tok = model(torch.randint(0, 64, (4, 96)).cuda(), cache).argmax(-1, keepdim=True)
            for _ in range(steps):
                torch.cuda.synchronize()
                n0 = len(rt.recorder.spans)
                tok = model(tok, cache).argmax(-1, keepdim=True)
                torch.cuda.synchronize()
                spans = list(rt.recorder.spans)[n0:]
                busy.append(sum(sp.end - sp.start for sp in spans if sp.kind in ("op", "forward")))
        if replay:
            assert rt.replay.classes.stats["replayed"] >= steps - 4
    finally:
        gpemu.unpatch()
    return busy


def test_a_replayed_decode_step_keeps_the_gpu_busy_for_its_kernels_at_its_length() -> None:
    """Behind a modelled host, a decode step replayed by shape class at a new cache length keeps
    the GPU busy as long as the same step's kernels op by op: its attention and cache copy
    re-priced at that length, the host's issue time not counted as GPU time."""
    replayed, op_by_op = _gpu_busy_per_step(True), _gpu_busy_per_step(False)
    assert op_by_op[-1] > op_by_op[0]  # (the cache grows: the step's kernels cost more)
    for r, o in zip(replayed[-5:], op_by_op[-5:], strict=True):
        assert r == pytest.approx(o, rel=1e-4)  # (a price kept from the recording: 0.2% off)

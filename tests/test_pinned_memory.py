"""Pinned host memory: a real mlock'd caching pool behind Tensor.pin_memory()."""

from __future__ import annotations

import gc
import json
import os
import select
import signal
import sys
import threading
import time

import pytest
import torch

import gpemu
from gpemu.integrations import pinned_memory as pm
from gpemu.integrations.pinned_memory import PinnedHostPool, host_pool, is_pinned, locked_bytes, size_class

MiB = 1 << 20


def test_size_classes_are_powers_of_two_like_cuda_host_allocator() -> None:
    assert size_class(1) == 4096
    assert size_class(4096) == 4096
    assert size_class(4097) == 8192
    batch = 64 * 3 * 224 * 224 * 4
    assert size_class(batch) == 64 * MiB
    with pytest.raises(ValueError, match=">= 0"):
        size_class(-1)


def test_block_returns_to_free_list_when_last_tensor_dies_and_is_reused() -> None:
    pool = PinnedHostPool()
    a = pm.pin(torch.arange(1000, dtype=torch.float32), pool)
    view = a[10:20]
    s = pool.stats()
    assert (s.blocks, s.blocks_in_use, s.misses, s.hits) == (1, 1, 1, 0)
    del a
    gc.collect()
    # The view keeps the block in use.
    assert pool.stats().blocks_in_use == 1
    assert view[0].item() == 10.0
    del view
    gc.collect()
    s = pool.stats()
    assert (s.blocks, s.blocks_in_use) == (1, 0)
    b = pm.pin(torch.ones(900), pool)  # same size class: a hit on the released block
    s = pool.stats()
    assert (s.blocks, s.hits, s.misses) == (1, 1, 1)
    # A live block is never handed out twice.
    c = pm.pin(torch.ones(900), pool)
    s = pool.stats()
    assert (s.blocks, s.blocks_in_use, s.misses) == (2, 2, 2)
    assert b.untyped_storage().data_ptr() != c.untyped_storage().data_ptr()
    assert s.bytes_reserved == 2 * 4096


def test_pinned_copy_has_same_values_dtype_and_strides() -> None:
    pool = PinnedHostPool()
    x = torch.randn(4, 3, 8, 8)
    cl = x.contiguous(memory_format=torch.channels_last)
    for src in (x, cl, x.transpose(0, 1), torch.arange(10)[::2], torch.tensor([True, False])):
        y = pm.pin(src, pool)
        assert torch.equal(y, src) and y.dtype == src.dtype
        if src.is_contiguous() or src.is_contiguous(memory_format=torch.channels_last):
            assert y.stride() == src.stride()
    assert pm.pin(torch.empty(0, 3), pool).shape == (0, 3)


def test_blocks_are_page_locked_as_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("the locked path needs CAP_IPC_LOCK (root here); the unprivileged path is tested below")
    pool = PinnedHostPool()
    before = locked_bytes()
    keep = [pm.pin(torch.ones(3 * MiB // 4), pool) for _ in range(3)]  # 3 MiB -> 4 MiB blocks
    assert locked_bytes() - before == 3 * 4 * MiB
    assert pool.stats().bytes_locked == 3 * 4 * MiB
    assert pool.stats().lock_failures == 0
    del keep


def test_pool_is_thread_safe() -> None:
    pool = PinnedHostPool()
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            for i in range(40):
                x = torch.full((5000,), float(seed * 1000 + i))
                y = pm.pin(x, pool)
                assert torch.equal(x, y)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    gc.collect()
    s = pool.stats()
    assert s.hits + s.misses == 160
    assert s.blocks_in_use == 0
    assert s.blocks <= 8  # reused: at most a couple of live blocks per thread


def test_patched_pin_memory_and_is_pinned() -> None:
    x = torch.randn(16, 16)
    with pytest.raises(RuntimeError):
        x.pin_memory()  # the CPU build cannot pin without gpemu
    original_pin, original_is_pinned = torch.Tensor.pin_memory, torch.Tensor.is_pinned
    rt = gpemu.patch(gpu="V100")
    y = x.pin_memory()
    assert y.is_pinned() and not x.is_pinned()
    assert torch.equal(x, y)
    assert y.pin_memory() is y  # already pinned: returned as is
    assert y[2:].is_pinned()  # a view of pinned memory is pinned
    assert not torch.ones(3).is_pinned()
    assert rt.pinned.pins == 2
    assert rt.recorder.counters["pin_bytes"] == 2 * x.numel() * 4
    gpemu.unpatch()
    assert torch.Tensor.pin_memory is original_pin and torch.Tensor.is_pinned is original_is_pinned


def test_pinned_off_makes_plain_copies() -> None:
    gpemu.patch(gpu="V100", pinned=False)
    x = torch.randn(100)
    before = host_pool().stats()
    y = x.pin_memory()
    assert torch.equal(x, y) and y.data_ptr() != x.data_ptr()
    assert not y.is_pinned()
    after = host_pool().stats()
    assert (after.hits, after.misses) == (before.hits, before.misses)


_CHILD_TIMEOUT = 60


def _run_as_nobody(body) -> dict:
    """Fork, drop to uid/gid 65534 (losing CAP_IPC_LOCK), run ``body()`` and return its dict.

    The child redirects its stderr into a pipe so the test can count the warnings it printed.
    """
    if os.geteuid() != 0:
        pytest.skip("needs root to drop privileges in a child")
    res_r, res_w = os.pipe()
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        code = 0
        try:
            os.close(res_r)
            os.close(err_r)
            os.dup2(err_w, 2)
            sys.stderr = open(2, "w", closefd=False)  # pytest's capture replaced sys.stderr
            # The parent's OpenMP pool does not survive fork: a parallel op would hang here.
            torch.set_num_threads(1)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            out = body()
            os.write(res_w, json.dumps(out).encode())
        except BaseException as exc:  # report, never return into pytest
            os.write(res_w, json.dumps({"error": repr(exc)}).encode())
            code = 1
        finally:
            os._exit(code)
    os.close(res_w)
    os.close(err_w)
    chunks: list[bytes] = []
    errs: list[bytes] = []
    open_fds = {res_r: chunks, err_r: errs}
    deadline = time.monotonic() + _CHILD_TIMEOUT
    while open_fds and time.monotonic() < deadline:
        ready, _, _ = select.select(list(open_fds), [], [], max(0.0, deadline - time.monotonic()))
        for fd in ready:
            data = os.read(fd, 1 << 16)
            if data:
                open_fds[fd].append(data)
            else:
                del open_fds[fd]
    if open_fds:
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    assert not open_fds, f"unprivileged child hung; stderr so far: {b''.join(errs)[-2000:]!r}"
    os.close(res_r)
    os.close(err_r)
    result = json.loads(b"".join(chunks) or b"{}")
    assert "error" not in result, result
    result["stderr"] = b"".join(errs).decode(errors="replace")
    return result


@pytest.mark.subprocess
def test_unprivileged_user_gets_unlocked_pool_and_one_clear_warning() -> None:
    # Patch in the parent: the child (like a DataLoader worker) inherits the patched torch;
    # `nobody` could not open the root-owned test database.
    rt = gpemu.patch(gpu="V100")

    def body() -> dict:
        pool = PinnedHostPool(notify=rt.say_once)
        before = locked_bytes()
        keep = [pm.pin(torch.ones(MiB), pool) for _ in range(5)]  # 5 x 4 MiB blocks > 8 MiB limit
        # Through the patched method and the process pool: 16 MiB blocks, also refused.
        keep2 = [torch.ones(3 * MiB).pin_memory() for _ in range(2)]
        return {
            "uid": os.getuid(),
            "pinned": all(t.is_pinned() for t in keep + keep2) and all(is_pinned(t) for t in keep),
            "values_ok": all(torch.equal(t, torch.ones(MiB)) for t in keep),
            "stats": pool.stats().as_dict(),
            "vmlck_growth": locked_bytes() - before,
            "limit": __import__("resource").getrlimit(__import__("resource").RLIMIT_MEMLOCK)[0],
        }

    r = _run_as_nobody(body)
    assert r["uid"] == 65534
    assert r["pinned"] and r["values_ok"]
    s = r["stats"]
    assert s["blocks"] == 5 and s["lock_failures"] >= 1
    assert s["bytes_locked"] + s["lock_failures"] * 4 * MiB == s["bytes_reserved"]
    if r["limit"] >= 0:
        assert r["vmlck_growth"] <= r["limit"]
    assert r["vmlck_growth"] == s["bytes_locked"]
    # One warning for the whole process (two pools failed, many blocks), naming the fix.
    lines = [ln for ln in r["stderr"].splitlines() if "mlock" in ln]
    assert len(lines) == 1, r["stderr"]
    assert "ulimit -l unlimited" in lines[0] and "CAP_IPC_LOCK" in lines[0]


@pytest.mark.subprocess
def test_dataloader_pin_thread_yields_pinned_batches_and_reuses_blocks() -> None:
    from torch.utils.data import DataLoader, Dataset

    class Images(Dataset):
        def __len__(self) -> int:
            return 24

        def __getitem__(self, i: int):
            return torch.full((3, 32, 32), float(i)), i

    rt = gpemu.patch(gpu="V100")
    if not torch.accelerator.is_available():
        pytest.skip("torch.accelerator surface (gpemu.cuda_api) not installed in this build")
    pool = host_pool()
    loader = DataLoader(Images(), batch_size=4, num_workers=2, pin_memory=True, persistent_workers=True)
    vmlck_before = locked_bytes()
    misses_per_epoch = []
    for epoch in range(3):
        start = pool.stats().misses
        seen = 0
        for x, y in loader:
            assert x.is_pinned() and y.is_pinned()
            assert x[0, 0, 0, 0].item() == float(y[0])
            seen += 1
            if epoch == 0:
                time.sleep(0.02)  # let the loader fill its queues so epoch 0 reaches the maximum in flight
        assert seen == 6
        del x, y  # a batch kept across epochs would need one more block than epoch 0 had
        misses_per_epoch.append(pool.stats().misses - start)
    del loader
    gc.collect()
    assert misses_per_epoch[0] > 0
    assert misses_per_epoch[1:] == [0, 0], misses_per_epoch
    if os.geteuid() == 0:
        assert locked_bytes() >= vmlck_before  # blocks stay locked (never given back)
    assert rt.pinned.pins >= 36

"""CudaSurface methods one by one: those the scripts of tests/test_cuda_api.py do not reach.

Each is called through torch (as scripts call it) and, where the point is the method itself,
on the run's surface object directly (``rt.cuda``), which needs no patching to be tested.
"""

from __future__ import annotations

import pytest
import torch

import gpemu
from gpemu.clock import VirtualClock
from gpemu.cuda_api import SURFACE, CudaSurface

pytestmark = pytest.mark.gpus(2)  # (the rt fixture's run: tests/conftest.py)


def test_reset_accumulated_memory_stats_restarts_the_historical_counters(rt) -> None:
    keep = torch.empty(1024, device="cuda")
    for _ in range(3):
        del_me = torch.empty(4096, device="cuda")
        del del_me
    with pytest.raises(torch.cuda.OutOfMemoryError):
        torch.empty(64 << 30, dtype=torch.uint8, device="cuda")
    before = torch.cuda.memory_stats()
    assert before["allocation.all.allocated"] >= 4 and before["allocation.all.freed"] >= 3
    assert before["num_ooms"] == 1 and before["num_alloc_retries"] >= 1
    allocated, peak = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
    torch.cuda.reset_accumulated_memory_stats()
    after = torch.cuda.memory_stats()
    assert after["allocation.all.allocated"] == after["allocation.all.freed"] == 0
    assert after["num_ooms"] == after["num_alloc_retries"] == 0
    # current use and peaks are not "accumulated" stats: they stay
    assert torch.cuda.memory_allocated() == allocated and torch.cuda.max_memory_allocated() == peak
    assert after["allocation.all.current"] == before["allocation.all.current"]
    # the accelerator form, on the other device
    torch.empty(10, device="cuda:1")
    assert torch.accelerator.memory_stats(1)["allocation.all.allocated"] == 1
    torch.accelerator.reset_accumulated_memory_stats(1)
    assert torch.accelerator.memory_stats(1)["allocation.all.allocated"] == 0
    del keep


def test_lazy_init_marks_cuda_initialised_and_unpatch_restores_it() -> None:
    was = torch.cuda._initialized
    gpemu.patch(gpu="V100", summary=False, clock=VirtualClock())
    assert torch.cuda.is_initialized() is False
    torch.cuda._lazy_init()
    assert torch.cuda.is_initialized() is True and torch.cuda._initialized is True
    gpemu.unpatch()
    assert torch.cuda._initialized is was


def test_exchange_device_returns_the_previous_one(rt) -> None:
    assert torch.cuda._exchange_device(1) == 0 and torch.cuda.current_device() == 1
    assert torch.cuda._maybe_exchange_device(0) == 1 and torch.cuda.current_device() == 0
    assert torch.cuda._exchange_device(-1) == -1 and torch.cuda.current_device() == 0  # a no-op
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        torch.cuda._exchange_device(2)


def test_peer_access_arch_list_and_ipc_collect(rt) -> None:
    assert torch.cuda.can_device_access_peer(0, 1) is True
    assert torch.cuda.can_device_access_peer(1, 1) is False
    major, minor = torch.cuda.get_device_capability()
    assert f"sm_{major}{minor}" in torch.cuda.get_arch_list()  # the GPU's own architecture is built
    torch.cuda.ipc_collect()
    assert torch.cuda.is_initialized()


def test_cached_aliases_and_device_memory_used_follow_reserved_memory(rt) -> None:
    x = torch.empty(3 << 20, device="cuda")
    assert torch.cuda.memory_cached() == torch.cuda.memory_reserved() > 0
    assert torch.cuda.device_memory_used() == torch.cuda.memory_reserved()
    del x
    assert torch.cuda.max_memory_cached() == torch.cuda.max_memory_reserved() > torch.cuda.memory_allocated()
    torch.cuda.empty_cache()
    torch.cuda.reset_max_memory_cached()
    assert torch.cuda.max_memory_cached() == torch.cuda.memory_reserved() == 0


def test_per_process_memory_fraction_limits_allocations(rt) -> None:
    total = rt.gpus[0].memory_bytes
    torch.cuda.set_per_process_memory_fraction(0.25)
    torch.empty(int(total * 0.2), dtype=torch.uint8, device="cuda")  # fits under a quarter
    with pytest.raises(torch.cuda.OutOfMemoryError, match="limited to"):
        torch.empty(int(total * 0.3), dtype=torch.uint8, device="cuda")
    torch.empty(int(total * 0.3), dtype=torch.uint8, device="cuda:1")  # the other device is not limited
    with pytest.raises(ValueError, match="Allowed range"):
        torch.cuda.set_per_process_memory_fraction(1.5)


def test_seed_all_gives_every_device_one_new_seed(rt) -> None:
    torch.cuda.manual_seed_all(5)
    states = torch.cuda.get_rng_state_all()
    torch.cuda.seed_all()
    new = torch.cuda.get_rng_state_all()
    assert all(not torch.equal(a, b) for a, b in zip(states, new, strict=False))
    assert torch.equal(new[0], new[1])  # one seed for all
    torch.cuda.set_device(1)
    assert torch.cuda.initial_seed() != 5


def test_stream_context_and_accelerator_aliases(rt) -> None:
    s = torch.cuda.Stream(device=1)
    with torch.cuda.StreamContext(s):
        assert torch.cuda.current_stream(1) == s
        assert torch.cuda.current_stream(0) == torch.cuda.default_stream(0)
    assert torch.cuda.current_stream(1) == torch.cuda.default_stream(1)
    with torch.cuda.StreamContext(None):  # a no-op, as in torch
        pass
    assert isinstance(torch.cuda.current_stream(), torch.cuda.Stream)
    torch.accelerator.set_device_idx(1)
    assert torch.accelerator.current_device_idx() == 1 == torch.cuda.current_device()
    assert torch.accelerator.memory.empty_host_cache() is None
    assert torch.backends.cudnn.is_acceptable(torch.empty(2, device="cuda")) is False


def test_the_surface_answers_without_patching(rt) -> None:
    """A CudaSurface is an ordinary object: its methods answer for its run whether or not torch
    points at them (another surface of the same run, never installed, says the same)."""
    spare = CudaSurface(rt)
    assert spare.device_count() == 2 and spare.is_available()
    assert spare.get_device_name(1) == torch.cuda.get_device_name(1)
    x = torch.empty(1000, device="cuda:1")
    assert spare.memory_allocated(1) == torch.cuda.memory_allocated(1) >= x.nbytes
    with pytest.raises(ValueError, match="Expected a cuda device"):
        spare.memory_allocated("cpu")


def test_every_table_entry_is_a_surface_attribute() -> None:
    names = {e if isinstance(e, str) else e[1] for entries in SURFACE.values() for e in entries}
    missing = sorted(
        n
        for n in names
        if not hasattr(CudaSurface, n) and n not in ("Stream", "Event", "StreamContext", "device_index_context")
    )
    assert missing == []

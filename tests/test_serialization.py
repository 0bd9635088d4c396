"""torch.save / torch.load of emulated tensors, with and without gpemu, and real-CUDA files."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

import gpemu
from gpemu.device import EmuTensor

pytestmark = pytest.mark.gpus(2)  # (the rt fixture's run: tests/conftest.py)


def _checkpoint(tmp_path):
    model = nn.Linear(4, 3).cuda()
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4).cuda()).sum().backward()
    opt.step()
    path = tmp_path / "ck.pt"
    torch.save(
        {
            "model": model.state_dict(),
            "opt": opt.state_dict(),
            "epoch": torch.tensor(7, device="cuda"),
            "on1": torch.zeros(100, 100, device="cuda:1"),
        },
        path,
    )
    return path


def test_round_trip_with_gpemu(rt, tmp_path):
    path = _checkpoint(tmp_path)
    ck = torch.load(path)
    w = ck["model"]["weight"]
    assert isinstance(w, EmuTensor) and w.device == torch.device("cuda", 0) and w.shape == (3, 4)
    assert ck["on1"].device == torch.device("cuda", 1) and ck["epoch"].item() == 7
    assert ck["opt"]["state"][0]["exp_avg"].device.type == "cuda"
    target = nn.Linear(4, 3).cuda()
    target.load_state_dict(ck["model"])
    opt = torch.optim.Adam(target.parameters())
    opt.load_state_dict(ck["opt"])
    assert opt.state[target.weight]["exp_avg"].device == target.weight.device


def test_map_location_forms(rt, tmp_path):
    path = _checkpoint(tmp_path)
    assert torch.load(path, map_location="cpu")["model"]["weight"].device.type == "cpu"
    assert torch.load(path, map_location="cuda:1")["model"]["weight"].device == torch.device("cuda", 1)
    assert torch.load(path, map_location=torch.device("cuda", 1))["on1"].device.index == 1
    assert torch.load(path, map_location={"cuda:1": "cuda:0"})["on1"].device.index == 0
    assert torch.load(path, map_location=lambda s, loc: s)["model"]["weight"].device.type == "cpu"
    assert torch.load(path, map_location=lambda s, loc: s.cuda())["model"]["weight"].device.type == "cuda"


def test_full_module_pickle(rt, tmp_path):
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).cuda()
    torch.save(model, tmp_path / "m.pt")
    loaded = torch.load(tmp_path / "m.pt", weights_only=False)
    assert isinstance(loaded[0].weight, torch.nn.Parameter) and loaded[0].weight.device.type == "cuda"
    assert loaded[1].running_mean.device.type == "cuda"


@pytest.mark.subprocess
def test_file_loads_without_gpemu(rt, tmp_path):
    path = _checkpoint(tmp_path)
    gpemu.unpatch()
    code = (
        "import torch,sys; ck=torch.load(sys.argv[1]); w=ck['model']['weight'];"
        "print(type(w).__name__, w.device, tuple(w.shape), int(ck['epoch']), tuple(ck['on1'].shape))"
    )
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["Tensor", "cpu", "(3,", "4)", "7", "(100,", "100)"]


def test_files_from_real_cuda_runs_load_onto_emulated_gpus(rt, tmp_path):
    # Write a checkpoint whose storages are tagged 'cuda:1', as a real CUDA run would.
    path = tmp_path / "real.pt"
    registry = torch.serialization._package_registry
    entry = (-100, lambda obj: "cuda:1", lambda obj, location: None)
    registry.append(entry)
    registry.sort(key=lambda e: e[0])
    try:
        torch.save({"w": torch.ones(2, 3)}, path)
    finally:
        registry.remove(entry)
    assert isinstance(torch.load(path)["w"], EmuTensor) and torch.load(path)["w"].device.index == 1
    assert torch.load(path, map_location="cuda:0")["w"].device.index == 0
    assert torch.load(path, map_location="cpu")["w"].device.type == "cpu"


def test_tensors_sent_to_another_process_stay_on_the_emulated_gpu(rt):
    """torch.multiprocessing sends a CUDA tensor by CUDA IPC: the receiver gets a tensor on the same
    device over the sender's memory (no copy, no new allocation), a Parameter stays one."""
    from multiprocessing.reduction import ForkingPickler

    model = nn.Linear(64, 64).cuda(1)
    step = torch.tensor(3, device="cuda:1")
    allocated = torch.cuda.memory_allocated(1)
    weight, count = ForkingPickler.loads(bytes(ForkingPickler.dumps((model.weight, step))))
    assert isinstance(weight, nn.Parameter) and isinstance(weight, EmuTensor) and weight.requires_grad
    assert weight.device == torch.device("cuda:1") and weight.shape == (64, 64)
    assert count.device == torch.device("cuda:1") and count.item() == 3
    assert torch.cuda.memory_allocated(1) == allocated
    (weight @ torch.randn(64, 8, device="cuda:1")).sum().backward()
    assert weight.grad is not None and weight.grad.device == torch.device("cuda:1")


HOGWILD_SCRIPT = """
import torch, torch.multiprocessing as mp
from torch import nn

def train(rank, model, queue):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(8, 32, device="cuda")).sum().backward()
    opt.step()
    queue.put((rank, str(model.weight.device), isinstance(model.weight, nn.Parameter)))

if __name__ == "__main__":
    mp.set_start_method("spawn", force=True)
    model = nn.Linear(32, 32).cuda()
    model.share_memory()
    queue = mp.get_context("spawn").SimpleQueue()
    procs = [mp.Process(target=train, args=(r, model, queue)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    print(sorted(queue.get() for _ in procs))
"""


@pytest.mark.subprocess
def test_hogwild_on_cuda_shares_the_model_with_spawned_processes(tmp_path):
    """pytorch/examples mnist_hogwild --cuda: a CUDA model passed to mp.Process children."""
    script = tmp_path / "hogwild.py"
    script.write_text(HOGWILD_SCRIPT)
    proc = subprocess.run(
        [sys.executable, "-m", "gpemu.cli", "run", "--gpu", "A100", "--no-summary", "--", sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[(0, 'cuda:0', True), (1, 'cuda:0', True)]" in proc.stdout, proc.stdout


def test_a_tensor_sent_to_a_process_gpemu_does_not_emulate_in_arrives_as_host_values():
    from gpemu.serialization import SharedTensor, rebuild_in_process

    unknown = SharedTensor((2, 3), (3, 1), 0, torch.float32, 0, False, False, None)
    t = rebuild_in_process(unknown)
    assert t.device.type == "cpu" and torch.equal(t, torch.zeros(2, 3))
    known = rebuild_in_process(unknown._replace(value=torch.arange(6.0), is_parameter=True, requires_grad=True))
    assert isinstance(known, torch.nn.Parameter) and torch.equal(known.detach(), torch.arange(6.0).reshape(2, 3))

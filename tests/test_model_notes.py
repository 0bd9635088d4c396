"""Which models a step is charged for, and what gpemu says about them: a wrapper is charged for
the models its forward calls (an EMA copy it holds is not; a model called twice is twice), a
submodule the script calls directly is not announced again, and the ± figure says where it
comes from when no measured model was like this one."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import gpemu
from examples import tvmodels
from gpemu.clock import VirtualClock


@pytest.fixture
def rt():
    r = gpemu.patch(gpu="A100", summary=False, clock=VirtualClock())
    yield r
    gpemu.unpatch()


def _spans(rt, kind: str) -> list:
    return [s for s in rt.recorder.spans if s.kind == kind]


class _Holder(nn.Module):
    """A model and an EMA copy of it; ``calls`` says how many times forward calls the model."""

    def __init__(self, model: nn.Module, calls: int) -> None:
        super().__init__()
        self.model = model
        self.ema = copy.deepcopy(model)
        self.calls = calls
        self.head = nn.Linear(1000, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.calls:
            return self.head(x.flatten(1)[:, :1000])
        return sum(self.model(x) for _ in range(self.calls))  # type: ignore[return-value]


@pytest.mark.slow
def test_a_wrapper_is_charged_for_the_models_its_forward_calls(rt) -> None:
    x = torch.zeros(4, 3, 224, 224, device="cuda")
    bare = tvmodels.resnet18().cuda()
    bare(x).sum().backward()
    alone = _spans(rt, "forward")[-1]
    for calls, name in ((1, "resnet18"), (2, "resnet18+resnet18")):
        holder = _Holder(tvmodels.resnet18(), calls).cuda()
        for _ in range(2):  # the first call finds out, the second is replayed
            holder(x).sum().backward()
            fwd = _spans(rt, "forward")[-1]
            assert fwd.name == name
            assert fwd.end - fwd.start == pytest.approx(calls * (alone.end - alone.start), rel=1e-6)
    # A wrapper whose forward calls none of its models is priced by the ops it runs.
    before = len(_spans(rt, "forward"))
    _Holder(tvmodels.resnet18(), 0).cuda()(x).sum().backward()
    assert all(s.name != "resnet18" for s in _spans(rt, "forward")[before:])


def test_a_submodule_called_directly_is_not_announced_again(rt) -> None:
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8)).cuda()
    x = torch.zeros(4, 64, device="cuda")
    model(x).sum().backward()
    model[0](x).sum().backward()  # its first layer alone
    notes = [n for n in rt.recorder.notes if "matches no dataset model" in n or "estimated by the cost model" in n]
    assert len(notes) == 2 and all("Sequential" in n for n in notes), notes


def test_the_uncertainty_says_when_the_figure_was_not_measured_on_such_work(rt) -> None:
    layer = nn.TransformerEncoderLayer(128, 4, 512, batch_first=True).cuda().to(torch.bfloat16)
    layer(torch.zeros(4, 64, 128, device="cuda", dtype=torch.bfloat16)).float().sum().backward()
    cnn = nn.Sequential(nn.Conv2d(3, 64, 3), nn.ReLU(), nn.Conv2d(64, 64, 3)).cuda()
    cnn(torch.zeros(8, 3, 64, 64, device="cuda")).sum().backward()
    sources = {m["model"]: m for m in rt.model_time.sources.values()}
    assert "checked on fp32 CNNs" in sources["TransformerEncoderLayer"]["uncertainty"]
    assert "bfloat16 not checked" in sources["TransformerEncoderLayer"]["uncertainty"]
    assert "checked on" not in sources["Sequential"]["uncertainty"]  # fp32 convolutions: measured kind

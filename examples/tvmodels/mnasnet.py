"""torchvision's MNASNet, in plain PyTorch (see the package's docstring)."""

from __future__ import annotations

from torch import Tensor, nn

__all__ = ["MNASNet", "mnasnet0_5", "mnasnet0_75", "mnasnet1_0", "mnasnet1_3"]


_MNAS_BN_MOMENTUM = 1 - 0.9997


class _MnasResidual(nn.Module):
    def __init__(self, cin: int, cout: int, kernel_size: int, stride: int, expansion: int) -> None:
        super().__init__()
        mid = cin * expansion
        self.apply_residual = cin == cout and stride == 1
        m = _MNAS_BN_MOMENTUM
        self.layers = nn.Sequential(
            nn.Conv2d(cin, mid, 1, bias=False),
            nn.BatchNorm2d(mid, momentum=m),
            nn.ReLU(inplace=True),
            nn.Conv2d(mid, mid, kernel_size, padding=kernel_size // 2, stride=stride, groups=mid, bias=False),
            nn.BatchNorm2d(mid, momentum=m),
            nn.ReLU(inplace=True),
            nn.Conv2d(mid, cout, 1, bias=False),
            nn.BatchNorm2d(cout, momentum=m),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x) + x if self.apply_residual else self.layers(x)


def _mnas_stack(cin: int, cout: int, k: int, stride: int, expansion: int, repeats: int) -> nn.Sequential:
    return nn.Sequential(
        _MnasResidual(cin, cout, k, stride, expansion),
        *[_MnasResidual(cout, cout, k, 1, expansion) for _ in range(1, repeats)],
    )


def _round_to_multiple_of(val: float, divisor: int, round_up_bias: float = 0.9) -> int:
    new_val = max(divisor, int(val + divisor / 2) // divisor * divisor)
    return new_val if new_val >= round_up_bias * val else new_val + divisor


class MNASNet(nn.Module):
    def __init__(self, alpha: float, num_classes: int = 1000, dropout: float = 0.2) -> None:
        super().__init__()
        d = [_round_to_multiple_of(x * alpha, 8) for x in (32, 16, 24, 40, 80, 96, 192, 320)]
        m = _MNAS_BN_MOMENTUM
        self.layers = nn.Sequential(
            nn.Conv2d(3, d[0], 3, padding=1, stride=2, bias=False),
            nn.BatchNorm2d(d[0], momentum=m),
            nn.ReLU(inplace=True),
            nn.Conv2d(d[0], d[0], 3, padding=1, stride=1, groups=d[0], bias=False),
            nn.BatchNorm2d(d[0], momentum=m),
            nn.ReLU(inplace=True),
            nn.Conv2d(d[0], d[1], 1, padding=0, stride=1, bias=False),
            nn.BatchNorm2d(d[1], momentum=m),
            _mnas_stack(d[1], d[2], 3, 2, 3, 3),
            _mnas_stack(d[2], d[3], 5, 2, 3, 3),
            _mnas_stack(d[3], d[4], 5, 2, 6, 3),
            _mnas_stack(d[4], d[5], 3, 1, 6, 2),
            _mnas_stack(d[5], d[6], 5, 2, 6, 4),
            _mnas_stack(d[6], d[7], 3, 1, 6, 1),
            nn.Conv2d(d[7], 1280, 1, padding=0, stride=1, bias=False),
            nn.BatchNorm2d(1280, momentum=m),
            nn.ReLU(inplace=True),
        )
        self.classifier = nn.Sequential(nn.Dropout(p=dropout, inplace=True), nn.Linear(1280, num_classes))

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.layers(x).mean([2, 3]))


def mnasnet0_5(num_classes: int = 1000) -> MNASNet:
    return MNASNet(0.5, num_classes)


def mnasnet0_75(num_classes: int = 1000) -> MNASNet:
    return MNASNet(0.75, num_classes)


def mnasnet1_0(num_classes: int = 1000) -> MNASNet:
    return MNASNet(1.0, num_classes)


def mnasnet1_3(num_classes: int = 1000) -> MNASNet:
    return MNASNet(1.3, num_classes)


# torchvision's names for the building blocks, so structural fingerprints can agree with it
_MnasResidual.__name__ = _MnasResidual.__qualname__ = "_InvertedResidual"

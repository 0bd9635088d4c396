"""torchvision's VGG, in plain PyTorch (see the package's docstring)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

__all__ = ["VGG", "vgg11", "vgg11_bn", "vgg13", "vgg13_bn", "vgg16", "vgg16_bn", "vgg19", "vgg19_bn"]


_VGG_CFGS: dict[str, list[int | str]] = {
    "A": [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    "B": [64, 64, "M", 128, 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    "D": [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"],
    "E": [64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M", 512, 512, 512, 512, "M"],
}


class VGG(nn.Module):
    def __init__(self, features: nn.Module, num_classes: int = 1000, dropout: float = 0.5) -> None:
        super().__init__()
        self.features = features
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        self.classifier = nn.Sequential(
            nn.Linear(512 * 7 * 7, 4096),
            nn.ReLU(True),
            nn.Dropout(p=dropout),
            nn.Linear(4096, 4096),
            nn.ReLU(True),
            nn.Dropout(p=dropout),
            nn.Linear(4096, num_classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        x = self.avgpool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


def _vgg_features(cfg: list[int | str], batch_norm: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    cin = 3
    for v in cfg:
        if v == "M":
            layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
            continue
        layers.append(nn.Conv2d(cin, int(v), kernel_size=3, padding=1))
        if batch_norm:
            layers.append(nn.BatchNorm2d(int(v)))
        layers.append(nn.ReLU(inplace=True))
        cin = int(v)
    return nn.Sequential(*layers)


def _vgg(cfg: str, batch_norm: bool) -> Callable[..., VGG]:
    def build(num_classes: int = 1000) -> VGG:
        return VGG(_vgg_features(_VGG_CFGS[cfg], batch_norm), num_classes)

    return build


vgg11, vgg11_bn = _vgg("A", False), _vgg("A", True)
vgg13, vgg13_bn = _vgg("B", False), _vgg("B", True)
vgg16, vgg16_bn = _vgg("D", False), _vgg("D", True)
vgg19, vgg19_bn = _vgg("E", False), _vgg("E", True)
for _name, _fn in (
    ("vgg11", vgg11),
    ("vgg11_bn", vgg11_bn),
    ("vgg13", vgg13),
    ("vgg13_bn", vgg13_bn),
    ("vgg16", vgg16),
    ("vgg16_bn", vgg16_bn),
    ("vgg19", vgg19),
    ("vgg19_bn", vgg19_bn),
):
    _fn.__name__ = _fn.__qualname__ = _name

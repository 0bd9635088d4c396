"""torchvision's GoogLeNet, in plain PyTorch (see the package's docstring)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

__all__ = ["GoogLeNet", "GoogLeNetOutputs", "googlenet"]


class GoogLeNetOutputs(NamedTuple):
    logits: Tensor
    aux_logits2: Tensor | None
    aux_logits1: Tensor | None


class _BasicConv2d(nn.Module):
    def __init__(self, cin: int, cout: int, **kwargs: Any) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, bias=False, **kwargs)
        self.bn = nn.BatchNorm2d(cout, eps=0.001)

    def forward(self, x: Tensor) -> Tensor:
        return nn.functional.relu(self.bn(self.conv(x)), inplace=True)


class _Inception(nn.Module):
    def __init__(
        self, cin: int, ch1x1: int, ch3x3red: int, ch3x3: int, ch5x5red: int, ch5x5: int, pool_proj: int
    ) -> None:
        super().__init__()
        self.branch1 = _BasicConv2d(cin, ch1x1, kernel_size=1)
        self.branch2 = nn.Sequential(
            _BasicConv2d(cin, ch3x3red, kernel_size=1), _BasicConv2d(ch3x3red, ch3x3, kernel_size=3, padding=1)
        )
        # torchvision uses a 3x3 kernel in the "5x5" branch (a known quirk kept for its weights)
        self.branch3 = nn.Sequential(
            _BasicConv2d(cin, ch5x5red, kernel_size=1), _BasicConv2d(ch5x5red, ch5x5, kernel_size=3, padding=1)
        )
        self.branch4 = nn.Sequential(
            nn.MaxPool2d(kernel_size=3, stride=1, padding=1, ceil_mode=True),
            _BasicConv2d(cin, pool_proj, kernel_size=1),
        )

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([self.branch1(x), self.branch2(x), self.branch3(x), self.branch4(x)], 1)


class _InceptionAux(nn.Module):
    def __init__(self, cin: int, num_classes: int, dropout: float = 0.7) -> None:
        super().__init__()
        self.conv = _BasicConv2d(cin, 128, kernel_size=1)
        self.fc1 = nn.Linear(2048, 1024)
        self.fc2 = nn.Linear(1024, num_classes)
        self.dropout = nn.Dropout(p=dropout)

    def forward(self, x: Tensor) -> Tensor:
        x = self.conv(nn.functional.adaptive_avg_pool2d(x, (4, 4)))
        x = self.dropout(nn.functional.relu(self.fc1(torch.flatten(x, 1)), inplace=True))
        return self.fc2(x)


class GoogLeNet(nn.Module):
    """With auxiliary classifiers (torchvision's default without weights): in training mode the
    forward returns ``GoogLeNetOutputs(logits, aux_logits2, aux_logits1)``, in eval the logits."""

    def __init__(
        self, num_classes: int = 1000, aux_logits: bool = True, dropout: float = 0.2, dropout_aux: float = 0.7
    ) -> None:
        super().__init__()
        self.aux_logits = aux_logits
        self.conv1 = _BasicConv2d(3, 64, kernel_size=7, stride=2, padding=3)
        self.maxpool1 = nn.MaxPool2d(3, stride=2, ceil_mode=True)
        self.conv2 = _BasicConv2d(64, 64, kernel_size=1)
        self.conv3 = _BasicConv2d(64, 192, kernel_size=3, padding=1)
        self.maxpool2 = nn.MaxPool2d(3, stride=2, ceil_mode=True)
        self.inception3a = _Inception(192, 64, 96, 128, 16, 32, 32)
        self.inception3b = _Inception(256, 128, 128, 192, 32, 96, 64)
        self.maxpool3 = nn.MaxPool2d(3, stride=2, ceil_mode=True)
        self.inception4a = _Inception(480, 192, 96, 208, 16, 48, 64)
        self.inception4b = _Inception(512, 160, 112, 224, 24, 64, 64)
        self.inception4c = _Inception(512, 128, 128, 256, 24, 64, 64)
        self.inception4d = _Inception(512, 112, 144, 288, 32, 64, 64)
        self.inception4e = _Inception(528, 256, 160, 320, 32, 128, 128)
        self.maxpool4 = nn.MaxPool2d(2, stride=2, ceil_mode=True)
        self.inception5a = _Inception(832, 256, 160, 320, 32, 128, 128)
        self.inception5b = _Inception(832, 384, 192, 384, 48, 128, 128)
        if aux_logits:
            self.aux1: nn.Module | None = _InceptionAux(512, num_classes, dropout_aux)
            self.aux2: nn.Module | None = _InceptionAux(528, num_classes, dropout_aux)
        else:
            self.aux1 = self.aux2 = None
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.dropout = nn.Dropout(p=dropout)
        self.fc = nn.Linear(1024, num_classes)

    def forward(self, x: Tensor) -> GoogLeNetOutputs | Tensor:
        x = self.maxpool1(self.conv1(x))
        x = self.maxpool2(self.conv3(self.conv2(x)))
        x = self.maxpool3(self.inception3b(self.inception3a(x)))
        x = self.inception4a(x)
        aux1 = self.aux1(x) if self.aux1 is not None and self.training else None
        x = self.inception4d(self.inception4c(self.inception4b(x)))
        aux2 = self.aux2(x) if self.aux2 is not None and self.training else None
        x = self.maxpool4(self.inception4e(x))
        x = self.inception5b(self.inception5a(x))
        x = self.fc(self.dropout(torch.flatten(self.avgpool(x), 1)))
        if self.training and self.aux_logits:
            return GoogLeNetOutputs(x, aux2, aux1)
        return x


def googlenet(num_classes: int = 1000) -> GoogLeNet:
    return GoogLeNet(num_classes=num_classes)


# torchvision's names for the building blocks, so structural fingerprints can agree with it
_BasicConv2d.__name__ = _BasicConv2d.__qualname__ = "BasicConv2d"
_Inception.__name__ = _Inception.__qualname__ = "Inception"
_InceptionAux.__name__ = _InceptionAux.__qualname__ = "InceptionAux"

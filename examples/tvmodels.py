"""Plain-PyTorch re-implementations of the 36 torchvision architectures of the profile database.

torchvision cannot be imported with the CPU build of torch on these machines, so tests, examples
and benchmarks build their models from here. Class names, submodule names and parameter counts
equal torchvision's (checked against the shipped db/data/models.csv by tests/test_identify.py), so a
model from here is recognised exactly like the real one. No gpemu import: this is ordinary user
code.

    from examples.tvmodels import resnet50
    model = resnet50(num_classes=1000)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

__all__ = [
    "AlexNet",
    "alexnet",
    "ResNet",
    "BasicBlock",
    "Bottleneck",
    "resnet18",
    "resnet34",
    "resnet50",
    "resnet101",
    "resnet152",
    "resnext50_32x4d",
    "resnext101_32x8d",
    "wide_resnet50_2",
    "wide_resnet101_2",
    "VGG",
    "vgg11",
    "vgg11_bn",
    "vgg13",
    "vgg13_bn",
    "vgg16",
    "vgg16_bn",
    "vgg19",
    "vgg19_bn",
    "MobileNetV2",
    "mobilenet_v2",
    "SqueezeNet",
    "squeezenet1_0",
    "squeezenet1_1",
    "DenseNet",
    "densenet121",
    "densenet161",
    "densenet169",
    "densenet201",
    "ShuffleNetV2",
    "shufflenet_v2_x0_5",
    "shufflenet_v2_x1_0",
    "shufflenet_v2_x1_5",
    "shufflenet_v2_x2_0",
    "MNASNet",
    "mnasnet0_5",
    "mnasnet0_75",
    "mnasnet1_0",
    "mnasnet1_3",
    "MobileNetV3",
    "mobilenet_v3_large",
    "mobilenet_v3_small",
    "GoogLeNet",
    "GoogLeNetOutputs",
    "googlenet",
    "MODELS",
]


# ----------------------------------------------------------------------------- AlexNet
class AlexNet(nn.Module):
    def __init__(self, num_classes: int = 1000, dropout: float = 0.5) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 64, kernel_size=11, stride=4, padding=2),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),
            nn.Conv2d(64, 192, kernel_size=5, padding=2),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),
            nn.Conv2d(192, 384, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(384, 256, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(256, 256, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),
        )
        self.avgpool = nn.AdaptiveAvgPool2d((6, 6))
        self.classifier = nn.Sequential(
            nn.Dropout(p=dropout),
            nn.Linear(256 * 6 * 6, 4096),
            nn.ReLU(inplace=True),
            nn.Dropout(p=dropout),
            nn.Linear(4096, 4096),
            nn.ReLU(inplace=True),
            nn.Linear(4096, num_classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        x = self.avgpool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


def alexnet(num_classes: int = 1000) -> AlexNet:
    return AlexNet(num_classes=num_classes)


# ----------------------------------------------------------------------------- ResNet
def _conv3x3(cin: int, cout: int, stride: int = 1, groups: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, kernel_size=3, stride=stride, padding=1, groups=groups, bias=False)


def _conv1x1(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, kernel_size=1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(
        self,
        inplanes: int,
        planes: int,
        stride: int = 1,
        downsample: nn.Module | None = None,
        groups: int = 1,
        base_width: int = 64,
    ) -> None:
        super().__init__()
        self.conv1 = _conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = _conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(
        self,
        inplanes: int,
        planes: int,
        stride: int = 1,
        downsample: nn.Module | None = None,
        groups: int = 1,
        base_width: int = 64,
    ) -> None:
        super().__init__()
        width = int(planes * (base_width / 64.0)) * groups
        self.conv1 = _conv1x1(inplanes, width)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = _conv3x3(width, width, stride, groups)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = _conv1x1(width, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    def __init__(
        self,
        block: type[BasicBlock] | type[Bottleneck],
        layers: list[int],
        num_classes: int = 1000,
        groups: int = 1,
        width_per_group: int = 64,
    ) -> None:
        super().__init__()
        self.inplanes = 64
        self.groups = groups
        self.base_width = width_per_group
        self.conv1 = nn.Conv2d(3, 64, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(block, 64, layers[0])
        self.layer2 = self._make_layer(block, 128, layers[1], stride=2)
        self.layer3 = self._make_layer(block, 256, layers[2], stride=2)
        self.layer4 = self._make_layer(block, 512, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512 * block.expansion, num_classes)

    def _make_layer(self, block, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(
                _conv1x1(self.inplanes, planes * block.expansion, stride), nn.BatchNorm2d(planes * block.expansion)
            )
        layers = [block(self.inplanes, planes, stride, downsample, self.groups, self.base_width)]
        self.inplanes = planes * block.expansion
        layers += [
            block(self.inplanes, planes, groups=self.groups, base_width=self.base_width) for _ in range(1, blocks)
        ]
        return nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18(num_classes: int = 1000) -> ResNet:
    return ResNet(BasicBlock, [2, 2, 2, 2], num_classes)


def resnet34(num_classes: int = 1000) -> ResNet:
    return ResNet(BasicBlock, [3, 4, 6, 3], num_classes)


def resnet50(num_classes: int = 1000) -> ResNet:
    return ResNet(Bottleneck, [3, 4, 6, 3], num_classes)


def resnet101(num_classes: int = 1000) -> ResNet:
    return ResNet(Bottleneck, [3, 4, 23, 3], num_classes)


def resnet152(num_classes: int = 1000) -> ResNet:
    return ResNet(Bottleneck, [3, 8, 36, 3], num_classes)


def resnext50_32x4d(num_classes: int = 1000) -> ResNet:
    return ResNet(Bottleneck, [3, 4, 6, 3], num_classes, groups=32, width_per_group=4)


def resnext101_32x8d(num_classes: int = 1000) -> ResNet:
    return ResNet(Bottleneck, [3, 4, 23, 3], num_classes, groups=32, width_per_group=8)


def wide_resnet50_2(num_classes: int = 1000) -> ResNet:
    return ResNet(Bottleneck, [3, 4, 6, 3], num_classes, width_per_group=128)


def wide_resnet101_2(num_classes: int = 1000) -> ResNet:
    return ResNet(Bottleneck, [3, 4, 23, 3], num_classes, width_per_group=128)


# ----------------------------------------------------------------------------- VGG
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


# ----------------------------------------------------------------------------- MobileNetV2
def _make_divisible(v: float, divisor: int = 8) -> int:
    new_v = max(divisor, int(v + divisor / 2) // divisor * divisor)
    if new_v < 0.9 * v:  # never round down by more than 10%
        new_v += divisor
    return new_v


class _ConvBNReLU6(nn.Sequential):
    def __init__(self, cin: int, cout: int, kernel_size: int = 3, stride: int = 1, groups: int = 1) -> None:
        super().__init__(
            nn.Conv2d(cin, cout, kernel_size, stride, (kernel_size - 1) // 2, groups=groups, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU6(inplace=True),
        )


class InvertedResidual(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, expand_ratio: int) -> None:
        super().__init__()
        hidden = int(round(cin * expand_ratio))
        self.use_res_connect = stride == 1 and cin == cout
        layers: list[nn.Module] = []
        if expand_ratio != 1:
            layers.append(_ConvBNReLU6(cin, hidden, kernel_size=1))
        layers += [
            _ConvBNReLU6(hidden, hidden, stride=stride, groups=hidden),
            nn.Conv2d(hidden, cout, 1, 1, 0, bias=False),
            nn.BatchNorm2d(cout),
        ]
        self.conv = nn.Sequential(*layers)
        self.out_channels = cout

    def forward(self, x: Tensor) -> Tensor:
        return x + self.conv(x) if self.use_res_connect else self.conv(x)


class MobileNetV2(nn.Module):
    def __init__(self, num_classes: int = 1000, width_mult: float = 1.0, dropout: float = 0.2) -> None:
        super().__init__()
        settings = [
            [1, 16, 1, 1],
            [6, 24, 2, 2],
            [6, 32, 3, 2],
            [6, 64, 4, 2],
            [6, 96, 3, 1],
            [6, 160, 3, 2],
            [6, 320, 1, 1],
        ]
        cin = _make_divisible(32 * width_mult)
        self.last_channel = _make_divisible(1280 * max(1.0, width_mult))
        features: list[nn.Module] = [_ConvBNReLU6(3, cin, stride=2)]
        for t, c, n, s in settings:
            cout = _make_divisible(c * width_mult)
            for i in range(n):
                features.append(InvertedResidual(cin, cout, s if i == 0 else 1, t))
                cin = cout
        features.append(_ConvBNReLU6(cin, self.last_channel, kernel_size=1))
        self.features = nn.Sequential(*features)
        self.classifier = nn.Sequential(nn.Dropout(p=dropout), nn.Linear(self.last_channel, num_classes))

    def forward(self, x: Tensor) -> Tensor:
        x = nn.functional.adaptive_avg_pool2d(self.features(x), (1, 1))
        return self.classifier(torch.flatten(x, 1))


def mobilenet_v2(num_classes: int = 1000) -> MobileNetV2:
    return MobileNetV2(num_classes=num_classes)


# ----------------------------------------------------------------------------- SqueezeNet
class Fire(nn.Module):
    def __init__(self, cin: int, squeeze: int, expand1x1: int, expand3x3: int) -> None:
        super().__init__()
        self.squeeze = nn.Conv2d(cin, squeeze, kernel_size=1)
        self.squeeze_activation = nn.ReLU(inplace=True)
        self.expand1x1 = nn.Conv2d(squeeze, expand1x1, kernel_size=1)
        self.expand1x1_activation = nn.ReLU(inplace=True)
        self.expand3x3 = nn.Conv2d(squeeze, expand3x3, kernel_size=3, padding=1)
        self.expand3x3_activation = nn.ReLU(inplace=True)

    def forward(self, x: Tensor) -> Tensor:
        x = self.squeeze_activation(self.squeeze(x))
        return torch.cat(
            [self.expand1x1_activation(self.expand1x1(x)), self.expand3x3_activation(self.expand3x3(x))], 1
        )


class SqueezeNet(nn.Module):
    def __init__(self, version: str = "1_0", num_classes: int = 1000, dropout: float = 0.5) -> None:
        super().__init__()
        self.num_classes = num_classes
        pool = lambda: nn.MaxPool2d(kernel_size=3, stride=2, ceil_mode=True)  # noqa: E731
        if version == "1_0":
            self.features = nn.Sequential(
                nn.Conv2d(3, 96, kernel_size=7, stride=2),
                nn.ReLU(inplace=True),
                pool(),
                Fire(96, 16, 64, 64),
                Fire(128, 16, 64, 64),
                Fire(128, 32, 128, 128),
                pool(),
                Fire(256, 32, 128, 128),
                Fire(256, 48, 192, 192),
                Fire(384, 48, 192, 192),
                Fire(384, 64, 256, 256),
                pool(),
                Fire(512, 64, 256, 256),
            )
        elif version == "1_1":
            self.features = nn.Sequential(
                nn.Conv2d(3, 64, kernel_size=3, stride=2),
                nn.ReLU(inplace=True),
                pool(),
                Fire(64, 16, 64, 64),
                Fire(128, 16, 64, 64),
                pool(),
                Fire(128, 32, 128, 128),
                Fire(256, 32, 128, 128),
                pool(),
                Fire(256, 48, 192, 192),
                Fire(384, 48, 192, 192),
                Fire(384, 64, 256, 256),
                Fire(512, 64, 256, 256),
            )
        else:
            raise ValueError(f"SqueezeNet version must be '1_0' or '1_1', got {version!r}")
        self.classifier = nn.Sequential(
            nn.Dropout(p=dropout),
            nn.Conv2d(512, num_classes, kernel_size=1),
            nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d((1, 1)),
        )

    def forward(self, x: Tensor) -> Tensor:
        return torch.flatten(self.classifier(self.features(x)), 1)


def squeezenet1_0(num_classes: int = 1000) -> SqueezeNet:
    return SqueezeNet("1_0", num_classes)


def squeezenet1_1(num_classes: int = 1000) -> SqueezeNet:
    return SqueezeNet("1_1", num_classes)


# ----------------------------------------------------------------------------- DenseNet
class _DenseLayer(nn.Module):
    def __init__(self, num_input_features: int, growth_rate: int, bn_size: int) -> None:
        super().__init__()
        self.norm1 = nn.BatchNorm2d(num_input_features)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv1 = nn.Conv2d(num_input_features, bn_size * growth_rate, kernel_size=1, stride=1, bias=False)
        self.norm2 = nn.BatchNorm2d(bn_size * growth_rate)
        self.relu2 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(bn_size * growth_rate, growth_rate, kernel_size=3, stride=1, padding=1, bias=False)

    def forward(self, features: list[Tensor]) -> Tensor:
        x = torch.cat(features, 1)
        x = self.conv1(self.relu1(self.norm1(x)))
        return self.conv2(self.relu2(self.norm2(x)))


class _DenseBlock(nn.ModuleDict):
    def __init__(self, num_layers: int, num_input_features: int, bn_size: int, growth_rate: int) -> None:
        super().__init__()
        for i in range(num_layers):
            self.add_module(
                f"denselayer{i + 1}", _DenseLayer(num_input_features + i * growth_rate, growth_rate, bn_size)
            )

    def forward(self, init_features: Tensor) -> Tensor:
        features = [init_features]
        for layer in self.values():
            features.append(layer(features))
        return torch.cat(features, 1)


class _Transition(nn.Sequential):
    def __init__(self, num_input_features: int, num_output_features: int) -> None:
        super().__init__()
        self.norm = nn.BatchNorm2d(num_input_features)
        self.relu = nn.ReLU(inplace=True)
        self.conv = nn.Conv2d(num_input_features, num_output_features, kernel_size=1, stride=1, bias=False)
        self.pool = nn.AvgPool2d(kernel_size=2, stride=2)


class DenseNet(nn.Module):
    def __init__(
        self,
        growth_rate: int = 32,
        block_config: tuple[int, ...] = (6, 12, 24, 16),
        num_init_features: int = 64,
        bn_size: int = 4,
        num_classes: int = 1000,
    ) -> None:
        super().__init__()
        self.features = nn.Sequential()
        self.features.add_module(
            "conv0", nn.Conv2d(3, num_init_features, kernel_size=7, stride=2, padding=3, bias=False)
        )
        self.features.add_module("norm0", nn.BatchNorm2d(num_init_features))
        self.features.add_module("relu0", nn.ReLU(inplace=True))
        self.features.add_module("pool0", nn.MaxPool2d(kernel_size=3, stride=2, padding=1))
        n = num_init_features
        for i, num_layers in enumerate(block_config):
            self.features.add_module(f"denseblock{i + 1}", _DenseBlock(num_layers, n, bn_size, growth_rate))
            n += num_layers * growth_rate
            if i != len(block_config) - 1:
                self.features.add_module(f"transition{i + 1}", _Transition(n, n // 2))
                n //= 2
        self.features.add_module("norm5", nn.BatchNorm2d(n))
        self.classifier = nn.Linear(n, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = nn.functional.relu(self.features(x), inplace=True)
        x = torch.flatten(nn.functional.adaptive_avg_pool2d(x, (1, 1)), 1)
        return self.classifier(x)


def densenet121(num_classes: int = 1000) -> DenseNet:
    return DenseNet(32, (6, 12, 24, 16), 64, num_classes=num_classes)


def densenet161(num_classes: int = 1000) -> DenseNet:
    return DenseNet(48, (6, 12, 36, 24), 96, num_classes=num_classes)


def densenet169(num_classes: int = 1000) -> DenseNet:
    return DenseNet(32, (6, 12, 32, 32), 64, num_classes=num_classes)


def densenet201(num_classes: int = 1000) -> DenseNet:
    return DenseNet(32, (6, 12, 48, 32), 64, num_classes=num_classes)


# ----------------------------------------------------------------------------- ShuffleNetV2
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


# ----------------------------------------------------------------------------- MNASNet
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


# ----------------------------------------------------------------------------- MobileNetV3
class _ConvNormAct(nn.Sequential):
    def __init__(
        self,
        cin: int,
        cout: int,
        kernel_size: int = 3,
        stride: int = 1,
        groups: int = 1,
        activation: type[nn.Module] | None = nn.ReLU,
    ) -> None:
        layers: list[nn.Module] = [
            nn.Conv2d(cin, cout, kernel_size, stride, (kernel_size - 1) // 2, groups=groups, bias=False),
            nn.BatchNorm2d(cout, eps=0.001, momentum=0.01),
        ]
        if activation is not None:
            layers.append(activation(inplace=True))
        super().__init__(*layers)


class _SqueezeExcitation(nn.Module):
    def __init__(self, channels: int, squeeze: int) -> None:
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(channels, squeeze, 1)
        self.fc2 = nn.Conv2d(squeeze, channels, 1)
        self.activation = nn.ReLU()
        self.scale_activation = nn.Hardsigmoid()

    def forward(self, x: Tensor) -> Tensor:
        scale = self.scale_activation(self.fc2(self.activation(self.fc1(self.avgpool(x)))))
        return scale * x


class _InvertedResidualV3(nn.Module):
    def __init__(self, cin: int, k: int, expanded: int, cout: int, use_se: bool, act: str, stride: int) -> None:
        super().__init__()
        activation = nn.Hardswish if act == "HS" else nn.ReLU
        self.use_res_connect = stride == 1 and cin == cout
        layers: list[nn.Module] = []
        if expanded != cin:
            layers.append(_ConvNormAct(cin, expanded, 1, activation=activation))
        layers.append(_ConvNormAct(expanded, expanded, k, stride, groups=expanded, activation=activation))
        if use_se:
            layers.append(_SqueezeExcitation(expanded, _make_divisible(expanded // 4, 8)))
        layers.append(_ConvNormAct(expanded, cout, 1, activation=None))
        self.block = nn.Sequential(*layers)
        self.out_channels = cout

    def forward(self, x: Tensor) -> Tensor:
        return x + self.block(x) if self.use_res_connect else self.block(x)


_V3_LARGE = [
    (16, 3, 16, 16, False, "RE", 1),
    (16, 3, 64, 24, False, "RE", 2),
    (24, 3, 72, 24, False, "RE", 1),
    (24, 5, 72, 40, True, "RE", 2),
    (40, 5, 120, 40, True, "RE", 1),
    (40, 5, 120, 40, True, "RE", 1),
    (40, 3, 240, 80, False, "HS", 2),
    (80, 3, 200, 80, False, "HS", 1),
    (80, 3, 184, 80, False, "HS", 1),
    (80, 3, 184, 80, False, "HS", 1),
    (80, 3, 480, 112, True, "HS", 1),
    (112, 3, 672, 112, True, "HS", 1),
    (112, 5, 672, 160, True, "HS", 2),
    (160, 5, 960, 160, True, "HS", 1),
    (160, 5, 960, 160, True, "HS", 1),
]
_V3_SMALL = [
    (16, 3, 16, 16, True, "RE", 2),
    (16, 3, 72, 24, False, "RE", 2),
    (24, 3, 88, 24, False, "RE", 1),
    (24, 5, 96, 40, True, "HS", 2),
    (40, 5, 240, 40, True, "HS", 1),
    (40, 5, 240, 40, True, "HS", 1),
    (40, 5, 120, 48, True, "HS", 1),
    (48, 5, 144, 48, True, "HS", 1),
    (48, 5, 288, 96, True, "HS", 2),
    (96, 5, 576, 96, True, "HS", 1),
    (96, 5, 576, 96, True, "HS", 1),
]


class MobileNetV3(nn.Module):
    def __init__(self, setting: list[tuple], last_channel: int, num_classes: int = 1000, dropout: float = 0.2) -> None:
        super().__init__()
        layers: list[nn.Module] = [_ConvNormAct(3, setting[0][0], 3, 2, activation=nn.Hardswish)]
        layers += [_InvertedResidualV3(*cnf) for cnf in setting]
        last_in = setting[-1][3]
        layers.append(_ConvNormAct(last_in, 6 * last_in, 1, activation=nn.Hardswish))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(
            nn.Linear(6 * last_in, last_channel),
            nn.Hardswish(inplace=True),
            nn.Dropout(p=dropout, inplace=True),
            nn.Linear(last_channel, num_classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def mobilenet_v3_large(num_classes: int = 1000) -> MobileNetV3:
    return MobileNetV3(_V3_LARGE, 1280, num_classes)


def mobilenet_v3_small(num_classes: int = 1000) -> MobileNetV3:
    return MobileNetV3(_V3_SMALL, 1024, num_classes)


# ----------------------------------------------------------------------------- GoogLeNet
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
_ShuffleUnit.__name__ = _ShuffleUnit.__qualname__ = "InvertedResidual"
_MnasResidual.__name__ = _MnasResidual.__qualname__ = "_InvertedResidual"
_ConvBNReLU6.__name__ = _ConvBNReLU6.__qualname__ = "Conv2dNormActivation"
_ConvNormAct.__name__ = _ConvNormAct.__qualname__ = "Conv2dNormActivation"
_SqueezeExcitation.__name__ = _SqueezeExcitation.__qualname__ = "SqueezeExcitation"
_InvertedResidualV3.__name__ = _InvertedResidualV3.__qualname__ = "InvertedResidual"
_BasicConv2d.__name__ = _BasicConv2d.__qualname__ = "BasicConv2d"
_Inception.__name__ = _Inception.__qualname__ = "Inception"
_InceptionAux.__name__ = _InceptionAux.__qualname__ = "InceptionAux"

# name -> builder, for tests and benchmarks that iterate over what exists here
MODELS: dict[str, Callable[..., nn.Module]] = {
    fn.__name__: fn
    for fn in (
        alexnet,
        resnet18,
        resnet34,
        resnet50,
        resnet101,
        resnet152,
        resnext50_32x4d,
        resnext101_32x8d,
        wide_resnet50_2,
        wide_resnet101_2,
        vgg11,
        vgg11_bn,
        vgg13,
        vgg13_bn,
        vgg16,
        vgg16_bn,
        vgg19,
        vgg19_bn,
        mobilenet_v2,
        squeezenet1_0,
        squeezenet1_1,
        densenet121,
        densenet161,
        densenet169,
        densenet201,
        shufflenet_v2_x0_5,
        shufflenet_v2_x1_0,
        shufflenet_v2_x1_5,
        shufflenet_v2_x2_0,
        mnasnet0_5,
        mnasnet0_75,
        mnasnet1_0,
        mnasnet1_3,
        mobilenet_v3_large,
        mobilenet_v3_small,
        googlenet,
    )
}

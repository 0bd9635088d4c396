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

from torch import nn

from .alexnet import AlexNet, alexnet
from .densenet import DenseNet, densenet121, densenet161, densenet169, densenet201
from .googlenet import GoogLeNet, GoogLeNetOutputs, googlenet
from .mnasnet import MNASNet, mnasnet0_5, mnasnet0_75, mnasnet1_0, mnasnet1_3
from .mobilenet import MobileNetV2, MobileNetV3, mobilenet_v2, mobilenet_v3_large, mobilenet_v3_small
from .resnet import (
    BasicBlock,
    Bottleneck,
    ResNet,
    resnet18,
    resnet34,
    resnet50,
    resnet101,
    resnet152,
    resnext50_32x4d,
    resnext101_32x8d,
    wide_resnet50_2,
    wide_resnet101_2,
)
from .shufflenet import ShuffleNetV2, shufflenet_v2_x0_5, shufflenet_v2_x1_0, shufflenet_v2_x1_5, shufflenet_v2_x2_0
from .squeezenet import SqueezeNet, squeezenet1_0, squeezenet1_1
from .vgg import VGG, vgg11, vgg11_bn, vgg13, vgg13_bn, vgg16, vgg16_bn, vgg19, vgg19_bn

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

# name -> builder, for tests and benchmarks that iterate over what exists here: the lower-case
# names of __all__ (the classes are capitalised)
MODELS: dict[str, Callable[..., nn.Module]] = {name: globals()[name] for name in __all__ if name[0].islower()}

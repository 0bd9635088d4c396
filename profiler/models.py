"""Loading the models to profile, and making input batches for them.

A model is named either by its torchvision name (``resnet50``; needs an importable torchvision)
or by a factory ``module:callable`` (``mypkg.models:build_net``), optionally given a dataset name
with ``NAME=module:callable``. A factory returns either an ``nn.Module`` (inputs are then random
tensors of ``input_shape``/``input_dtype``) or ``(module, sample_batch)``, where the sample batch's
per-sample shape and dtype decide the inputs. Factories that take ``num_classes`` get it.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gpemu.identify import structural_fingerprint

__all__ = [
    "ModelSpecError",
    "LoadedModel",
    "load_model",
    "parse_input_shape",
    "parse_dtype",
    "structural_fingerprint",
    "model_name_of",
]


class ModelSpecError(ValueError):
    """A model specification that cannot be loaded; the message says what is valid."""


_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float64": torch.float64,
    "double": torch.float64,
    "int64": torch.int64,
    "long": torch.int64,
    "int32": torch.int32,
}
_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")


def parse_dtype(text: str) -> torch.dtype:
    """``'float32'`` -> ``torch.float32``; one clear error for anything else."""
    try:
        return _DTYPES[text.strip().lower().removeprefix("torch.")]
    except KeyError:
        raise ModelSpecError(f"unknown input dtype {text!r}; valid: {', '.join(sorted(_DTYPES))}") from None


def parse_input_shape(text: str) -> tuple[int, ...]:
    """``'3,224,224'`` -> ``(3, 224, 224)``: the shape of one sample, without the batch dimension."""
    try:
        shape = tuple(int(x) for x in text.replace("x", ",").split(",") if x.strip())
    except ValueError:
        shape = ()
    if not shape or any(d < 1 for d in shape):
        raise ModelSpecError(
            f"input shape must be positive whole numbers separated by commas (one sample, no batch "
            f"dimension), e.g. '3,224,224'; got {text!r}"
        )
    return shape


def model_name_of(spec: str) -> str:
    """The dataset name a model specification is stored under."""
    spec = spec.strip()
    if "=" in spec:
        return spec.split("=", 1)[0].strip()
    if ":" in spec:
        return spec.rsplit(":", 1)[1].strip()
    return spec


@dataclass
class LoadedModel:
    """A model ready to measure: the module (on the host) and how to make a batch for it."""

    name: str
    spec: str
    module: nn.Module
    sample_shape: tuple[int, ...]
    input_dtype: torch.dtype
    num_classes: int | None
    input_high: int = 1000  # exclusive upper bound of random integer inputs (token ids)

    def make_batch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A host batch (inputs, targets); targets are class ids when the model is a classifier."""
        shape = (batch_size, *self.sample_shape)
        if self.input_dtype.is_floating_point:
            inputs = torch.randn(shape, dtype=torch.float32).to(self.input_dtype)
        else:
            inputs = torch.randint(0, self.input_high, shape, dtype=self.input_dtype)
        targets = None
        if self.num_classes:
            targets = torch.randint(0, self.num_classes, (batch_size,), dtype=torch.int64)
        return inputs, targets

    def loss(self, output: Any, targets: torch.Tensor | None) -> torch.Tensor:
        """Cross entropy for a classifier's (N, C) logits; otherwise the mean of the output
        (backward then touches every parameter that the output depends on, like a real loss)."""
        if isinstance(output, (tuple, list)):
            output = output[0]
        elif isinstance(output, dict):
            output = next(iter(output.values()))
        if not isinstance(output, torch.Tensor):
            raise ModelSpecError(
                f"model {self.name!r} returned {type(output).__name__}; the profiler needs a tensor "
                f"(or a tuple/dict whose first item is one) to take a loss"
            )
        if targets is not None and output.dim() == 2 and output.shape[1] == self.num_classes:
            return nn.functional.cross_entropy(output.float(), targets.to(output.device))
        return output.float().mean()


def load_model(
    spec: str,
    input_shape: tuple[int, ...] | None = None,
    input_dtype: torch.dtype = torch.float32,
    num_classes: int | None = None,
) -> LoadedModel:
    """Build the model named by ``spec`` on the host (see module docs for the forms)."""
    spec = spec.strip()
    if not spec:
        raise ModelSpecError("empty model name; give a torchvision name (resnet50) or module:callable")
    name = model_name_of(spec)
    target = spec.split("=", 1)[1].strip() if "=" in spec else spec
    if not name or not _NAME_RE.match(name):
        raise ModelSpecError(f"model name {name!r} may only use letters, digits, '_', '.', '-'")
    if ":" in target:
        module, sample = _from_factory(target, num_classes)
    else:
        module, sample = _from_torchvision(target, num_classes), None
    if not isinstance(module, nn.Module):
        raise ModelSpecError(f"{target!r} built a {type(module).__name__}, not a torch.nn.Module")
    input_high = 1000
    if sample is not None:
        if isinstance(sample, (tuple, list)):
            sample = sample[0]
        if not isinstance(sample, torch.Tensor) or sample.dim() < 1:
            raise ModelSpecError(f"{target!r} returned a sample batch that is not a batched tensor")
        sample_shape, dtype = tuple(sample.shape[1:]), sample.dtype
        if not dtype.is_floating_point and sample.numel():
            input_high = int(sample.max().item()) + 1
    else:
        if input_shape is None:
            input_shape = (3, 224, 224)
        sample_shape, dtype = tuple(input_shape), input_dtype
    if num_classes is None:
        num_classes = _guess_num_classes(module)
    return LoadedModel(
        name=name,
        spec=spec,
        module=module,
        sample_shape=sample_shape,
        input_dtype=dtype,
        num_classes=num_classes,
        input_high=max(input_high, 1),
    )


def _from_factory(target: str, num_classes: int | None) -> tuple[Any, Any]:
    mod_name, _, attr = target.rpartition(":")
    mod = _import_user_module(mod_name, target)
    factory: Callable[..., Any] | None = mod
    for part in attr.split("."):
        factory = getattr(factory, part, None)
    if not callable(factory):
        raise ModelSpecError(f"{mod_name!r} has no callable {attr!r} (expected module:callable)")
    kwargs: dict[str, Any] = {}
    if num_classes is not None:
        try:
            params: Mapping[str, inspect.Parameter] = inspect.signature(factory).parameters
        except (TypeError, ValueError):
            params = {}
        if "num_classes" in params or any(p.kind is p.VAR_KEYWORD for p in params.values()):
            kwargs["num_classes"] = num_classes
    built = factory(**kwargs)
    if isinstance(built, tuple):
        if len(built) != 2:
            raise ModelSpecError(f"{target!r} must return a module or (module, sample_batch), got a {len(built)}-tuple")
        return built[0], built[1]
    return built, None


def _import_user_module(mod_name: str, target: str) -> Any:
    """Import the factory's module; like ``python -m``, the current directory counts.

    The ``gpemu`` console script puts its own directory first on ``sys.path``, not the current
    one, so ``--model mymodels:build`` with ``mymodels.py`` right here would not import."""
    import os
    import sys

    top = mod_name.split(".", 1)[0]
    try:
        return importlib.import_module(mod_name)
    except ModuleNotFoundError as exc:
        here = os.getcwd()
        local = os.path.exists(os.path.join(here, top + ".py")) or os.path.isdir(os.path.join(here, top))
        if exc.name != top or not local or here in sys.path:
            raise ModelSpecError(
                f"cannot import module {mod_name!r} for model {target!r}: {exc}; run gpemu from the directory "
                f"that holds {top}.py (or its package), or add that directory to PYTHONPATH"
            ) from None
        sys.path.insert(0, here)
    except ImportError as exc:
        raise ModelSpecError(f"cannot import module {mod_name!r} for model {target!r}: {exc}") from exc
    try:
        return importlib.import_module(mod_name)
    except ImportError as exc:
        raise ModelSpecError(
            f"cannot import module {mod_name!r} for model {target!r} (from {os.getcwd()}): {exc}"
        ) from exc


def _from_torchvision(name: str, num_classes: int | None) -> nn.Module:
    try:  # (an optional dependency: imported by name, so the type checker needs no stubs of it)
        tvm = importlib.import_module("torchvision.models")
    except Exception as exc:  # ImportError, or the CUDA-less build's OSError/RuntimeError
        raise ModelSpecError(
            f"model {name!r} looks like a torchvision name, but torchvision cannot be imported here "
            f"({type(exc).__name__}: {exc}); install torchvision, or give a factory as "
            f"module:callable (e.g. mypkg.models:build_net)"
        ) from exc
    kwargs: dict[str, Any] = {"weights": None}
    if num_classes is not None:
        kwargs["num_classes"] = num_classes
    try:
        return tvm.get_model(name, **kwargs)
    except (ValueError, KeyError) as exc:
        valid = ", ".join(sorted(tvm.list_models())[:40])
        raise ModelSpecError(f"torchvision has no model {name!r}; some valid names: {valid}, ...") from exc


def _guess_num_classes(module: nn.Module) -> int | None:
    """The out_features of the last Linear layer: a classifier's class count, as a guess."""
    last = None
    for m in module.modules():
        if isinstance(m, nn.Linear):
            last = m
    return last.out_features if last is not None else None

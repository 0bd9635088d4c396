"""torchtitan's own Llama 3.1 configurations, made runnable offline for benchmarks/titan_targets.py.

torchtitan's configurations are Python functions (``--module M --config F``; its
``torchtitan/config/README.md`` asks for one's own function instead of CLI flags, kept in one's own
module). Each function here starts from torchtitan's ``llama3_8b`` / ``llama3_70b`` / ``llama3_405b``
(model, local batch, sequence length, activation checkpointing, optimizer, TP degree unchanged)
and changes only what this machine cannot have: the tokenizer and data set are the test ones
torchtitan ships (``tests/assets/tokenizer``, ``c4_test``: no download; the model keeps its own
128,256-token vocabulary), no profiler, TensorBoard, checkpoints or validation, 10 steps. The
405B run adds the pipeline the target names (8 stages, 1F1B, as torchtitan's published 512-GPU
row) and turns off what gpemu cannot emulate: async TP (symmetric memory), and with it
torch.compile and Float8 (the published 405B row's extras; emulated runs are eager bf16).

Imported by torchtitan's ``ConfigManager`` from the torchtitan copy's folder, with this folder on
``PYTHONPATH``: ``python -m torchtitan.train --module titan_configs --config llama3_8b_offline``.
"""

from __future__ import annotations

import os
from typing import Any

from torchtitan.components.data import ConcatThenSplitPackingConfig, GrainDataLoader
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.config import CompileConfig
from torchtitan.hf_datasets.text_datasets import DATASETS
from torchtitan.models.llama3 import config_registry, model_registry

STEPS = int(os.environ.get("TITAN_STEPS", "10"))


def _offline(config: Any) -> Any:
    """``config`` with the test tokenizer and data set, no side outputs, ``STEPS`` steps."""
    config.hf_assets_path = "./tests/assets/tokenizer"
    config.dataloader = GrainDataLoader.Config(dataset=ConcatThenSplitPackingConfig(dataset=DATASETS["c4_test"]))
    config.profiler.enable_profiling = False
    config.metrics.enable_tensorboard = False
    config.metrics.log_freq = 1
    config.checkpoint.enable = False
    config.validator.enable = False
    config.training.steps = STEPS
    return config


def llama3_8b_offline() -> Any:
    """torchtitan's llama3_8b: FSDP over every rank, local batch 1 x 8192, selective AC."""
    return _offline(config_registry.llama3_8b())


def llama3_8b_lb2_offline() -> Any:
    """llama3_8b at local batch 2 (torchtitan's published 8B FSDP rows)."""
    config = _offline(config_registry.llama3_8b())
    config.training.num_tokens_per_microbatch_per_dp_rank = 2 * 8192
    return config


def llama3_70b_offline() -> Any:
    """torchtitan's llama3_70b: FSDP x TP 8, local batch 8 x 8192, full AC."""
    return _offline(config_registry.llama3_70b())


def llama3_405b_offline() -> Any:
    """torchtitan's llama3_405b (FSDP x TP 8, local batch 2 x 8192, full AC, AdamW at 8e-5 with 600
    warm-up steps) with 8 pipeline stages (1F1B); eager bf16: no async TP, compile or Float8.
    Built from llama3_70b (the same loss, vocabulary and plan): llama3_405b() itself adds the
    Float8 converter, which needs torchao at once."""
    config = _offline(config_registry.llama3_70b())
    config.model_spec = model_registry("405B")
    config.optimizer = default_adamw(lr=8e-5)
    config.lr_scheduler = LRSchedulersContainer.Config(warmup_steps=600)
    config.training.num_tokens_per_microbatch_per_dp_rank = 2 * 8192
    config.compile = CompileConfig(enable=False, enable_async_tensor_parallel=False)
    config.training.disable_cuda_graphs = True  # (torchtitan: "CUDA graphs do not support pipeline parallelism yet")
    config.parallelism.pipeline_parallel_degree = 8
    config.parallelism.pipeline_parallel_schedule = "1F1B"
    config.parallelism.num_pp_microbatches = int(os.environ.get("TITAN_MICROBATCHES", "1"))
    return config

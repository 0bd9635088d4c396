"""gpemu: emulated NVIDIA GPUs for unmodified PyTorch scripts on CPU-only machines.

    import gpemu
    gpemu.patch(gpu="V100", num_gpus=1)   # torch.cuda.is_available() is now True
    ...                                   # an ordinary training script
    gpemu.unpatch()                       # torch exactly as it was

or, with no code change, ``gpemu run --gpu V100 -- python train.py``.
"""

from .config import ConfigError, EmuConfig
from .observe import print_summary, summary
from .runtime import current, emulate, is_patched, patch, unpatch

__version__ = "0.1.0"
__all__ = [
    "patch",
    "unpatch",
    "emulate",
    "is_patched",
    "current",
    "summary",
    "print_summary",
    "EmuConfig",
    "ConfigError",
    "__version__",
]

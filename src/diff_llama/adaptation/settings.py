"""What a run's options make of this launch: the training device, the autocast dtype, the batch over the processes,
and the checks that refuse options `adapt` cannot train with (before a model is loaded)."""

from __future__ import annotations

import os

import torch

from ..errors import UserError
from ..options import AdaptationOptions
from ..precision import resolve_dtype


def training_device(options: AdaptationOptions) -> torch.device:
    """Where the Trainer will train: the CPU when asked or when there is no accelerator, else this process's
    accelerator (under `accelerate launch`, the one of its local rank)."""
    if options.device == "cpu" or not torch.accelerator.is_available():
        return torch.device("cpu")
    accelerator = torch.accelerator.current_accelerator()
    return torch.device(accelerator.type, int(os.environ.get("LOCAL_RANK", 0)))


def autocast_dtype(options: AdaptationOptions, device: str | torch.device = "cpu"):
    """The autocast dtype on `device` (None: no autocast): `auto` is bfloat16 only where that device computes it in
    hardware (`precision.fastest_dtype`)."""
    dtype = resolve_dtype(options.autocast, device)
    return None if dtype == torch.float32 else dtype


def world_size() -> int:
    """Processes in this launch (`accelerate launch`, torchrun set WORLD_SIZE; 1 otherwise)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def batch_size(options: AdaptationOptions) -> int:
    size = world_size() if options.batch_size is None else options.batch_size
    if size < 1 or size % world_size():
        raise UserError(f"batch_size ({size}) must be a positive multiple of the number of processes "
                        f"({world_size()}): each process trains on an equal share of every step's examples; set "
                        f"--batch-size to a multiple of {world_size()}")
    return size


def check_options(options: AdaptationOptions) -> None:
    """Raise ValueError, naming the values and the fix, for options `adapt` cannot train with (checked before a model
    is loaded)."""
    if options.max_steps < 1 or options.min_length > options.max_length:
        raise UserError("need max_steps >= 1 and min_length <= max_length")
    if options.long_length and (options.long_length <= options.max_length or not 0 < options.long_fraction <= 1):
        raise UserError(f"long examples need long_length > max_length and 0 < long_fraction <= 1 (got long_length "
                        f"{options.long_length}, max_length {options.max_length}, long_fraction "
                        f"{options.long_fraction}); set long_length 0 to train without them")
    own_warmup = options.differential_warmup_steps
    if own_warmup is not None and not 0 <= own_warmup <= options.max_steps:
        raise UserError(f"differential_warmup_steps must be between 0 and max_steps ({options.max_steps}), got "
                        f"{own_warmup}; leave it unset to share warmup_steps")
    if options.frozen_layers < 0:
        raise UserError(f"frozen_layers must be 0 or more, got {options.frozen_layers}; set 0 to train every layer")
    if options.learning_rate <= 0 or options.differential_learning_rate < 0:
        raise UserError(f"need learning_rate > 0 and differential_learning_rate >= 0 (got {options.learning_rate} "
                        f"and {options.differential_learning_rate}): the second query heads live in q_proj with the "
                        "first, so their rate is applied as a multiple of learning_rate, which must be positive; set "
                        "--learning-rate above 0 and --differential-learning-rate to 0 or more")
    if not options.max_seconds > 0 or options.save_steps < 0:
        raise UserError(f"need max_seconds > 0 and save_steps >= 0 (got {options.max_seconds} and "
                        f"{options.save_steps})")
    batch_size(options)
    autocast_dtype(options)  # an unknown dtype

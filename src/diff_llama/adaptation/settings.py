"""What a run's options make of this launch: the training device, the autocast dtype, the batch over the processes,
and the checks that refuse options `adapt` cannot train with (before a model is loaded)."""

from __future__ import annotations

import os

import torch

from ..errors import UserError
from ..options import AdaptationOptions, require_above_zero, require_at_least
from ..precision import resolve_dtype


def training_device(options: AdaptationOptions) -> torch.device:
    """Where the Trainer will train: the CPU when asked or when there is no accelerator, else this process's
    accelerator (under `accelerate launch`, the one of its local rank)."""
    from ..resolve import accelerator

    found = accelerator()
    if options.device == "cpu" or found is None:
        return torch.device("cpu")
    return torch.device(found.type, int(os.environ.get("LOCAL_RANK", 0)))


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
        raise UserError(f"--batch-size ({size}) must be a positive multiple of the number of processes "
                        f"({world_size()}): each process trains on an equal share of every step's examples; set "
                        f"--batch-size to a multiple of {world_size()}")
    return size


def check_options(options: AdaptationOptions) -> None:
    """Raise ValueError, naming the values and the fix, for options `adapt` cannot train with (checked before a model
    is loaded)."""
    require_at_least(1, max_steps=options.max_steps, min_length=options.min_length)
    if options.min_length > options.max_length:
        raise UserError(f"--min-length ({options.min_length}) is above --max-length ({options.max_length}); give a "
                        "shortest example no longer than the longest")
    if options.long_length and (options.long_length <= options.max_length or not 0 < options.long_fraction <= 1):
        raise UserError(f"long examples need --long-length above --max-length and --long-fraction above 0 and at "
                        f"most 1 (got {options.long_length}, {options.max_length} and {options.long_fraction:g}); "
                        "or --long-length 0 to train without them")
    own_warmup = options.differential_warmup_steps
    if own_warmup is not None and not 0 <= own_warmup <= options.max_steps:
        raise UserError(f"--differential-warmup-steps must be between 0 and --max-steps ({options.max_steps}), got "
                        f"{own_warmup}; leave it unset to share --warmup-steps")
    if options.frozen_layers < 0:
        raise UserError(f"--frozen-layers must be 0 or more, got {options.frozen_layers}; 0 trains every layer")
    if options.learning_rate <= 0 or options.differential_learning_rate < 0:
        raise UserError(f"need --learning-rate above 0 and --differential-learning-rate 0 or more (got "
                        f"{options.learning_rate:g} and {options.differential_learning_rate:g}): the second query "
                        "heads live in q_proj with the first, so their rate is applied as a multiple of the learning "
                        "rate, which must be positive")
    require_above_zero(max_seconds=options.max_seconds)
    require_at_least(0, save_steps=options.save_steps)
    batch_size(options)
    autocast_dtype(options)  # an unknown dtype

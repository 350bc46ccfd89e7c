"""Which floating-point type computes fastest on this machine: what `auto` means for `--dtype` and `--autocast`.

bfloat16 pays only where the hardware computes in it. On a CPU with bf16 units (AMX or AVX512-BF16 on x86, BF16 or
SVE-BF16 on ARM) bf16 autocast trains faster than float32; on a CPU without them bf16 is emulated and many times slower
than float32, so `auto` keeps float32 there (docs/kernels.md has the measurements; `bench/precision.py` measures a
machine). CUDA GPUs from Ampere on have bf16 units.
"""

from __future__ import annotations

import torch

from .errors import UserError

# Capability names of `torch.cpu.get_capabilities()` that mean bf16 arithmetic in hardware.
CPU_BFLOAT16_UNITS = ("amx_bf16", "avx512_bf16", "bf16", "sve_bf16")


def cpu_has_bfloat16_units() -> bool:
    """True where the CPU computes bfloat16 in hardware. A torch too old for `torch.cpu.get_capabilities` answers
    False: float32 is never the slow choice."""
    capabilities = getattr(torch.cpu, "get_capabilities", None)
    if capabilities is None:
        return False
    found = capabilities()
    return any(bool(found.get(name)) for name in CPU_BFLOAT16_UNITS)


def fastest_dtype(device: str | torch.device = "cpu") -> torch.dtype:
    """bfloat16 where `device` has bf16 units, float32 elsewhere."""
    device = torch.device(device)
    if device.type == "cuda":
        try:
            native = torch.cuda.is_bf16_supported(including_emulation=False)
        except TypeError:  # torch before the argument: the answer was already "natively"
            native = torch.cuda.is_bf16_supported()
        return torch.bfloat16 if native else torch.float32
    if device.type == "cpu":
        return torch.bfloat16 if cpu_has_bfloat16_units() else torch.float32
    return torch.float32


def resolve_dtype(name: str, device: str | torch.device = "cpu") -> torch.dtype:
    """A dtype option's value -> torch dtype: 'auto' is `fastest_dtype(device)`; 'none' (no autocast) is float32;
    'float32', 'bfloat16' and 'float16' are themselves. Raises ValueError naming the choices for anything else."""
    if name == "auto":
        return fastest_dtype(device)
    if name == "none":
        return torch.float32
    if name in ("float32", "bfloat16", "float16"):
        return getattr(torch, name)
    raise UserError(f"unknown dtype {name!r}: choose auto, float32, bfloat16 or float16 (or none for no autocast)")

"""This machine, as far as a kernel's speed depends on it: what the per-machine stores of measurements are keyed by
(`kernels.choice`'s kernel choices, `backbone_dtype`'s dtype) and what bench records name.

torch's CPU capability names only its dispatch (an AMX or AVX512_BF16 CPU reports "AVX512", and
ATEN_CPU_CAPABILITY=avx2 makes it report "AVX2"), so the CPU's own instruction sets are read from /proc/cpuinfo too.
"""

from __future__ import annotations

import os

import torch

from .cpu_flags import ISA_FEATURES, cpu_features, read_cpuinfo  # noqa: F401 (ISA_FEATURES: re-exported)
from .registry import KERNELS

FALLBACK_CACHE_BYTES = 32 << 20


def cpu_description() -> dict:
    """What a kernel timing depends on: the CPU model, torch's CPU capability (its dispatch), the CPU's own
    instruction sets (`cpu_features`; None where /proc/cpuinfo is not readable), threads."""
    cpuinfo = read_cpuinfo()
    model = None if cpuinfo is None else next(
        (line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")), None)
    return {"cpu_model": model, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpu_features": None if cpuinfo is None else cpu_features(cpuinfo),
            "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count()}


def last_level_cache_bytes(device: torch.device | str = "cpu") -> int:
    """The last-level cache's size: a GPU's L2 (torch's device properties), the CPU's L3 (Linux sysfs); 32 MiB when
    it cannot be read."""
    device = torch.device(device)
    if device.type == "cuda":
        return getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or FALLBACK_CACHE_BYTES
    path = "/sys/devices/system/cpu/cpu0/cache/index3/size"
    try:
        with open(path) as file:
            text = file.read().strip().upper()
        return int(text.rstrip("KM")) << (20 if text.endswith("M") else 10)
    except (OSError, ValueError):
        return FALLBACK_CACHE_BYTES


def machine_identity(device: torch.device) -> dict:
    """Everything a kernel timing depends on besides the layer's shape and the thread count."""
    device = torch.device(device)
    # The kernels this install can run (one whose package is installed later makes the earlier choices stale)
    kernels = sorted(name for name, kernel in KERNELS.items() if kernel.available())
    identity = {"torch": torch.__version__, "kernels": kernels, "device": device.type}
    if device.type == "cuda":
        identity["gpu"] = torch.cuda.get_device_name(device)
    else:
        cpu = cpu_description()
        identity.update(cpu_model=cpu["cpu_model"], cpu_capability=cpu["cpu_capability"])
    return identity

"""This CPU's own instruction sets, read from /proc/cpuinfo: torch's CPU capability names only its dispatch (an AMX
or AVX512_BF16 CPU reports "AVX512", and ATEN_CPU_CAPABILITY=avx2 makes it report "AVX2"), while a kernel's speed,
and for fbgemm's int8 GEMM its arithmetic, turn on the instructions the CPU has."""

from __future__ import annotations

# The instruction sets a CPU kernel's speed turns on.
ISA_FEATURES = ("avx2", "avx_vnni", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16",
                "amx_int8")


def cpu_features(cpuinfo: str) -> list[str]:
    """The ISA_FEATURES among the `flags` of a /proc/cpuinfo text, in ISA_FEATURES' order."""
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])
    return [feature for feature in ISA_FEATURES if feature in flags]


def read_cpuinfo() -> str | None:
    """/proc/cpuinfo's text; None where it cannot be read (not Linux)."""
    try:
        with open("/proc/cpuinfo") as file:
            return file.read()
    except OSError:
        return None


def this_cpu_features() -> list[str] | None:
    """`cpu_features` of this machine; None where /proc/cpuinfo cannot be read."""
    cpuinfo = read_cpuinfo()
    return None if cpuinfo is None else cpu_features(cpuinfo)

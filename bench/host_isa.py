"""The host's vector ISA, for the first line of a bench's report: a figure from a CPU with AMX is
not one from a CPU with AVX2 alone (vLLM's CPU attention, its matrix products and kvstore's page
writer each take other paths), so every figure names the host it came from.

    python bench/host_isa.py      # e.g. "ISA: avx2 avx512f avx512bw avx512_bf16 (no AMX); 2 CPUs"
"""

from __future__ import annotations

import os
import platform

# the flags that decide which paths the CPU work takes, in the order printed
_FLAGS = ("sse2", "avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile",
          "amx_bf16", "amx_int8", "asimd", "sve")


def cpu_flags() -> set[str]:
    """Every flag /proc/cpuinfo lists for the first CPU (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith(("flags", "Features")):  # x86, ARM
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def isa_summary() -> dict:
    """The flags of :data:`_FLAGS` this CPU has, whether it has AMX, its model and CPU count."""
    flags = cpu_flags()
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            model = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), model)
    except OSError:
        pass
    return {"flags": [f for f in _FLAGS if f in flags], "amx": "amx_tile" in flags, "model": model,
            "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()}


def isa_line() -> str:
    """One line: ``ISA: <flags> (AMX | no AMX); <model>, <n> CPUs``."""
    summary = isa_summary()
    return (f"ISA: {' '.join(summary['flags']) or 'unknown'} ({'AMX' if summary['amx'] else 'no AMX'}); "
            f"{summary['model']}, {summary['cpus']} CPUs")


if __name__ == "__main__":
    print(isa_line())

"""The kind of CPU a benchmark runs on, as its default result file names it (``decode_speed_epyc_avx2.json``), so that
a result says where it ran and runs on two machines never overwrite each other (benchmarks/README.md, "Machines").

    python benchmarks/machine_kind.py    # prints it: epyc_avx2, epyc_avx512, intel_amx, intel_avx512, ...

The kind is the CPU's maker or family (``epyc``, ``intel``; otherwise the first word of its model name, or the
architecture) and torch's CPU capability (``avx2``, ``avx512``, ``default``), except that an Intel CPU with AMX tiles
is ``intel_amx``. A GPU benchmark names its GPU instead (benchmarks/gpu_speed.py).
"""

import os
import platform
import re

import torch

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def slug(text: str) -> str:
    """``text`` as a file-name part: lower case, runs of other characters as one ``_``."""
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")


def cpu_model_and_flags() -> tuple[str, set]:
    """The CPU's model name and feature flags from /proc/cpuinfo (empty where there is none)."""
    model, flags = "", set()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and not model:
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    return model or platform.processor() or "", flags


def machine_kind(model: str | None = None, flags: set | None = None, capability: str | None = None) -> str:
    """The CPU kind: ``epyc_avx2``, ``epyc_avx512``, ``intel_amx``, ``intel_avx512``, ... (arguments: this machine's
    by default)."""
    if model is None or flags is None:
        found_model, found_flags = cpu_model_and_flags()
        model = found_model if model is None else model
        flags = found_flags if flags is None else flags
    capability = slug(capability or torch.backends.cpu.get_cpu_capability())
    name = model.lower()
    if "epyc" in name:
        maker = "epyc"
    elif "intel" in name or "xeon" in name:
        if "amx_tile" in flags:
            return "intel_amx"
        maker = "intel"
    else:
        maker = slug(model.split()[0]) if model.split() else slug(platform.machine()) or "cpu"
    return f"{maker}_{capability}"


def default_output(stem: str, suffix: str = ".json") -> str:
    """benchmarks/results/STEM_KIND.json: a script's result file when no output is given."""
    return os.path.join(RESULTS, f"{stem}_{machine_kind()}{suffix}")


if __name__ == "__main__":
    print(machine_kind())

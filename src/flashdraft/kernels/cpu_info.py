"""What this CPU is, read in one place (`/proc/cpuinfo` on Linux): its model name for records, its name with the
vector extensions kernels dispatch on (what a timing is recorded and a price list cached under), and the instruction
sets a C++ library built here may use (cpp_build.py keys its cache on them)."""

from __future__ import annotations

import functools
import platform
from pathlib import Path


def cpu_model_name() -> str:
    """The CPU's model name (e.g. "AMD EPYC 9R14 96-Core Processor"), else what the platform says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# The vector extensions CPU kernels dispatch on: one model name covers CPUs with and without them (an "AMD EPYC" with
# avx512_bf16, and one with avx2 only, price a bf16 step 2x apart).
CPU_FEATURES = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


def cpu_name() -> str:
    """The CPU's model name with its family / model and vector extensions, e.g. "AMD EPYC (family 25 model 1;
    avx2)": what a timing is recorded and a price list cached under."""
    name, fields, flags = None, {}, set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key, value = key.strip(), value.strip()
            if key == "model name" and name is None:
                name = value
            elif key in ("cpu family", "model") and key not in fields:
                fields[key] = value
            elif key == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    name = name or platform.processor() or platform.machine()
    if not fields and not flags:
        return name
    where = f"family {fields.get('cpu family', '?')} model {fields.get('model', '?')}"
    features = ", ".join(f for f in CPU_FEATURES if f in flags) or "no avx2"
    return f"{name} ({where}; {features})"


# the CPU flags (as /proc/cpuinfo names them) a library's code may depend on through -march=native
_FEATURE_PREFIXES = ("avx", "amx", "fma", "f16c", "bmi", "sse", "vnni", "vaes", "vpclmul", "gfni", "sha", "asimd",
                     "sve", "sme", "i8mm", "bf16", "fp16", "dotprod")  # fmt: skip


@functools.cache
def cpu_features() -> str:
    """This CPU's architecture and the instruction-set features a library built here may use, as one line."""
    flags: set[str] = set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith(("flags", "Features")):
                names = line.split(":", 1)[1].split()
                flags.update(
                    f for f in names if f.startswith(_FEATURE_PREFIXES) and f not in ("smep", "smap")
                )
                break
    return " ".join([platform.machine(), *sorted(flags)])

"""The C++ kernels build, or refuse cleanly, on the CPUs this machine is not: each library's source, as cpp_build.py
would build it, compiled (to an object thrown away: GCC finds an intrinsic the target lacks only where it inlines
it, never in a syntax check) for an avx2-only x86 (Zen 3), a Zen 4 (avx512_vnni without AVX-VNNI), an AVX-VNNI one
without avx512 (Alder Lake) and Arm (NEON, SVE-256), with the vector-ISA macro inductor defines there. An avx512 or
AMX intrinsic outside its guard, or any x86 intrinsic reached on Arm, is an error here, whatever CPU runs the tests;
and the w8a16 library carries exactly the kernels that CPU can run (none on Arm, where `--quantize w8a16` is refused
before any build: tests/test_w8a16.py).

The Arm builds need a cross compiler (`g++-aarch64-linux-gnu`, Debian's; `.ci/run` installs it): without one they
skip naming it, and fail under FLASHDRAFT_REQUIRE_KERNELS=1."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from conftest import REQUIRE_KERNELS
from flashdraft.kernels import attention_cpp, decoder_layer_cpp, w8a16_cpp

ARM_CXX = os.environ.get("FLASHDRAFT_ARM_CXX", "aarch64-linux-gnu-g++")
# name: (compiler, flags, the w8a16 kernels that build has)
TARGETS = {
    "znver3-avx2": ("g++", "-march=znver3 -DCPU_CAPABILITY_AVX2", {"AVX2"}),
    # a Zen 4 (GCC 12 has no -march=znver4): avx512_vnni without AVX-VNNI, a later kernel without an earlier one
    "zen4": (
        "g++",
        "-march=znver3 -mavx512f -mavx512dq -mavx512bw -mavx512vl -mavx512vnni -mavx512bf16 -DCPU_CAPABILITY_AVX512",
        {"AVX2", "VNNI"},
    ),
    "alderlake-avx-vnni": ("g++", "-march=alderlake -DCPU_CAPABILITY_AVX2", {"AVX2", "AVXVNNI"}),
    "sapphirerapids": (
        "g++",
        "-march=sapphirerapids -DCPU_CAPABILITY_AVX512",
        {"AVX2", "AVXVNNI", "VNNI", "AMX"},
    ),
    "aarch64-neon": (ARM_CXX, "-march=armv8.2-a+dotprod+fp16 -DCPU_CAPABILITY_NEON", set()),
    "aarch64-sve256": (ARM_CXX, "-march=armv8.2-a+sve -msve-vector-bits=256 -DCPU_CAPABILITY_SVE256", set()),
}
LIBRARIES = {
    "w8a16": w8a16_cpp.source,
    "attention": attention_cpp.source,
    "decoder_layer": decoder_layer_cpp.source,
}


def _compiler(name: str) -> str:
    found = shutil.which(TARGETS[name][0])
    if found:
        return found
    why = f"{name}: no {TARGETS[name][0]} (Debian's g++-aarch64-linux-gnu)"
    if REQUIRE_KERNELS:
        pytest.fail(f"{why}, and FLASHDRAFT_REQUIRE_KERNELS=1")
    pytest.skip(why)


def _compile(name: str, source: str, *extra: str) -> subprocess.CompletedProcess:
    import torch.utils.cpp_extension as ext

    flags = TARGETS[name][1].split()
    includes = [f"-I{p}" for p in ext.include_paths()]
    command = [_compiler(name), "-std=c++17", "-fopenmp", *flags, *includes, *extra, "-x", "c++", "-"]
    return subprocess.run(command, input=source, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("library", LIBRARIES)
@pytest.mark.parametrize("target", TARGETS)
def test_each_kernel_library_compiles_for_each_cpu_kind(target, library):
    done = _compile(target, LIBRARIES[library](), "-c", "-O1", "-o", os.devnull)
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert done.returncode == 0, f"{library} for {target}:\n" + "\n".join(errors[:10])


@pytest.mark.parametrize("target", TARGETS)
def test_the_w8a16_library_has_the_kernels_that_cpu_runs(target):
    """Its macros after preprocessing: avx2 everywhere on x86 (the least), AVX-VNNI where the CPU has it, the
    avx512 and AMX kernels only with those, none on Arm (the library would load with no kernel: `prepare` says
    False, and the plan refuses the scheme)."""
    done = _compile(target, w8a16_cpp.source(), "-E", "-dM")
    assert done.returncode == 0, done.stderr[-2000:]
    built = set(re.findall(r"#define W8A16_(AVX2|AVXVNNI|VNNI|AMX) 1", done.stdout))
    assert built == TARGETS[target][2]

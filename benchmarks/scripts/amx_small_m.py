"""AMX for every bf16-row GEMM of the frozen graphs, the one-token graph's too, through verify_bits.py: cpu_gemm's
pair kernel left out (inductor's AMX micro-kernels serve bf16 rows, as it ranks them) and inductor's rule that skips
AMX for weight-only-int8 GEMMs of a static row count below 5 (`cpp_micro_gemm.create_micro_gemm`,
`skip_amx_kernel_for_woq`) lifted, so the one-token graph runs the micro-kernel the symbolic verify runs.
benchmarks/README.md, 2026-11-29 night (2-core AMX Xeon: every row bit-equal, 1.5-2x faster than the pair kernel).
Run on an AMX CPU, with an inductor cache of its own: QUANT=int8 LENGTHS=1,2,4,8,16
TORCHINDUCTOR_CACHE_DIR=/tmp/ind_amx python benchmarks/scripts/amx_small_m.py"""

import runpy
import sys

from flashdraft.cpu_gemm import register_cpu_gemm_kernels

register_cpu_gemm_kernels(without=frozenset({"bf16-pairs"}))  # imports inductor's modules in their order first
import torch._inductor.codegen.cpp_gemm_template as template  # noqa: E402
import torch._inductor.codegen.cpp_micro_gemm as micro  # noqa: E402
choose = micro.create_micro_gemm
seen = set()


def amx_at_any_rows(name, m, *args, **kwargs):
    if getattr(m, "is_number", isinstance(m, int)) and int(m) < 5:
        m = 5  # what the micro-kernel is chosen for; it runs any row count
    gemm = choose(name, m, *args, **kwargs)
    if type(gemm).__name__ not in seen:
        seen.add(type(gemm).__name__)
        print("micro-kernel:", type(gemm).__name__, flush=True)
    return gemm


micro.create_micro_gemm = template.create_micro_gemm = amx_at_any_rows
sys.argv = ["verify_bits.py"]
runpy.run_path("benchmarks/scripts/verify_bits.py", run_name="__main__")

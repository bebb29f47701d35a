"""verify_bits.py with the kernel that serves bf16 rows chosen (KERNEL=amx, the default on a CPU with AMX, or
KERNEL=pairs, cpu_gemm's pair kernel), to compare them on one AMX CPU. Before 2026-11-30 AMX stepped aside for the
pair kernel: inductor skipped its AMX micro-kernel for a weight-only-int8 GEMM of fewer than 5 static rows
(`cpp_micro_gemm.create_micro_gemm`, `skip_amx_kernel_for_woq`), so the one-token graph ran avx512 code and the
verify AMX, and a row's bits changed with the verify's length. cpu_gemm._amx_at_any_rows lifts that rule.
benchmarks/README.md, 2026-11-29 night and 2026-11-30. Run on an AMX CPU, each kernel with an inductor cache of its
own: KERNEL=amx QUANT=int8 LENGTHS=1,2,4,8,16 TORCHINDUCTOR_CACHE_DIR=/tmp/ind_amx python
benchmarks/scripts/amx_small_m.py"""

import os
import runpy
import sys

from flashdraft.kernels.gemm_templates import serving_bf16_rows

with serving_bf16_rows(os.environ.get("KERNEL", "amx")):
    sys.argv = ["verify_bits.py"]
    runpy.run_path("benchmarks/scripts/verify_bits.py", run_name="__main__")

"""bf16 linears of SmolLM2-135M's decoder shapes (30 layers: q, gate, up, down; residual adds between) compiled and
frozen as the verify compiles them (compiled.compile_whole: the 4-row bf16 register block on avx512), at 1, 4, 8 and
16 rows: median ms and the ratio to one row. An optional "Mt,Nt,Kt" sets inductor's GEMM thread factors.
benchmarks/README.md, 2026-11-28 (Zen 4 EPYC). Run: python benchmarks/scripts/gemm_rows_bf16.py [Mt,Nt,Kt]"""

import sys
import time

import torch
from torch import nn

import flashdraft.compiled as C

torch.set_num_threads(2)
factors = sys.argv[1] if len(sys.argv) > 1 else ""
if factors:
    from torch._inductor import config as inductor_config

    inductor_config.cpp.gemm_thread_factors = factors


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.ModuleDict(
                dict(q=nn.Linear(576, 576, bias=False), gate=nn.Linear(576, 1536, bias=False),
                     up=nn.Linear(576, 1536, bias=False), down=nn.Linear(1536, 576, bias=False))
            )
            for _ in range(30)
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer["q"](x)
            x = x + layer["down"](nn.functional.silu(layer["gate"](x)) * layer["up"](x))
        return x


torch.manual_seed(0)
model = Decoder().bfloat16().eval()
fn = C.compile_whole(model, C.compile_options(torch.device("cpu")), weights=model)
ms = {}
with torch.no_grad():
    for rows in (1, 4, 8, 16):
        x = torch.randn(1, rows, 576).bfloat16()
        for _ in range(3):
            fn(x)
        times = []
        for _ in range(30):
            start = time.perf_counter()
            fn(x)
            times.append(time.perf_counter() - start)
        ms[rows] = sorted(times)[len(times) // 2] * 1e3
flops = {rows: 2 * rows * 30 * (576 * 576 + 3 * 576 * 1536) / (ms[rows] * 1e-3) / 1e9 for rows in ms}
print(factors or "default thread factors")
for rows in ms:
    print(f"{rows:>2} rows: {ms[rows]:6.2f} ms  {ms[rows] / ms[1]:.2f}x one row  {flops[rows]:6.1f} GFLOP/s")

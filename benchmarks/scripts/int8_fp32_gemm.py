"""The 30 MLP projections (1536 x 576) and the LM head (49152 x 576) of SmolLM2-135M, compiled and frozen as the
engine compiles them, at 1 / 4 / 16 rows: fp32 weights through inductor's GEMM template, int8 weights with fp32 rows
through ATen's kernel, and through the template (the fp32 x int8 configuration flashdraft registers).
benchmarks/README.md, 2026-11-28. Run: python benchmarks/scripts/int8_fp32_gemm.py fp32|int8-aten|int8-template
(one variant per process: the registration is once per process)."""

import sys
import time

import torch
from torch import nn

import flashdraft.engine.compiled as compiled
from flashdraft.kernels.gemm_templates import register_cpu_gemm_kernels
from flashdraft.kernels.static_buffers import symbolic_sizes

variant = sys.argv[1]
if variant == "int8-aten":  # as before flashdraft registered the configuration
    register_cpu_gemm_kernels(without=frozenset({"fp32-int8"}))
torch._inductor.config.fx_graph_cache = False  # the variants freeze the same weights: no graph from another
torch.manual_seed(0)
torch.set_grad_enabled(False)  # frozen graphs only under no_grad


class Layers(nn.Module):
    def __init__(self, int8: bool) -> None:
        super().__init__()
        shapes = [(1536, 576)] * 30 + [(49152, 576)]
        if int8:
            self.w = nn.ParameterList(
                nn.Parameter(torch.randint(-127, 128, s, dtype=torch.int8), requires_grad=False)
                for s in shapes
            )
            self.s = nn.ParameterList(
                nn.Parameter(torch.rand(s[0]) / 100, requires_grad=False) for s in shapes
            )
        else:
            self.w = nn.ParameterList(nn.Parameter(torch.randn(s) / 50, requires_grad=False) for s in shapes)
        self.int8 = int8

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self.int8:
            return [torch.ops.aten._weight_int8pack_mm(x, w, s) for w, s in zip(self.w, self.s, strict=True)]
        return [torch.nn.functional.linear(x, w) for w in self.w]


model = Layers(variant != "fp32").eval()
step = compiled.compile_whole(model.forward, compiled.compile_options(torch.device("cpu")), weights=model)
for rows in (1, 4, 16):
    x = torch.randn(rows, 576)
    symbolic_sizes(x, 0)
    step(x)
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        step(x)
        times.append(time.perf_counter() - t0)
    print(f"{variant}: {rows} rows {1000 * sorted(times)[10]:.2f} ms", flush=True)

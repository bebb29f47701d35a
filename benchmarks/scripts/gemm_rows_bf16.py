"""bf16 linears of SmolLM2-135M's decoder shapes (30 layers: q, gate, up, down; residual adds between) compiled and
frozen as the verify compiles them (compiled.compile_whole, the micro-kernels of gemm_templates.py), at 1, 4, 8 and 16
rows: median ms and the ratio to one row. Options: "int8" (int8 weights, quantize.Int8Linear, bf16 rows), "w8a8"
(int8 weights and each row quantized to int8 on the fly, an integer GEMM, `torch._int_mm`: exact, so any kernel keeps
a row's bits; the row's bits also checked here at every row count),
"widening" (inductor's own bf16 kernels, not the vdpbf16ps pair kernel: on an AMX CPU its AMX kernel), "Mt,Nt,Kt" (inductor's GEMM thread
factors). benchmarks/README.md, 2026-11-28 (Zen 4 EPYC).
Run: python benchmarks/scripts/gemm_rows_bf16.py [int8|w8a8] [widening] [Mt,Nt,Kt]"""

import sys
import time

import torch
from torch import nn

import flashdraft.engine.compiled as C
from flashdraft.kernels.gemm_templates import register_cpu_gemm_kernels
from flashdraft.kernels.quantize import Int8Linear

torch.set_num_threads(2)
int8, widening, w8a8 = "int8" in sys.argv[1:], "widening" in sys.argv[1:], "w8a8" in sys.argv[1:]
factors = next((a for a in sys.argv[1:] if "," in a), "")
if widening:
    register_cpu_gemm_kernels(without=frozenset({"bf16-pairs"}))
if factors:
    from torch._inductor import config as inductor_config

    inductor_config.cpp.gemm_thread_factors = factors


class W8A8Linear(nn.Module):
    """int8 weights (a scale per output channel), each input row quantized to int8 (a scale per row), the product in
    int32 (exact), both scales applied after."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        scales = (w.abs().amax(1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        self.register_buffer(
            "weight_t", torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8).t().contiguous()
        )
        self.register_buffer("scales", scales)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).float()
        row_scales = (rows.abs().amax(-1, keepdim=True) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        q = torch.round(rows / row_scales).clamp(-127, 127).to(torch.int8)
        out = torch._int_mm(q, self.weight_t).float() * row_scales * self.scales
        return out.to(x.dtype).reshape(*x.shape[:-1], -1)


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
if int8 or w8a8:
    for layer in model.layers:
        for name in list(layer):
            layer[name] = W8A8Linear(layer[name]) if w8a8 else Int8Linear(layer[name].float(), torch.bfloat16)
fn = C.compile_whole(model, C.compile_options(torch.device("cpu")), weights=model)
inputs = {rows: torch.randn(1, rows, 576).bfloat16() for rows in (1, 4, 8, 16)}
times: dict[int, list[float]] = {rows: [] for rows in inputs}
with torch.no_grad():
    for x in inputs.values():
        for _ in range(3):
            fn(x)
    for _ in range(12):  # the row counts interleaved, so that a slower minute slows them all
        for rows, x in inputs.items():
            for _ in range(5):
                start = time.perf_counter()
                fn(x)
                times[rows].append(time.perf_counter() - start)
ms = {rows: sorted(t)[len(t) // 2] * 1e3 for rows, t in times.items()}
flops = {rows: 2 * rows * 30 * (576 * 576 + 3 * 576 * 1536) / (ms[rows] * 1e-3) / 1e9 for rows in ms}
kernel = ("amx" if torch.cpu._is_amx_tile_supported() else "widening") if widening else "pairs"
print(" ".join(a for a in ("w8a8" if w8a8 else "int8" if int8 else "bf16", kernel, factors) if a))
with torch.no_grad():  # a row's bits at every row count: the first row of each input given alone (copies: a
    # frozen graph may hand back the same output buffer next call)
    alone = {rows: fn(x[:, :1]).clone() for rows, x in inputs.items()}
    equal = [rows for rows, x in inputs.items() if torch.equal(fn(x)[:, :1].clone(), alone[rows])]
    print("first row's bits equal alone at", equal)

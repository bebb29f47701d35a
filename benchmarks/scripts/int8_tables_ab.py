"""A/B in one process: the pair kernel's int8 -> bf16 by table lookups (cpu_gemm.INT8_TABLES_ROWS, here 0 = never,
4, 8) on the int8 linears of SmolLM2-135M's decoder shapes (30 layers of q, gate, up, down, as
gemm_rows_bf16.py, RMS-normed inputs), frozen and compiled as the verify is, at 1, 2, 4, 8 and 16 rows: median ms of interleaved runs,
and whether the outputs are equal bit for bit. Run: python benchmarks/scripts/int8_tables_ab.py"""

import statistics
import time

import torch
from torch import nn

import flashdraft.engine.compiled as C
import flashdraft.kernels.gemm_templates as G
from flashdraft.kernels.quantize import Int8Linear

torch.set_num_threads(2)


SHAPES = {"q": (576, 576), "gate": (1536, 576), "up": (1536, 576), "down": (576, 1536)}  # (out, in)


class Int8Decoder(nn.Module):
    """30 layers of SmolLM2's q, gate, up and down shapes as int8 layers (bf16 rows), each fed RMS-normed rows so
    that random weights keep every value finite."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(
            nn.ModuleDict({name: Int8Linear(nn.Linear(i, o, bias=False), torch.bfloat16) for name, (o, i) in SHAPES.items()})
            for _ in range(30)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm = lambda t: nn.functional.rms_norm(t, (576,))  # noqa: E731
        for layer in self.layers:
            x = x + layer["q"](norm(x))
            x = x + layer["down"](nn.functional.silu(layer["gate"](norm(x))) * layer["up"](norm(x)))
        return x


ROWS = (1, 2, 4, 8, 16)
inputs = {rows: torch.randn(1, rows, 576).bfloat16() for rows in ROWS}
variants = {}
with torch.no_grad():
    for tables in (0, 4, 8):
        G.INT8_TABLES_ROWS = tables
        model = Int8Decoder().eval()
        fn = C.compile_whole(model, C.compile_options(torch.device("cpu")), weights=model)
        outs = {rows: fn(x) for rows, x in inputs.items()}  # compiled now, with this setting
        variants[tables] = (fn, outs)
    times = {(t, rows): [] for t in variants for rows in ROWS}
    for _ in range(15):
        for rows, x in inputs.items():
            for t, (fn, _) in variants.items():
                start = time.perf_counter()
                fn(x)
                times[t, rows].append(time.perf_counter() - start)
for rows in ROWS:
    equal = all(torch.equal(variants[t][1][rows], variants[0][1][rows]) for t in variants)
    cells = "  ".join(f"tables<= {t}: {1000 * statistics.median(times[t, rows]):5.2f} ms" for t in variants)
    print(f"{rows:2d} rows  {cells}  equal bits: {equal}")

"""Time each w8a16 kernel this CPU runs (kernels/w8a16_cpp.py) over SmolLM2-135M's 121 linears at 1-16 rows.

    python benchmarks/w8a16_kernels.py [--dtype float32|bfloat16] [KERNEL ...]

Random weights of SmolLM2-135M's shapes (30 layers: q/k/v joined 576->960, o 576->576, gate/up joined 576->3072,
down 1536->576; the head 576->49152), each layer called in turn as a decode step calls them; best of 7 runs, ms.
All kernels give the same bits (tests/test_w8a16.py), so only their time differs.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from flashdraft.kernels import w8a16_cpp
from flashdraft.kernels.quantize import W8A16Linear

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)] * 30 + [(576, 49152)]
ROWS = (1, 2, 4, 8, 16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kernels", nargs="*", help="kernels to time (default: every one this CPU runs)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    if not w8a16_cpp.prepare():
        raise SystemExit(
            f"no w8a16 kernel on this CPU (it lacks {' and '.join(w8a16_cpp.missing_features())})"
        )
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    layers = [W8A16Linear(nn.Linear(k, n, bias=False), compute_dtype=dtype) for k, n in SHAPES]
    inputs = {k: torch.randn(max(ROWS), k, dtype=dtype) for k in (576, 1536)}
    print(f"{torch.get_num_threads()} threads, {args.dtype} rows; ms over {len(layers)} linears")
    for name in args.kernels or w8a16_cpp.available_kernels():
        w8a16_cpp.set_kernel(name)
        cells = []
        for rows in ROWS:
            best = float("inf")
            for _ in range(8):  # the first a warm-up
                t0 = time.perf_counter()
                for layer in layers:
                    layer(inputs[layer.in_features][:rows])
                best = min(best, time.perf_counter() - t0)
            cells.append(f"{rows}: {best * 1e3:.2f}")
        print(f"{name:16s} " + "  ".join(cells))
    w8a16_cpp.set_kernel(None)


if __name__ == "__main__":
    main()

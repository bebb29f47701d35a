"""The engine's draft pass as decoding calls it: SmolLM2-135M's drafter (bf16) beside the compiled target (int8 or
w8a8 weights), each pass after 3 accepted tokens' features, the context growing from 256 tokens. `time`: 5 rounds
of 50 passes, each round's median and 10th percentile; `profile`: torch's profiler over 20 passes (operators by
self time); `kernels`: the same with inductor's per-kernel timings inside the graphs (a graph cache of its own).
benchmarks/README.md, 2026-12-03 (Zen 4). Run: python benchmarks/scripts/draft_pass_profile.py [int8|w8a8] [time|profile|kernels]"""

import sys
import time

import torch

from flashdraft.engine.compiled import compile_verify
from flashdraft.engine.measure import static_decoder
from flashdraft.drafter.model import DFlashDraftModel
from flashdraft.targets.target import load_target

torch.set_num_threads(2)
scheme = sys.argv[1] if len(sys.argv) > 1 else "int8"
mode = sys.argv[2] if len(sys.argv) > 2 else "time"
if mode == "kernels":
    torch._inductor.config.cpp.enable_kernel_profile = True
target = load_target("smollm2-135m-instruct", dtype="bfloat16", device="cpu", quantize=scheme, compiled=True)
compile_verify(target)
ids = torch.randint(100, 20000, (1, 256), generator=torch.Generator().manual_seed(0))
draft = DFlashDraftModel.from_pretrained("drafters/smollm2-135m-instruct").eval().to(torch.bfloat16)
engine = static_decoder(target, draft, ids, dtype="bfloat16")
proposer, row = engine.proposer, engine.rows[0]
features = torch.randn(1, 3, proposer.pending[0][0].shape[-1], dtype=proposer.pending[0][0].dtype)


def one_pass() -> None:
    proposer.draft_rows(engine.rows)
    row.tokens.extend([5, 6, 7])  # three tokens accepted: their features join the draft context next pass
    row.history.extend([5, 6, 7])
    proposer.accept(engine.rows, [features])


t0 = time.perf_counter()
one_pass()  # compiles the drafter's graphs
print(f"first pass {time.perf_counter() - t0:.1f} s")
for _ in range(5):
    one_pass()
if mode == "time":
    for r in range(5):
        times = []
        for _ in range(50):
            t0 = time.perf_counter()
            one_pass()
            times.append(time.perf_counter() - t0)
        times.sort()
        print(
            f"round {r} (context {len(proposer.cache)}): median {1000 * times[25]:.2f} ms, p10 {1000 * times[5]:.2f}"
        )
else:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(20):
            one_pass()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=50))

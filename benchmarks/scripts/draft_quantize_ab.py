"""Does quantizing the drafter's linears make its draft pass cheaper? SmolLM2-135M's drafter beside a compiled
target (int8 or w8a8 weights), after 256 tokens, its 15 linears left in bf16 or quantized as the target's are
(quantize.quantize), the engine's draft pass (`draft_rows`) timed interleaved, 3 rounds of 20, median ms.
benchmarks/README.md, 2026-12-02 (Zen 4). Run: python benchmarks/scripts/draft_quantize_ab.py [int8|w8a8] [none,int8,w8a8]"""

import sys
import time

import torch

from flashdraft.engine.compiled import compile_verify
from flashdraft.engine.measure import interleaved_medians, static_decoder
from flashdraft.drafter.model import DFlashDraftModel
from flashdraft.kernels.quantize import quantize
from flashdraft.targets.target import load_target

torch.set_num_threads(2)
target_scheme = sys.argv[1] if len(sys.argv) > 1 else "int8"
schemes = sys.argv[2].split(",") if len(sys.argv) > 2 else ["none", "int8", "w8a8"]
target = load_target(
    "smollm2-135m-instruct", dtype="bfloat16", device="cpu", quantize=target_scheme, compiled=True
)
compile_verify(target)
ids = torch.randint(100, 20000, (1, 300), generator=torch.Generator().manual_seed(0))
engines = []
for scheme in schemes:
    draft = DFlashDraftModel.from_pretrained("drafters/smollm2-135m-instruct").eval().to(torch.bfloat16)
    if scheme != "none":
        print(f"{scheme}: {quantize(draft, scheme)} linears quantized")
    engine = static_decoder(target, draft, ids[:, :256], dtype="bfloat16")
    t0 = time.perf_counter()
    engine.proposer.draft_rows(engine.rows)  # compiles the drafter's graphs
    print(f"{scheme}: first pass {time.perf_counter() - t0:.1f} s")
    engines.append(engine)
passes = [lambda e=e: e.proposer.draft_rows(e.rows) for e in engines]
for _ in range(3):
    medians = interleaved_medians(passes, 20)
    print("  ".join(f"{s} {1000 * m:.2f} ms" for s, m in zip(schemes, medians, strict=True)), flush=True)

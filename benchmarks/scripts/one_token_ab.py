"""Is the compiled one-token verify slower than the two-token one? SmolLM2-135M's verify after 256 tokens, through
the engine (`static_decoder`), at 1, 2 and 4 tokens: rounds of 5 consecutive calls of each length in turn (hot, as
plain decoding runs one length after another; the rounds interleaved so a slower minute slows all), median ms.
benchmarks/README.md, 2026-11-29. Run: python benchmarks/scripts/one_token_ab.py [bfloat16|float32] [int8]"""

import statistics
import sys
import time

import torch

from flashdraft.engine.compiled import compile_verify
from flashdraft.engine.measure import static_decoder
from flashdraft.drafter.model import DFlashDraftModel
from flashdraft.targets.target import load_target

torch.set_num_threads(2)
dtype = sys.argv[1] if len(sys.argv) > 1 else "bfloat16"
quantize = sys.argv[2] if len(sys.argv) > 2 else None
target = load_target("smollm2-135m-instruct", dtype=dtype, device="cpu", quantize=quantize, compiled=True)
compile_verify(target)
draft = DFlashDraftModel.from_pretrained("drafters/smollm2-135m-instruct").eval()
ids = torch.randint(100, 20000, (1, 300), generator=torch.Generator().manual_seed(0))
engine = static_decoder(target, draft, ids[:, :256], dtype=dtype)
lengths = (1, 2, 4)


def verify(n: int) -> None:
    engine.forward_block(ids[:, 256 : 256 + n], torch.arange(256, 256 + n)[None])
    target.crop(engine.cache, 256)


times: dict[int, list[float]] = {n: [] for n in lengths}
with torch.no_grad():
    for n in lengths:  # compiles
        verify(n)
    for _ in range(12):
        for n in lengths:
            for _ in range(5):
                start = time.perf_counter()
                verify(n)
                times[n].append(time.perf_counter() - start)
ms = {n: 1e3 * statistics.median(t) for n, t in times.items()}
print(dtype, quantize or "", " ".join(f"t({n}) {ms[n]:.2f} ms ({ms[n] / ms[1]:.2f})" for n in lengths))

"""A/B in one process: SmolLM2-135M `--quantize int8 --dtype bfloat16 --compile`, its verify with the int8 layers of
one input as one GEMM each (q / k / v, gate / up: `inductor_passes.int8_concat_row_dtypes` with bf16) against one GEMM per
layer (fp32 rows only, as before 2026-11-29), after a 256-token prompt at 1, 2, 4 and 8 tokens: medians of
interleaved runs, and whether the two targets' logits are equal bit for bit.
Run: python benchmarks/scripts/int8_concat_ab.py"""

import statistics
import time

import torch

import flashdraft.kernels.inductor_passes as C
from flashdraft.engine.measure import static_decoder
from flashdraft.drafter.model import DFlashDraftModel
from flashdraft.targets.target import load_target

torch.set_num_threads(2)
fused_dtypes = C.int8_concat_row_dtypes
draft = DFlashDraftModel.from_pretrained("drafters/smollm2-135m-instruct").eval()
ids = torch.randint(100, 20000, (1, 300), generator=torch.Generator().manual_seed(0))
LENGTHS, CONTEXT = (1, 2, 4, 8), 256
variants = {}
torch._inductor.config.fx_graph_cache = False  # the fusion is not in inductor's cache key
for name, dtypes in (("one GEMM per layer", lambda: (torch.float32,)), ("fused", fused_dtypes)):
    C.int8_concat_row_dtypes = dtypes
    target = load_target("smollm2-135m-instruct", dtype="bfloat16", device="cpu", quantize="int8", compiled=True)
    C.compile_verify(target)
    engine = static_decoder(target, draft, ids[:, :CONTEXT], dtype="bfloat16")

    def verify(n, target=target, engine=engine):
        out = engine.forward_block(ids[:, CONTEXT : CONTEXT + n], torch.arange(CONTEXT, CONTEXT + n)[None])
        target.crop(engine.cache, CONTEXT)
        return out.logits.clone()

    variants[name] = (verify, {n: verify(n) for n in LENGTHS})  # compiled now, with this setting
    print(f"{name}: compiled", flush=True)
C.int8_concat_row_dtypes = fused_dtypes
times = {(v, n): [] for v in variants for n in LENGTHS}
with torch.no_grad():
    for _ in range(40):
        for n in LENGTHS:
            for v, (verify, _) in variants.items():
                start = time.perf_counter()
                verify(n)
                times[v, n].append(time.perf_counter() - start)
(a, (_, logits_a)), (b, (_, logits_b)) = variants.items()
for n in LENGTHS:
    cells = "  ".join(f"{v}: {1000 * statistics.median(times[v, n]):5.2f} ms" for v in variants)
    print(f"{n} tokens  {cells}  equal logits: {torch.equal(logits_a[n], logits_b[n])}")

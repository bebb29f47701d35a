"""Compiled bf16 verify after 256 tokens (SmolLM2-135M): time per length, and whether each row's logits equal, bit
for bit, those of one-token steps over the same tokens. env: HINT (the length the multi-token graph is first
compiled at, 2 as the engine does), FILTER=1 (inductor's C++ GEMM template wherever it applies, no autotuning),
QUANT=int8, LENGTHS. benchmarks/README.md, 2026-11-27. Run: python benchmarks/scripts/verify_bits.py"""
import os, sys, time, torch
import flashdraft.engine.decoder as E
from flashdraft.engine.compiled import compile_verify
from flashdraft.targets.target import load_target
from flashdraft.drafter.model import DFlashDraftModel
from flashdraft.engine.measure import static_decoder, median_seconds
from flashdraft.engine.kv_cache import set_length

hint = int(os.environ.get("HINT", "2"))
if os.environ.get("FILTER") == "1":
    from torch._inductor import select_algorithm as sa

    def templates_first(choices):
        kept = [c for c in choices if "cpp" in type(c).__name__.lower() or "cpp" in getattr(c, "name", "")]
        print("choices:", [type(c).__name__ + ":" + getattr(c, "name", "") for c in choices], "->", len(kept) or "all", flush=True)
        return kept or choices

    sa.add_preprocessing_fn(templates_first)

orig = E.BatchDecoder._compile_ahead


def ahead(self):
    mode = torch.is_inference_mode_enabled()
    if mode in self.verify.compiled_ahead:
        return
    self.verify.compiled_ahead.add(mode)
    columns = self.valid.shape[1]
    last = torch.tensor([r.tokens[-1] for r in self.rows])[:, None]
    starts = torch.tensor([r.anchor_position for r in self.rows])
    for n in (1, hint):
        self.forward_block(last.expand(-1, n), starts[:, None] + torch.arange(n))
        set_length(self.cache, columns)


E.BatchDecoder._compile_ahead = ahead
t = load_target("smollm2-135m-instruct", dtype="bfloat16", device="cpu", quantize=os.environ.get("QUANT") or None)
print(compile_verify(t))
d = DFlashDraftModel.from_pretrained("drafters/smollm2-135m-instruct").eval()
torch.manual_seed(0)
ids = torch.randint(100, 20000, (1, 300))
s = time.time()
eng = static_decoder(t, d, ids[:, :256], dtype="bfloat16")
print(f"compile ahead {time.time() - s:.0f} s", flush=True)
c = 256
rows = {}
for n in [int(x) for x in os.environ.get("LENGTHS", "1,2,4,8,16").split(",")]:
    def verify():
        out = eng.forward_block(ids[:, c : c + n], torch.arange(c, c + n)[None])
        t.crop(eng.cache, c)
        return out
    s = time.time(); out = verify(); first = time.time() - s
    rows[n] = out.logits[0].clone()
    print(f"n={n}: {1000 * median_seconds(verify, 15):.1f} ms (first call {first:.1f} s)", flush=True)
# one-token steps at c..c+15, each after the previous one's column is written
steps = []
valid = eng.valid
for i in range(16):
    out = eng.forward_block(ids[:, c + i : c + i + 1], torch.tensor([[c + i]]))
    steps.append(out.logits[0, 0].clone())
    eng.valid = torch.cat([eng.valid, torch.ones(1, 1, dtype=torch.bool)], 1)
eng.valid = valid
t.crop(eng.cache, c)
steps = torch.stack(steps)
for n, logits in rows.items():
    same = [bool(torch.equal(logits[i], steps[i])) for i in range(n)]
    diff = max(float((logits[i] - steps[i]).abs().max()) for i in range(n))
    print(f"n={n}: rows bit-equal to one-token steps {sum(same)}/{n}, max |diff| {diff:.3g}", flush=True)

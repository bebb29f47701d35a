"""The floor of a one-token w8a16 step made of its operators alone, against the compiled verify: 121 w8a16 calls
(SmolLM2-135M's joined shapes and its head, random int8 weights) and 30 attention calls (9 heads over 3 KV heads of
64, C columns) in one Python loop, interleaved with the engine's verify of one token after C tokens.
benchmarks/README.md, 2026-12-06 (stop 76). Run: python benchmarks/scripts/ops_floor.py [C]"""

import statistics
import sys
import time

import torch

import flashdraft.engine.compiled as Cm
from flashdraft.kernels import attention_cpp, w8a16_cpp
from flashdraft.engine.measure import static_decoder
from flashdraft.drafter.model import DFlashDraftModel
from flashdraft.targets.target import load_target

torch.set_num_threads(2)
C = int(sys.argv[1]) if len(sys.argv) > 1 else 256
w8a16_cpp.prepare()
attention_cpp.prepare(torch.bfloat16)
g = torch.Generator().manual_seed(0)
layers = []
for _ in range(30):
    for n, k in [(960, 576), (576, 576), (3072, 576), (576, 1536)]:
        w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
        p, c = w8a16_cpp.pack(w)
        layers.append((p, torch.rand(n) * 0.01, c, k))
w = torch.randint(-127, 128, (49152, 576), dtype=torch.int8, generator=g)
p, c = w8a16_cpp.pack(w)
layers.append((p, torch.rand(49152) * 0.01, c, 576))
op = torch.ops.flashdraft.w8a16_linear.default
att = torch.ops.flashdraft.short_attention.default
xs = {k: torch.randn(1, k, dtype=torch.bfloat16) for k in (576, 1536)}
q = torch.randn(1, 9, 1, 64, dtype=torch.bfloat16)
kv = [
    (torch.randn(1, 3, C + 64, 64, dtype=torch.bfloat16), torch.randn(1, 3, C + 64, 64, dtype=torch.bfloat16))
    for _ in range(30)
]
mask = torch.zeros(1, 1, 1, C + 1, dtype=torch.bfloat16)


def ops_only(with_att=True):
    for i, (p, sc, c, k) in enumerate(layers):
        op(xs[k], p, sc, c, None)
        if with_att and i % 4 == 0 and i < 120:
            kk, vv = kv[i // 4]
            att(q, kk[:, :, : C + 1], vv[:, :, : C + 1], mask, 0.125)


t = load_target("smollm2-135m-instruct", dtype="bfloat16", device="cpu", quantize="w8a16", compiled=True)
Cm.compile_verify(t)
d = DFlashDraftModel.from_pretrained("drafters/smollm2-135m-instruct").eval()
ids = torch.randint(100, 20000, (1, C + 20), generator=torch.Generator().manual_seed(0))
eng = static_decoder(t, d, ids[:, :C], dtype="bfloat16")


def verify():
    eng.forward_block(ids[:, C : C + 1], torch.arange(C, C + 1)[None])
    t.crop(eng.cache, C)


times = {"linears": [], "linears+attention": [], "verify": []}
with torch.no_grad():
    for _ in range(10):
        verify()
        ops_only()
    for _ in range(30):
        for name, f in (
            ("linears", lambda: ops_only(False)),
            ("linears+attention", ops_only),
            ("verify", verify),
        ):
            s = time.perf_counter()
            for _ in range(5):
                f()
            times[name].append((time.perf_counter() - s) / 5)
for name, v in times.items():
    print(f"C={C} {name}: {1e3 * statistics.median(v):.2f} ms")

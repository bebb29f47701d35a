"""Compiled verify after 256 tokens, n = 1..16: one graph for every length (main), a graph per length (`static`),
or the two ranges 2-4 and 5-64 (`ranges`, the reverted d640f2b, patched in here). benchmarks/README.md, 2026-11-27.
Run: python benchmarks/scripts/verify_lengths.py symbolic|static|ranges bfloat16 [- 1,2,4,8,16]"""
import sys, time, torch
import flashdraft.engine.compiled as C
from flashdraft.targets.target import load_target
from flashdraft.drafter.model import DFlashDraftModel
from flashdraft.engine.measure import static_decoder, median_seconds
mode, dtype = sys.argv[1], sys.argv[2]
if mode == "static":  # the verify length (ids dim 1, mask dim 2) left to dynamo: specialised per length
    orig = C.symbolic_sizes
    def sym(t, *dims):
        if t is not None and t.dim() == 4 and dims == (0, 2, 3): dims = (0, 3)
        elif t is not None and t.dim() == 2 and dims == (0, 1): dims = (0,)
        orig(t, *dims)
    C.symbolic_sizes = sym
    torch._dynamo.config.automatic_dynamic_shapes = False
if mode == "ranges":  # the verify length symbolic within [2, 4] or [5, 64]: two graphs, each tuned for its range
    def sym(t, *dims):
        if t is None: return
        ndim = t.dim()
        if (ndim == 4 and dims == (0, 2, 3)) or (ndim == 2 and dims == (0, 1)):
            ndim_n = 2 if ndim == 4 else 1
            n = t.shape[ndim_n]
            for d in dims:
                if d == ndim_n:
                    if n > 1:
                        lo, hi = (2, 4) if n <= 4 else (5, 64)
                        torch._dynamo.mark_dynamic(t, d, min=lo, max=hi)
                elif t.shape[d] > 1:
                    torch._dynamo.maybe_mark_dynamic(t, d)
            return
        for d in dims:
            if t.shape[d] > 1: torch._dynamo.maybe_mark_dynamic(t, d % t.dim())
    C.symbolic_sizes = sym
t = load_target("smollm2-135m-instruct", dtype=dtype, device="cpu")
print(C.compile_verify(t))
if len(sys.argv) > 3 and sys.argv[3] != "-": t.compile_options["options"]["max_autotune_gemm_backends"] = sys.argv[3]
d = DFlashDraftModel.from_pretrained("drafters/smollm2-135m-instruct").eval()
ids = torch.randint(100, 20000, (1, 300))
eng = static_decoder(t, d, ids[:, :256], dtype=dtype)
c = 256
for n in [int(x) for x in (sys.argv[4] if len(sys.argv) > 4 else "1,2,4,8,16").split(",")]:
    def verify():
        eng.forward_block(ids[:, c:c+n], torch.arange(c, c+n)[None]); t.crop(eng.cache, c)
    s = time.time(); verify(); first = time.time() - s
    print(f"{mode} n={n}: {1000*median_seconds(verify, 15):.1f} ms (first call {first:.0f} s)", flush=True)

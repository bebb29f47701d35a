"""Per-kernel profile of the compiled verify of SmolLM2-135M (fp32) after 256 tokens, at the given lengths
(inductor's kernel profiling on). benchmarks/README.md, 2026-11-27. Run: python benchmarks/scripts/verify_profile.py 1,16"""
import sys, time, torch
import flashdraft.compiled as C
from flashdraft.target import load_target
from flashdraft.model import DFlashDraftModel
from flashdraft.measure import static_decoder, median_seconds
torch._inductor.config.cpp.enable_kernel_profile = True
torch.set_num_threads(2)
t = load_target("smollm2-135m-instruct", dtype="float32", device="cpu")
print(C.compile_verify(t))
d = DFlashDraftModel.from_pretrained("drafters/smollm2-135m-instruct").eval()
ids = torch.randint(100, 20000, (1, 300))
eng = static_decoder(t, d, ids[:, :256], dtype="float32")
c = 256
for n in [int(x) for x in sys.argv[1].split(",")]:
    def verify():
        eng.forward_block(ids[:, c:c+n], torch.arange(c, c+n)[None]); t.crop(eng.cache, c)
    verify()
    print(f"n={n}: {1000*median_seconds(verify, 15):.1f} ms", flush=True)
    with torch.profiler.profile() as prof:
        for _ in range(5): verify()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))

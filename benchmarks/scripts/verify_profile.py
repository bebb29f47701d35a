"""Per-kernel profile of the compiled verify of SmolLM2-135M after 256 tokens, at the given lengths (inductor's kernel
profiling on), in the given dtype and quantization. benchmarks/README.md, 2026-11-27 (fp32) and 2026-11-28 (bf16,
int8 x bf16). Run: python benchmarks/scripts/verify_profile.py 1,16 [float32|bfloat16] [int8]"""
import sys, time, torch
import flashdraft.engine.compiled as C
from flashdraft.targets.target import load_target
from flashdraft.drafter.model import DFlashDraftModel
from flashdraft.engine.measure import static_decoder, median_seconds
torch._inductor.config.cpp.enable_kernel_profile = True
torch.set_num_threads(2)
dtype = sys.argv[2] if len(sys.argv) > 2 else "float32"
quantize = sys.argv[3] if len(sys.argv) > 3 else None
t = load_target("smollm2-135m-instruct", dtype=dtype, device="cpu", quantize=quantize, compiled=True)
print(C.compile_verify(t))
d = DFlashDraftModel.from_pretrained("drafters/smollm2-135m-instruct").eval()
ids = torch.randint(100, 20000, (1, 300))
eng = static_decoder(t, d, ids[:, :256], dtype=dtype)
c = 256
for n in [int(x) for x in sys.argv[1].split(",")]:
    def verify():
        eng.forward_block(ids[:, c:c+n], torch.arange(c, c+n)[None]); t.crop(eng.cache, c)
    verify()
    print(f"n={n}: {1000*median_seconds(verify, 15):.1f} ms", flush=True)
    with torch.profiler.profile() as prof:
        for _ in range(5): verify()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))

"""fp32 linears of SmolLM2-135M's shapes (30 of each, the head once) through inductor's C++ GEMM template, frozen, one
symbolic row count as the verify has it: ms, GB/s of weights and GFLOP/s at 1-16 rows. benchmarks/README.md,
2026-11-27 (avx2 EPYC). Run: python benchmarks/scripts/gemm_rows.py"""
import sys, time, torch, statistics
import flashdraft.engine.compiled as C
torch.set_num_threads(2)
shapes = {"qo": (576, 576), "kv": (576, 192), "gate_up": (576, 1536), "down": (1536, 576), "head": (576, 49152)}
mode = sys.argv[1] if len(sys.argv) > 1 else "dynamic"
opts = C.compile_options(torch.device("cpu"))
res = {}
for name, (k, n) in shapes.items():
    layers = 30 if name != "head" else 1
    mods = torch.nn.ModuleList([torch.nn.Linear(k, n, bias=False) for _ in range(min(layers, 30))]).eval()
    def f(x):
        out = 0
        for m in mods:
            out = out + m(x).sum()
        return out
    fn = C.compile_whole(f, C.fresh_options(opts))
    for M in (1, 2, 4, 8, 16):
        x = torch.randn(M, k)
        if mode == "dynamic" and M > 1:
            torch._dynamo.maybe_mark_dynamic(x, 0)
        with torch.no_grad():
            t0 = time.time(); fn(x); first = time.time() - t0
            ts = []
            for _ in range(15):
                t0 = time.perf_counter(); fn(x); ts.append(time.perf_counter() - t0)
        t = statistics.median(ts)
        byt = len(mods) * k * n * 4
        print(f"{name:8s} M={M:2d}: {1000*t:7.2f} ms  {byt/t/1e9:5.1f} GB/s  {2*M*len(mods)*k*n/t/1e9:6.1f} GFLOP/s  (compile {first:.0f}s)", flush=True)

"""The w8a16 kernel's two paths by row count (w8a16_cpp.set_vnni_rows: vpdpbusd up to that many code rows, two per
token, AMX's tiles above): SmolLM2-135M's compiled verify after 256 tokens through the engine (`static_decoder`),
at 1-16 tokens, each threshold in turn within one round, rounds interleaved, median ms; and int8 (`--quantize
int8`, inductor's GEMMs) beside it when given. The kernels give the same bits (tests/test_w8a16.py), so the
threshold is a speed choice only. With `prefetch`: the distances the kernels prefetch their weights ahead
(w8a16_cpp.set_prefetch, bytes; 0: none) instead of the thresholds, at the default threshold.
benchmarks/README.md, 2026-12-05 (stop 74) and 2026-12-06 (prefetch).
Run: python benchmarks/scripts/w8a16_rows.py [int8] [prefetch]"""

import statistics
import sys
import time

import torch

from flashdraft.kernels import w8a16_cpp
from flashdraft.engine.compiled import compile_verify
from flashdraft.engine.measure import static_decoder
from flashdraft.drafter.model import DFlashDraftModel
from flashdraft.targets.target import load_target

torch.set_num_threads(2)
lengths = (1, 2, 3, 4, 6, 8, 16)
prefetch = "prefetch" in sys.argv[1:]
schemes = [a for a in sys.argv[1:] if a != "prefetch"]
amx = w8a16_cpp.prepare() and w8a16_cpp.kernels() == "avx512_vnni+amx"
settings = (0, 1024, 2048, 4096) if prefetch else (2, 4, 6, 8, 16) if amx else (8,)
ids = torch.randint(100, 20000, (1, 300), generator=torch.Generator().manual_seed(0))
draft = DFlashDraftModel.from_pretrained("drafters/smollm2-135m-instruct").eval()
configs = {}
for scheme in ["w8a16"] + schemes:
    target = load_target(
        "smollm2-135m-instruct", dtype="bfloat16", device="cpu", quantize=scheme, compiled=True
    )
    compile_verify(target)
    configs[scheme] = (target, static_decoder(target, draft, ids[:, :256], dtype="bfloat16"))


def verify(scheme: str, n: int) -> None:
    target, engine = configs[scheme]
    engine.forward_block(ids[:, 256 : 256 + n], torch.arange(256, 256 + n)[None])
    target.crop(engine.cache, 256)


runs = [("w8a16", t) for t in settings] + [(s, None) for s in schemes]
times: dict[tuple, list[float]] = {(run, n): [] for run in runs for n in lengths}
with torch.no_grad():
    for scheme in configs:
        for n in lengths:  # compiles
            verify(scheme, n)
    for _ in range(8):
        for run in runs:
            if run[1] is not None:
                (w8a16_cpp.set_prefetch if prefetch else w8a16_cpp.set_vnni_rows)(run[1])
            for n in lengths:
                for _ in range(5):
                    start = time.perf_counter()
                    verify(run[0], n)
                    times[(run, n)].append(time.perf_counter() - start)
print("ms at", " ".join(f"{n:>6}" for n in lengths), "tokens")
for run in runs:
    setting = f"prefetch {run[1]} bytes ahead" if prefetch else f"vpdpbusd to {run[1]} code rows"
    label = f"{run[0]}, {setting}" if run[1] is not None else run[0]
    print(f"{label:34}", " ".join(f"{1e3 * statistics.median(times[(run, n)]):6.2f}" for n in lengths))

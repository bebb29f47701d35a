"""The fused decoder layer (decoder_layer_cpp.py) against inductor's graph of the model's own layers, for
`--quantize w8a16 --compile`: SmolLM2-135M's verify after 256 tokens through the engine (`static_decoder`) at 1-16
tokens, and plain decoding of 128 tokens after an 8-token prompt, the two targets in one process, interleaved,
medians; with each target's first compile time and whether the two decode the same tokens.
benchmarks/README.md, 2026-12-06 (stop 77). Run: python benchmarks/scripts/fused_layer_ab.py"""

import statistics
import time

import torch
from fused_targets import fused_and_unfused  # beside this script

from flashdraft.generate import generate_ar
from flashdraft.engine.measure import static_decoder
from flashdraft.drafter.model import DFlashDraftModel

torch.set_num_threads(2)
lengths = (1, 2, 4, 8, 16)
ids = torch.randint(100, 20000, (1, 300), generator=torch.Generator().manual_seed(0))
draft = DFlashDraftModel.from_pretrained("drafters/smollm2-135m-instruct").eval()
configs = {
    name: (target, static_decoder(target, draft, ids[:, :256], dtype="bfloat16"))
    for name, target in fused_and_unfused().items()
}


def verify(name: str, n: int) -> None:
    target, engine = configs[name]
    engine.forward_block(ids[:, 256 : 256 + n], torch.arange(256, 256 + n)[None])
    target.crop(engine.cache, 256)


def plain(name: str) -> tuple[float, list[int]]:
    out = generate_ar(configs[name][0], ids[:, :8], max_new_tokens=128)
    return out.decode_s / (len(out.new_tokens) - 1), out.new_tokens


times = {(name, n): [] for name in configs for n in lengths}
steps = {name: [] for name in configs}
tokens = {}
with torch.no_grad():
    for name in configs:
        start = time.perf_counter()
        for n in lengths:
            verify(name, n)
        generate_ar(configs[name][0], ids[:, :8], max_new_tokens=4)
        print(f"{name}: first calls (compiles) {time.perf_counter() - start:.1f} s", flush=True)
    for _ in range(8):
        for name in configs:
            for n in lengths:
                for _ in range(5):
                    start = time.perf_counter()
                    verify(name, n)
                    times[(name, n)].append(time.perf_counter() - start)
            step, tokens[name] = plain(name)
            steps[name].append(step)
print("verify after 256, ms at", " ".join(f"{n:>6}" for n in lengths), "tokens")
for name in configs:
    print(f"{name:26}", " ".join(f"{1e3 * statistics.median(times[(name, n)]):6.2f}" for n in lengths))
ratios = [statistics.median(times[("unfused", n)]) / statistics.median(times[("fused", n)]) for n in lengths]
print(f"{'unfused / fused':26}", " ".join(f"{r:5.2f}x" for r in ratios))
for name in configs:
    print(
        f"plain, 8-token prompt, {name}: {1e3 * statistics.median(steps[name]):.2f} ms a token "
        f"({1 / statistics.median(steps[name]):.0f} tok/s)"
    )
print("same 128 tokens:", tokens["fused"] == tokens["unfused"])

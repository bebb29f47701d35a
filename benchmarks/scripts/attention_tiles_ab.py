"""The attention kernel's scores on AMX's tiles against its vector FMAs (attention_cpp.py), switched in one process
(`attention_cpp.set_tiles`), interleaved, medians: the operator alone (SmolLM2-135M's heads: 9 over 3 KV heads of
64, a causal bool mask, 1-16 queries over 300 and 1000 columns), then through the engine on SmolLM2-135M
`--dtype bfloat16 --quantize w8a16 --compile`: the verify of 1-16 tokens after 256 (or the context given), the
drafter's pass (16 queries over the context), and plain decoding of 128 tokens after an 8-token prompt.
benchmarks/README.md, 2026-12-06 (stop 78). Run: python benchmarks/scripts/attention_tiles_ab.py [context]"""

import functools
import statistics
import sys
import time

import torch

from flashdraft.kernels import attention_cpp
from flashdraft.engine.compiled import compile_verify
from flashdraft.generate import generate_ar
from flashdraft.engine.measure import static_decoder
from flashdraft.drafter.model import DFlashDraftModel
from flashdraft.targets.target import load_target

torch.set_num_threads(2)
context = int(sys.argv[1]) if len(sys.argv) > 1 else 256
assert attention_cpp.prepare(torch.bfloat16) and attention_cpp.tiles(), (
    "no AMX tiles here: nothing to compare"
)
MODES = {"vector FMAs": False, "AMX tiles": True}


def median_us(fn, rounds: int = 200) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


print("the operator alone, us (two interleaved rounds each)")
for width in (300, 1000):
    for n in (1, 4, 8, 16):
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, n, 9, 64, generator=g).bfloat16().transpose(1, 2)
        k, v = (torch.randn(1, 3, width + 64, 64, generator=g).bfloat16() for _ in range(2))
        sees = torch.ones(n, width, dtype=torch.bool).tril(width - n)[None, None]
        got = {name: [] for name in MODES}
        for _ in range(2):
            for name, mode in MODES.items():
                attention_cpp.set_tiles(mode)
                got[name].append(
                    median_us(functools.partial(attention_cpp.short_attention, q, k, v, sees, 0.125))
                )
        print(
            f"  {n:2d} x {width:4d}: "
            + "  ".join(f"{name} {a:6.1f} / {b:6.1f}" for name, (a, b) in got.items())
        )

ids = torch.randint(100, 20000, (1, context + 16), generator=torch.Generator().manual_seed(0))
target = load_target("smollm2-135m-instruct", dtype="bfloat16", device="cpu", quantize="w8a16", compiled=True)
compile_verify(target)
draft = DFlashDraftModel.from_pretrained("drafters/smollm2-135m-instruct").eval().to(torch.bfloat16)
engine = static_decoder(target, draft, ids[:, :context], dtype="bfloat16")
lengths = (1, 2, 4, 8, 16)


def verify(n: int) -> None:
    engine.forward_block(ids[:, context : context + n], torch.arange(context, context + n)[None])
    target.crop(engine.cache, context)


def draft_pass() -> None:
    engine.proposer.draft_rows(engine.rows)


def plain() -> tuple[float, list[int]]:
    out = generate_ar(target, ids[:, :8], max_new_tokens=128)
    return out.decode_s / (len(out.new_tokens) - 1), out.new_tokens


with torch.no_grad():
    start = time.perf_counter()
    for n in lengths:
        verify(n)
    draft_pass()
    generate_ar(target, ids[:, :8], max_new_tokens=4)
    print(f"first calls (compiles) {time.perf_counter() - start:.1f} s", flush=True)
    times = {(name, n): [] for name in MODES for n in (*lengths, "draft")}
    steps = {name: [] for name in MODES}
    tokens = {}
    for _ in range(8):
        for name, mode in MODES.items():
            attention_cpp.set_tiles(mode)
            for n in lengths:
                for _ in range(5):
                    start = time.perf_counter()
                    verify(n)
                    times[(name, n)].append(time.perf_counter() - start)
            for _ in range(10):
                start = time.perf_counter()
                draft_pass()
                times[(name, "draft")].append(time.perf_counter() - start)
            step, tokens[name] = plain()
            steps[name].append(step)
    attention_cpp.set_tiles(True)
print(f"verify after {context}, ms at", " ".join(f"{n:>6}" for n in lengths), "tokens; the draft pass")
for name in MODES:
    row = [1e3 * statistics.median(times[(name, n)]) for n in (*lengths, "draft")]
    print(f"{name:16}", " ".join(f"{t:6.2f}" for t in row))
ratios = [
    statistics.median(times[("vector FMAs", n)]) / statistics.median(times[("AMX tiles", n)])
    for n in (*lengths, "draft")
]
print(f"{'FMAs / tiles':16}", " ".join(f"{r:5.2f}x" for r in ratios))
for name in MODES:
    ms = 1e3 * statistics.median(steps[name])
    print(f"plain, 8-token prompt, {name}: {ms:.2f} ms a token ({1e3 / ms:.0f} tok/s)")
print(
    "same 128 tokens:", tokens["vector FMAs"] == tokens["AMX tiles"], "(the scores' sums run in other orders)"
)

"""Paired in one process: compiled DFlash with the drafter's LM head over its vocabulary (`--draft-vocab` auto:
the 8192 most counted tokens) and over all 49152, alternating all, vocab, vocab, all per prompt; 4 GSM8K, 4
HumanEval and 4 MT-Bench prompts, 128 tokens; tok/s of whole generate() calls (graphs compiled and each side's
cost model measured before timing), τ, and every output against plain decoding. benchmarks/README.md, 2026-11-28.
Run: python benchmarks/scripts/draft_vocab_ab.py [bfloat16|float32] [int8]"""

import sys, time, torch
from flashdraft.engine.compiled import compile_verify
from flashdraft.prompts.benchmarks import load_bench_dataset
from flashdraft.generate import generate, generate_ar
from flashdraft.engine.measure import load_or_measure_costs
from flashdraft.drafter.model import DFlashDraftModel
from flashdraft.targets.target import load_target

dtype = sys.argv[1] if len(sys.argv) > 1 else "bfloat16"
quantize = sys.argv[2] if len(sys.argv) > 2 else None
t = load_target("smollm2-135m-instruct", dtype=dtype, device="cpu", quantize=quantize, compiled=True)
compile_verify(t)
arms = {}
for name, size in (("all", 0), ("vocab", None)):
    d = DFlashDraftModel.from_pretrained("drafters/smollm2-135m-instruct", dtype=t.dtype).eval()
    d.draft_vocab_size = size  # two drafters: each its own calibration tables
    arms[name] = (d, load_or_measure_costs(t, d))
    print(name, arms[name][1].summary(), flush=True)
prompts = []
for ds in ("gsm8k", "humaneval", "mt-bench"):
    for conv in load_bench_dataset(ds, max_samples=4, seed=0).conversations:
        prompts.append((ds, conv.id, t.encode_prompt(conv.user_turns[0])))
warm = t.encode_prompt("Hi")
for d, costs in arms.values():
    generate(t, d, warm, 8, costs=costs)  # compiles, untimed
out = {m: {} for m in arms}
for ds, cid, ids in prompts:
    ref = generate_ar(t, ids, 128).new_tokens
    for mode in ("all", "vocab", "vocab", "all"):
        d, costs = arms[mode]
        s = time.perf_counter()
        g = generate(t, d, ids, 128, costs=costs)
        dt = time.perf_counter() - s
        o = out[mode].setdefault(ds, [0, 0.0, 0, 0, 0, 0])
        o[0] += len(g.new_tokens)
        o[1] += dt
        o[2] += g.new_tokens == ref
        o[3] += 1
        o[4] += sum(g.acceptance_lengths)
        o[5] += len(g.acceptance_lengths)
    print(
        ds,
        cid,
        {
            m: f"{v[ds][0] / v[ds][1]:.1f} tok/s, τ {v[ds][4] / max(v[ds][5], 1):.2f}, {v[ds][2]}/{v[ds][3]} = ar"
            for m, v in out.items()
        },
        flush=True,
    )
for m, v in out.items():
    tok = sum(x[0] for x in v.values())
    s = sum(x[1] for x in v.values())
    eq = sum(x[2] for x in v.values())
    n = sum(x[3] for x in v.values())
    print(m, f"{tok / s:.1f} tok/s over {tok} tokens, {eq}/{n} = ar", flush=True)

"""Paired in one process: compiled bf16 DFlash with the drafter's LM head first over the cheap slots
(LAZY_HEAD_PRICE 2, main) and over every slot (1e9), alternating lazy, full, full, lazy per prompt; 6 GSM8K and 4
HumanEval prompts, 128 tokens; tok/s (the graphs compiled before timing) and every output against ar.
benchmarks/README.md, 2026-11-27. Run: python benchmarks/scripts/lazy_head_ab.py"""
import json, sys, time, torch
import flashdraft.engine.batched_dflash as B
from flashdraft.engine.compiled import compile_verify
from flashdraft.targets.target import load_target
from flashdraft.drafter.model import DFlashDraftModel
from flashdraft.generate import generate, generate_ar
from flashdraft.engine.measure import load_or_measure_costs
import gzip
from flashdraft.prompts.benchmarks import format_humaneval, BOXED_SUFFIX
t = load_target("smollm2-135m-instruct", dtype="bfloat16", device="cpu")
compile_verify(t)
d = DFlashDraftModel.from_pretrained("drafters/smollm2-135m-instruct").eval()
costs = load_or_measure_costs(t, d)
prompts = []
for i, l in enumerate(open("src/flashdraft/benchdata/gsm8k_test.jsonl")):
    if i in (82, 530, 788, 861, 100, 200):
        q = json.loads(l)["question"] + "\nPlease reason step by step, and put your final answer within \\boxed{}."
        prompts.append(("gsm8k", q))
for i, l in enumerate(gzip.open("src/flashdraft/benchdata/humaneval.jsonl.gz", "rt")):
    if i in (10, 66, 98, 107):
        r = json.loads(l)
        prompts.append(("humaneval", format_humaneval(r["prompt"])))
out = {"lazy": {}, "full": {}}
warm = t.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
generate(t, d, warm if isinstance(warm, list) else warm["input_ids"], 8, costs=costs)  # compiles, untimed
for name, q in prompts:
    ids = t.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
    if not isinstance(ids, list): ids = ids["input_ids"]
    ref = generate_ar(t, ids, 128).new_tokens
    for mode in ("lazy", "full", "full", "lazy"):
        B.LAZY_HEAD_PRICE = 2.0 if mode == "lazy" else 1e9
        s = time.perf_counter(); g = generate(t, d, ids, 128, costs=costs); dt = time.perf_counter() - s
        o = out[mode].setdefault(name, [0, 0.0, 0, 0])
        o[0] += len(g.new_tokens); o[1] += dt; o[2] += g.new_tokens == ref; o[3] += 1
    print(name, {m: f"{v[name][0]/v[name][1]:.1f} tok/s, {v[name][2]}/{v[name][3]} = ar" for m, v in out.items()}, flush=True)
for m, v in out.items():
    tok = sum(x[0] for x in v.values()); s = sum(x[1] for x in v.values())
    print(m, f"{tok/s:.1f} tok/s over {tok} tokens", flush=True)

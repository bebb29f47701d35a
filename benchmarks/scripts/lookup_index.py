"""Prompt lookup per row and step: the scan (`prompt_lookup`) against the index (`LookupIndex`), on real text.

A row's history is GSM8K prompts run together (SmolLM2's tokenizer), grown two tokens a step (about what a batched
step accepts) over its last 200 tokens, one lookup a step; both must give the same proposals. Prints microseconds
per lookup at a few history lengths. benchmarks/README.md, 2026-12-06 (stop 76).
Run: python benchmarks/scripts/lookup_index.py [target]"""

import sys
import time

from flashdraft.prompts.benchmarks import load_bench_dataset
from flashdraft.engine.lookup import LookupIndex, prompt_lookup
from flashdraft.targets.target import load_target

target = load_target(
    sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m-instruct", dtype="float32", device="cpu"
)
text: list[int] = []
for conversation in load_bench_dataset("gsm8k", max_samples=40, seed=0).conversations:
    text += target.encode_prompt(conversation.user_turns[0])[0].tolist()

for length in (300, 1000, 3000):
    base = text[:length]
    answers = {}
    for name in ("scan", "index"):
        history = list(base[: length - 200])
        index = LookupIndex(history)
        index.lookup(10)
        got, start = [], time.perf_counter()
        for j in range(length - 200, length, 2):
            history.extend(base[j : j + 2])
            got.append(prompt_lookup(history, 10, 3) if name == "scan" else index.lookup(10))
        answers[name] = got
        print(f"{length} tokens: {name} {(time.perf_counter() - start) / len(got) * 1e6:.1f} us a lookup")
    assert answers["scan"] == answers["index"], "the index answered differently from the scan"

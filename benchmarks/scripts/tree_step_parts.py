"""Where a tree step's extra time goes against a chain step of as many tokens: fixed shapes, one row, the engine's,
the proposer's and tree.py's functions timed inclusively (ms per step, median of 3 rounds after one that makes the
graphs), 4 GSM8K prompts, 128 tokens, SmolLM2-135M-Instruct w8a16 compiled with its shipped drafter.
Run from the repository root: python benchmarks/scripts/tree_step_parts.py [nodes]   (default 7)"""

import collections
import statistics
import sys

import torch

import flashdraft.batched_dflash as B
import flashdraft.compiled as C
import flashdraft.engine as E
import flashdraft.tree as T
from flashdraft import DFlashDraftModel, generate, load_target
from flashdraft.compiled import compile_verify
from flashdraft.datasets import load_bench_dataset

sys.path.insert(0, "benchmarks/scripts")
from call_timers import calls, spent, time_methods, timed  # noqa: E402 (beside this script)

time_methods(
    [
        (E.BatchDecoder, ["step", "forward_block", "_block", "_compact", "_gather_block", "_check_tree"]),
        (B.BatchedDFlashProposer, ["propose", "draft_rows", "_tree_for", "accept", "observe", "_compact"]),
    ]
)
C.VerifyForward.__call__ = timed("VerifyForward.__call__", C.VerifyForward.__call__)
for name in ("grow_tree", "slot_candidates", "accepted_path", "ancestor_mask"):
    if hasattr(T, name):
        setattr(T, name, timed(name, getattr(T, name)))
        for module in (B, E):
            if hasattr(module, name):
                setattr(module, name, getattr(T, name))

torch.set_num_threads(2)
target = load_target("smollm2-135m-instruct", dtype="bfloat16", device="cpu", quantize="w8a16", compiled=True)
compile_verify(target)
draft = DFlashDraftModel.from_pretrained("drafters/smollm2-135m-instruct", dtype=target.dtype).eval()
data = load_bench_dataset("gsm8k", max_samples=4, seed=0)
prompts = [target.encode_prompt(c.user_turns[0]) for c in data.conversations]
n = int(sys.argv[1]) if len(sys.argv) > 1 else 7
shapes = {"chain": dict(block_size=n + 1), "tree": dict(block_size=16, tree=n)}
res = collections.defaultdict(lambda: collections.defaultdict(list))
for rnd in range(4):
    for kind, spec in shapes.items():
        spent.clear()
        calls.clear()
        steps = sum(generate(target, draft, ids, 128, **spec).num_steps for ids in prompts)
        if rnd:
            for k, v in spent.items():
                res[kind][k].append(1e3 * v / steps)
names = sorted(
    set(res["chain"]) | set(res["tree"]), key=lambda k: -statistics.median(res["tree"].get(k, [0]))
)
print(f"ms per step, median of 3 rounds, {n} nodes")
for k in names:
    c, t = (statistics.median(res[kind].get(k, [0])) for kind in ("chain", "tree"))
    print(f"{k:40s} chain {c:7.3f}  tree {t:7.3f}  diff {t - c:+7.3f}")

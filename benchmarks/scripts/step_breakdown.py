"""Where a compiled DFlash step's time goes, part by part (inclusive wall time of each function, ms per engine
step), over real answers: SmolLM2-135M-Instruct and its shipped drafter, GSM8K prompts, 128 tokens, 2 threads.
Timers wrap the engine's, the proposer's and the drafter's functions; the graphs are compiled before timing.
Run: python benchmarks/scripts/step_breakdown.py [bfloat16|float32] [int8] [prompts]"""
import collections, json, sys, time
import torch
import flashdraft.engine.batched_dflash as B
import flashdraft.engine.decoder as E
import flashdraft.drafter.model as M
import flashdraft.drafter.context_cache as K
import flashdraft.engine.policy as P
from flashdraft.engine.compiled import compile_verify
from flashdraft.generate import generate, generate_ar
from flashdraft.engine.measure import load_or_measure_costs
from flashdraft.drafter.model import DFlashDraftModel
from flashdraft.targets.target import load_target

torch.set_num_threads(2)
dtype = sys.argv[1] if len(sys.argv) > 1 else "bfloat16"
quantize = sys.argv[2] if len(sys.argv) > 2 and sys.argv[2] != "none" else None
count = int(sys.argv[3]) if len(sys.argv) > 3 else 4
from call_timers import calls, spent, time_methods, timed  # noqa: E402 (beside this script)

time_methods([
    (E.BatchDecoder, ["step", "forward_block", "_block", "_compact"]),
    (B.BatchedDFlashProposer, ["propose", "draft_rows", "draft_more_slots", "_first_slots", "_choices", "timed", "observe", "accept", "_compact"]),
    (P.BatchPolicy, ["batch_rate"]),
    (M.DFlashDraftModel, ["forward"]),  # not _attention_masks: the compiled block pass traces it
    (K.DraftContextCache, ["append"]),
])
E.verify_greedy_rows = timed("verify_greedy_rows", E.verify_greedy_rows)
E.static_mask = timed("static_mask", E.static_mask)

import os
import flashdraft.engine.compiled as C
if os.environ.get("CONCAT"):  # experiment: inductor's concat-linear freezing pass on
    base = C.compile_options
    def with_concat(*a, **k):
        o = base(*a, **k)
        if "options" in o:
            o["options"]["cpp.enable_concat_linear"] = True
        return o
    C.compile_options = with_concat
t = load_target("smollm2-135m-instruct", dtype=dtype, device="cpu", quantize=quantize, compiled=True)
compile_verify(t)
d = DFlashDraftModel.from_pretrained("drafters/smollm2-135m-instruct").eval()
if os.environ.get("COSTS"):  # a cost model measured before (JSON): the same policy prices in an A/B
    from flashdraft.engine.costs import CostModel
    costs = CostModel.from_dict(json.load(open(os.environ["COSTS"])))
else:
    costs = load_or_measure_costs(t, d)
print("costs:", costs, flush=True)

# the compiled graphs' own calls
orig_init = B.BatchedDFlashProposer.__init__


def init(self, *a, **k):
    orig_init(self, *a, **k)
    if self.block_pass is not None:
        self.block_pass = timed("block_pass (compiled)", self.block_pass)
    self.head_logits = timed("head_logits", self.head_logits)
    if getattr(self, "head_drafts", None) is not None:
        self.head_drafts = timed("head_drafts (compiled)", self.head_drafts)
    if getattr(self, "context_pass", None) is not None:
        self.context_pass = timed("context_pass (compiled)", self.context_pass)


B.BatchedDFlashProposer.__init__ = init
C.VerifyForward.__call__ = timed("VerifyForward.__call__", C.VerifyForward.__call__)
C.run_compiled = timed("run_compiled (all graphs)", C.run_compiled)
import flashdraft.engine.compiled_draft as CD
CD.run_compiled = C.run_compiled  # the drafter's graphs call it by that module's name

prompts = []
for i, line in enumerate(open("src/flashdraft/benchdata/gsm8k_test.jsonl")):
    if len(prompts) < count and i in (82, 530, 788, 861, 100, 200, 300, 400):
        q = json.loads(line)["question"] + "\nPlease reason step by step, and put your final answer within \\boxed{}."
        prompts.append(q)


def encode(q):
    ids = t.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
    return ids if isinstance(ids, list) else ids["input_ids"]


generate(t, d, encode("Hi"), 16, costs=costs)  # compiles, untimed
generate_ar(t, encode("Hi"), 8)
spent.clear(); calls.clear()
spent_total, calls_total = collections.Counter(), collections.Counter()
tokens = steps = exact = 0
wall = 0.0
for q in prompts:
    ids = encode(q)
    ref = generate_ar(t, ids, 128).new_tokens
    spent.clear(); calls.clear()
    s = time.perf_counter()
    g = generate(t, d, ids, 128, costs=costs)
    wall += time.perf_counter() - s
    tokens += len(g.new_tokens)
    steps_here = len(g.acceptance_lengths)
    steps += steps_here
    exact += g.new_tokens == ref
    spent_total.update(spent); calls_total.update(calls)
    print(f"prompt: {len(g.new_tokens)} tokens, {steps_here} steps, tau {len(g.new_tokens) / steps_here:.2f}, "
          f"{g.proposer_stats}", flush=True)
print(f"{tokens} tokens in {wall:.2f} s = {tokens / wall:.1f} tok/s, {steps} steps ({1000 * wall / steps:.2f} ms a "
      f"step), {exact}/{len(prompts)} equal to ar")
for name, s in sorted(spent_total.items(), key=lambda x: -x[1]):
    print(f"{name:45s} {1000 * s / steps:8.3f} ms/step  {calls_total[name] / steps:5.2f} calls/step")

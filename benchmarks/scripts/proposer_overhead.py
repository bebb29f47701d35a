"""What a DFlash proposer's presence costs a batch when it proposes nothing: plain decoding against the same rows
with the drafter attached but every proposal empty (its feature taps in the verify, its bookkeeping), 3 rounds
interleaved, inclusive wall time of the engine's and the proposer's functions.
Run: B=8 python benchmarks/scripts/proposer_overhead.py   (B rows of GSM8K, compiled SmolLM2-135M quantized by
QUANTIZE, int8 unless set; REAL=1 lets the proposer propose)"""

import collections
import os
import time

import torch

import flashdraft.engine.batched_dflash as B
import flashdraft.engine.policy as P
import flashdraft.engine.compiled as C
import flashdraft.engine.decoder as E
from flashdraft.engine.compiled import compile_verify
from flashdraft.prompts.benchmarks import load_bench_dataset
from flashdraft.generate import generate_batch
from flashdraft.engine.measure import load_or_measure_costs
from flashdraft.drafter.model import DFlashDraftModel
from flashdraft.targets.target import load_target

torch.set_num_threads(2)
from call_timers import calls, spent, time_methods, timed  # noqa: E402 (beside this script)

time_methods(
    [
        (E.BatchDecoder, ["step", "add", "forward_block", "_block", "_compact", "_remove", "_merge"]),
        (
            B.BatchedDFlashProposer,
            ["propose", "accept", "add", "remove", "observe", "timed", "_free_proposal", "draft_rows"],
        ),
        (P.BatchPolicy, ["batch_rate"]),
    ]
)
C.VerifyForward.__call__ = timed("VerifyForward.__call__", C.VerifyForward.__call__)
E.verify_greedy_rows = timed("verify_greedy_rows", E.verify_greedy_rows)
orig = B.BatchedDFlashProposer.propose


def nothing(self, rows, m):
    if os.environ.get("REAL"):
        return orig(self, rows, m)
    for c in self.counts:
        c["plain"] += 1
    self._q = [None] * len(rows)
    self._trees = [None] * len(rows)
    self._last = [None] * len(rows)
    return [torch.empty(0, dtype=torch.long) for _ in rows]


B.BatchedDFlashProposer.propose = nothing
quantize = os.environ.get("QUANTIZE", "int8")
t = load_target("smollm2-135m-instruct", dtype="bfloat16", device="cpu", quantize=quantize, compiled=True)
compile_verify(t)
d = DFlashDraftModel.from_pretrained("drafters/smollm2-135m-instruct", dtype=t.dtype).eval()
costs = load_or_measure_costs(t, d)
b = int(os.environ.get("B", 8))
data = load_bench_dataset("gsm8k", max_samples=b, seed=0)
prompts = [t.encode_prompt(c.user_turns[0])[0].tolist() for c in data.conversations][:b]
res = collections.defaultdict(list)
for rnd in range(3):
    for m, dr in (("plain", None), ("dflash-nothing", d)):
        generate_batch(t, dr, prompts[:2], 8, costs=costs)
        spent.clear()
        calls.clear()
        t0 = time.perf_counter()
        out = generate_batch(t, dr, prompts, 64, costs=costs)
        dt = time.perf_counter() - t0
        res[m].append(spent["BatchDecoder.step"])
        print(f"## {m} r{rnd}: {dt:.2f}s steps {calls['BatchDecoder.step']}", flush=True)
        for name, s in sorted(spent.items(), key=lambda x: -x[1])[:12]:
            print(f"   {name:40s} {s * 1000:9.1f} ms  {calls[name]} calls")
print({m: [round(x, 3) for x in v] for m, v in res.items()})

"""How well the policy's tree estimates hold: each verified tree node's estimated acceptance (its score over its
parent's) against whether the target took it, by the node's place in the tree, and each step's expected tokens
against the tokens it emitted, by node count. SmolLM2-135M-Instruct and its shipped drafter, compiled, 128 tokens,
2 threads; prompts from GSM8K, HumanEval and the held-out Python tasks; `--tree auto`, then chains for the same
prompts (tokens per second of both, outputs checked against plain decoding).

A node is "main" when it and its ancestors are each their slot's top candidate (the chain's nodes), "sibling" when
it is a lower candidate under a main parent, "below" when its parent is off the main chain (the drafter predicted
its slot with the main chain's tokens before it, not this branch's), "lookup" when prompt lookup's branch put it.
With AB=1 a second copy of the drafter learns one table over all depths (calibration.py before the depth groups),
with AB=below one whose tree nodes below a lower candidate share the keys of the drafter's line (calibration.py
before `BELOW`), its chains and trees interleaved prompt by prompt with the depth-keyed ones; each figure is
labelled by its tables.
Run: [AB=1|below] python benchmarks/scripts/tree_calibration.py [bfloat16|float32] [int8|none] [prompts per set]"""
import collections, json, os, sys, time
import torch
import flashdraft.engine.batched_dflash as B
from flashdraft.engine.calibration import calibration_for
from flashdraft.engine.compiled import compile_verify
from flashdraft.prompts.benchmarks import load_bench_dataset
from flashdraft.generate import generate, generate_ar
from flashdraft.engine.measure import load_or_measure_costs
from flashdraft.drafter.model import DFlashDraftModel
from flashdraft.targets.target import load_target

torch.set_num_threads(2)
dtype = sys.argv[1] if len(sys.argv) > 1 else "bfloat16"
quantize = sys.argv[2] if len(sys.argv) > 2 and sys.argv[2] != "none" else None
count = int(sys.argv[3]) if len(sys.argv) > 3 else 3

nodes = collections.defaultdict(lambda: [0.0, 0, 0])  # class -> [sum of estimates, hits, trials]
steps = collections.defaultdict(lambda: [0.0, 0, 0])  # node count -> [sum of expected tokens, tokens, steps]
pending: dict[int, tuple] = {}
DEPTHS = ["d0", "d1", "d2-3", "d2-3", "d4+"]


def tables(proposer):
    if getattr(proposer.calibration, "no_below", False):
        return "nobelow"
    return "depth" if len(proposer.calibration.depth_groups) > 1 else "one"


def node_classes(proposer, tree):
    bins = proposer.calibration.confidence_bins
    lookup = proposer.calibration.tree_lookup_key
    main, depth, out = [], [], []
    for j, (parent, key) in enumerate(zip(tree.parents, tree.keys.tolist())):
        on_main = parent < 0 or main[parent]
        depth.append(0 if parent < 0 else depth[parent] + 1)
        if key >= lookup:
            kind = "lookup"
        elif not on_main:
            kind = "below"
        else:
            kind = "main" if key % (3 * bins) < bins else "sibling"
        main.append(kind == "main")
        out.append(f"{tables(proposer)} {kind} {DEPTHS[min(depth[-1], len(DEPTHS) - 1)]}")
    return out


orig_propose, orig_observe = B.BatchedDFlashProposer.propose, B.BatchedDFlashProposer.observe
orig_timed = B.BatchedDFlashProposer.timed
seconds = collections.defaultdict(list)  # ("propose" | "verify", "tree" | "chain", verify length) -> seconds
kind_now = [None, 0.0]


def propose(self, rows, max_drafts):
    t0 = time.perf_counter()
    out = orig_propose(self, rows, max_drafts)
    kind_now[:] = [f"{tables(self)} {'tree' if self._trees[0] is not None else 'chain'}", time.perf_counter() - t0]
    pending.clear()
    for i, last in enumerate(self._last):
        if last is not None and last[0] == "tree":
            pending[i] = (last[1], node_classes(self, last[1]))
        elif last is not None and last[0] == "dflash":  # a chain: its nodes' estimates, by depth
            keys = last[1]
            pending[i] = (keys, self.calibration.draft.p(keys).tolist(), tables(self))
    return out


def observe(self, rows, proposed, accepted, paths=None):
    for i, (tree, kinds, *tag) in pending.items():
        if not hasattr(tree, "parents"):  # a chain of len(keys) drafts, `accepted[i]` of them taken
            for j, est in enumerate(kinds[: accepted[i] + 1]):
                cell = nodes[f"{tag[0]} chain {DEPTHS[min(j, len(DEPTHS) - 1)]}"]
                cell[0] += est
                cell[1] += j < accepted[i]
                cell[2] += 1
            continue
        path = set(paths[i])
        scores = tree.scores.tolist()
        for j, parent in enumerate(tree.parents):
            if parent >= 0 and parent not in path:
                continue
            est = scores[j] / (1.0 if parent < 0 else scores[parent])
            cell = nodes[kinds[j]]
            cell[0] += est
            cell[1] += j in path
            cell[2] += 1
        cell = steps[kinds[0].split()[0], len(tree)]
        cell[0] += float(tree.expected_tokens()[-1])
        cell[1] += len(path) + 1
        cell[2] += 1
    pending.clear()
    return orig_observe(self, rows, proposed, accepted, paths)


def timed(self, rows, tokens_per_row, context, s):
    if tokens_per_row > 1 and self._last[0] is not None and self._last[0][0] in ("tree", "dflash"):
        seconds["propose", kind_now[0], tokens_per_row].append(kind_now[1])
        seconds["verify", kind_now[0], tokens_per_row].append(s)
    return orig_timed(self, rows, tokens_per_row, context, s)


B.BatchedDFlashProposer.propose, B.BatchedDFlashProposer.observe = propose, observe
B.BatchedDFlashProposer.timed = timed

t = load_target("smollm2-135m-instruct", dtype=dtype, device="cpu", quantize=quantize, compiled=True)
compile_verify(t)
d = DFlashDraftModel.from_pretrained("drafters/smollm2-135m-instruct").eval()
drafters = {"depth": d}
if os.environ.get("AB") == "below":
    drafters["nobelow"] = DFlashDraftModel.from_pretrained("drafters/smollm2-135m-instruct").eval()
    cal = calibration_for(drafters["nobelow"])
    cal.no_below, own_keys = True, cal.draft_keys
    cal.draft_keys = lambda confidence, candidates=False, below=False: own_keys(confidence, candidates)
elif os.environ.get("AB"):
    drafters["one"] = DFlashDraftModel.from_pretrained("drafters/smollm2-135m-instruct").eval()
    calibration_for(drafters["one"], depth_groups=(0,))
costs = load_or_measure_costs(t, d)
print("costs:", costs, flush=True)


def encode(text):
    ids = t.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return ids if isinstance(ids, list) else ids["input_ids"]


sets = ["gsm8k", "humaneval", "benchmarks/data/heldout_python_tasks.jsonl"]
prompts = [(s, c.user_turns[0]) for s in sets for c in load_bench_dataset(s, max_samples=count, seed=0).conversations]
with torch.no_grad():
    for dr in drafters.values():  # compiles, untimed
        generate(t, dr, encode("Hi"), 16, costs=costs, tree="auto")
        generate(t, dr, encode("Hi"), 16, costs=costs)
    generate_ar(t, encode("Hi"), 8)
    labels = (("tree", "auto"), ("chain", None))
    wall = collections.Counter()
    tokens = collections.Counter()
    verifies = collections.Counter()
    exact = collections.Counter()
    for name, text in prompts:
        ids = encode(text)
        ref = generate_ar(t, ids, 128).new_tokens
        for label, dr, tree in [(f"{k} {m}", dr, tr) for k, dr in drafters.items() for m, tr in labels]:
            s = time.perf_counter()
            g = generate(t, dr, ids, 128, costs=costs, tree=tree)
            wall[label] += time.perf_counter() - s
            tokens[label] += len(g.new_tokens)
            verifies[label] += len(g.acceptance_lengths)
            exact[label] += g.new_tokens == ref
print(f"{dtype} {quantize or ''}: {len(prompts)} prompts")
for label in wall:
    print(f"  {label}: {tokens[label] / wall[label]:.1f} tok/s, tau {tokens[label] / verifies[label]:.2f}, "
          f"{exact[label]}/{len(prompts)} equal to plain")
print("nodes tried (parent accepted): class, trials, mean estimate, hit rate")
for kind, (est, hits, trials) in sorted(nodes.items()):
    print(f"  {kind:18s} {trials:6d} {est / trials:.3f} {hits / trials:.3f}")
print("tree steps by node count: nodes, steps, mean expected tokens, mean tokens emitted")
for (tag, n), (est, got, k) in sorted(steps.items()):
    print(f"  {tag:5s} {n:3d} {k:5d} {est / k:.2f} {got / k:.2f}")
print("drafted steps by verify length: part, kind, verify length, steps, median ms")
for key in sorted(seconds):
    v = sorted(seconds[key])
    print(f"  {key[0]:8s} {key[1]:11s} {key[2]:3d} {len(v):5d} {1000 * v[len(v) // 2]:.2f}")
print(json.dumps({"nodes": nodes, "steps": {f"{k[0]} {k[1]}": v for k, v in steps.items()}}))

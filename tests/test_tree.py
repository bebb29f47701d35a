"""Draft trees (tree.py): several candidates per slot verified in one forward, output still plain decoding's."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from conftest import VOCAB, hybrid_model, needs_kernel, replan, tiny_model
from flashdraft import DFlashDraftModel, SamplingParams, Target, generate, generate_ar, generate_batch
from flashdraft.engine.batched_dflash import BatchedDFlashProposer
from flashdraft.engine.costs import CostModel
from flashdraft.engine.decoder import BatchDecoder
from flashdraft.engine.kv_cache import static_mask
from flashdraft.engine.proposers import BatchProposer
from flashdraft.engine.tree import (
    accepted_path,
    add_branch,
    ancestor_mask,
    block_parents,
    check_tree,
    depths,
    grow_tree,
    tree_window,
)
from flashdraft.generate import run
from flashdraft.kernels import attention
from test_sampling import PROMPT, V, assert_same_law, exact_joint, small_target  # noqa: F401 - fixture

TREE_ARCHS = ["llama", "qwen3", "gemma3"]


def tree_target(arch: str, seed: int = 0) -> Target:
    """gemma3 with a 64-token window: trees while a row fits in it, chains past it."""
    extra = {"sliding_window": 64} if arch == "gemma3" else {}
    return Target(tiny_model(arch, seed=seed, **extra))


def random_prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 20))] for _ in range(n)]


def random_tree(rng: random.Random, nodes: int, depth: int) -> list[int]:
    """Parents of a random tree: each node under a random earlier node (or the anchor), at most `depth` deep."""
    parents: list[int] = []
    for _ in range(nodes):
        d = depths([-1] + [p + 1 for p in parents])
        parents.append(rng.choice([-1] + [j for j in range(len(parents)) if d[j + 1] < depth]))
    return parents


class OracleTreeProposer(BatchProposer):
    """Proposes random trees in which the target's true continuation (greedy, or the seed's sample) hides on a
    random branch, cut at a random depth: paths through every kind of node get accepted."""

    def __init__(self, references: dict[tuple[int, ...], list[int]], nodes: int, rng: random.Random) -> None:
        self.references = references  # prompt -> prompt + true continuation
        self.nodes = nodes
        self.rng = rng
        self.max_block_size = 6
        self.refs: list[list[int]] = []
        self.parents: list[list[int] | None] = []
        self.tree_steps = 0

    def add(self, row, features) -> None:
        self.refs.append(self.references[tuple(row.prompt[0].tolist())])
        self.parents.append(None)

    def remove(self, keep: list[int]) -> None:
        self.refs = [self.refs[i] for i in keep]
        self.parents = [self.parents[i] for i in keep]

    def tree_parents(self, index: int) -> list[int] | None:
        return self.parents[index]

    def propose(self, rows, max_drafts):
        out = []
        for i, (row, m) in enumerate(zip(rows, max_drafts, strict=True)):
            self.parents[i] = None
            if m < 1:
                out.append(torch.empty(0, dtype=torch.long))
                continue
            parents = random_tree(self.rng, self.rng.randint(1, self.nodes), m)
            d = depths([-1] + [p + 1 for p in parents])[1:]
            true_depth = self.rng.randint(0, m)  # how deep the truth goes in this tree
            tokens: list[int] = []
            on_truth: list[bool] = []
            for j, p in enumerate(parents):
                pos = row.anchor_position + d[j]
                truth = self.refs[i][pos] if pos < len(self.refs[i]) else 0
                siblings = {tokens[k] for k in range(j) if parents[k] == p}
                parent_true = p < 0 or on_truth[p]
                if parent_true and d[j] <= true_depth and truth not in siblings and self.rng.random() < 0.6:
                    tokens.append(truth)
                    on_truth.append(True)
                else:
                    choices = [t for t in range(3, VOCAB) if t not in siblings and t != truth]
                    tokens.append(self.rng.choice(choices))
                    on_truth.append(False)
            out.append(torch.tensor(tokens, dtype=torch.long))
            if any(p != j - 1 for j, p in enumerate(parents)):
                self.parents[i] = parents
                self.tree_steps += 1
        return out


def references(target: Target, prompts, limits, **sampling) -> dict[tuple[int, ...], list[int]]:
    refs = {}
    for p, m, seed in zip(prompts, limits, sampling.pop("seeds", [None] * len(prompts)), strict=True):
        new = generate_ar(target, p, m, stop_token_ids=[], seed=seed, **sampling).new_tokens
        refs[tuple(p)] = p + new + [0] * 40
    return refs


# ------------------------------------------------------------------------------------------------- the tree itself
def test_grow_tree_is_best_first_and_closed_under_ancestors():
    candidates = torch.tensor([[10, 11, 12], [20, 21, 22], [30, 31, 32]])
    p = torch.tensor([[0.9, 0.5, 0.1], [0.8, 0.3, 0.2], [0.6, 0.4, 0.1]])
    keys = torch.arange(9).view(3, 3)
    tree = grow_tree(candidates, p, keys, budget=6)
    # scores: 10 .9, 10-20 .72, 11 .5, 10-20-30 .432, 11-20 .4, 10-20-31 .288
    assert tree.tokens.tolist() == [10, 20, 11, 30, 20, 31]
    assert tree.parents == [-1, 0, -1, 1, 2, 1]
    assert torch.allclose(tree.scores, torch.tensor([0.9, 0.72, 0.5, 0.432, 0.4, 0.288]))
    assert tree.keys.tolist() == [0, 3, 1, 6, 3, 7]
    assert torch.allclose(
        tree.expected_tokens()[-1], torch.tensor(1 + 0.9 + 0.72 + 0.5 + 0.432 + 0.4 + 0.288)
    )
    assert tree.scores.tolist() == sorted(tree.scores.tolist(), reverse=True)
    assert all(parent < j for j, parent in enumerate(tree.parents))
    # one candidate per slot: the chain
    chain = grow_tree(candidates[:, :1], p[:, :1], keys[:, :1], budget=6)
    assert chain.is_chain and chain.tokens.tolist() == [10, 20, 30]
    assert grow_tree(candidates, p, keys, budget=2).first(1).tokens.tolist() == [10]


def test_nodes_below_a_lower_candidate_take_their_own_estimates_and_keys():
    """The drafter predicted slot d + 1 after its own draft at slot d: below a lower candidate the tree reads the
    `below` estimates and keys, on the drafter's line `p` and `keys`, and every score is the product along its path."""
    candidates = torch.tensor([[10, 11, 12], [20, 21, 22], [30, 31, 32]])
    p = torch.tensor([[0.9, 0.5, 0.1], [0.8, 0.3, 0.2], [0.6, 0.4, 0.1]])
    keys = torch.arange(9).view(3, 3)
    below = (p * 0.25, 100 + keys)
    tree = grow_tree(candidates, p, keys, budget=6, below=below)
    # scores: 10 .9, 10-20 .72, 11 .5, 10-20-30 .432, 10-20-31 .288, 10-21 .27; 11-20 fell from .4 to .1
    assert tree.tokens.tolist() == [10, 20, 11, 30, 31, 21]
    assert tree.parents == [-1, 0, -1, 1, 1, 0]
    assert torch.allclose(tree.scores, torch.tensor([0.9, 0.72, 0.5, 0.432, 0.288, 0.27]))
    # every node of a wide tree: off the drafter's line iff a lower candidate is among its ancestors (token t sits
    # at slot t // 10 - 1 as candidate t % 10)
    wide = grow_tree(candidates, p, keys, budget=27, below=below)
    tokens = wide.tokens.tolist()
    for j, parent in enumerate(wide.parents):
        slot, rank = divmod(tokens[j] - 10, 10)
        ancestors, a = [], parent
        while a >= 0:
            ancestors.append(tokens[a] % 10)
            a = wide.parents[a]
        off = any(ancestors)
        assert int(wide.keys[j]) == (100 if off else 0) + 3 * slot + rank
        score = 1.0 if parent < 0 else float(wide.scores[parent])
        assert float(wide.scores[j]) == pytest.approx(score * float((below[0] if off else p)[slot, rank]))
    # without `below`, the tree of before
    assert grow_tree(candidates, p, keys, budget=6).tokens.tolist() == [10, 20, 11, 30, 20, 31]


def test_a_lookup_branch_joins_the_tree_sharing_the_nodes_it_agrees_with():
    """A chain grafted on below the anchor (prompt lookup's match): it shares the nodes it follows (a shared node keeps
    the higher score), the rest hangs below as new nodes with their own keys; best-first, closed under ancestors, cut
    to the budget."""
    candidates = torch.tensor([[10, 11, 12], [20, 21, 22], [30, 31, 32]])
    p = torch.tensor([[0.9, 0.5, 0.1], [0.8, 0.3, 0.2], [0.6, 0.4, 0.1]])
    tree = grow_tree(candidates, p, torch.arange(9).view(3, 3), budget=6)  # [10, 20, 11, 30, 20, 31] as above
    branch = add_branch(tree, [10, 21, 40], torch.tensor([0.95, 0.9, 0.9]), torch.tensor([100, 101, 102]), 8)
    assert branch.tokens.tolist() == [10, 21, 40, 20, 11, 30, 20, 31]
    assert branch.parents == [-1, 0, 1, 0, -1, 3, 4, 3]
    assert branch.keys.tolist() == [0, 101, 102, 3, 1, 6, 3, 7]
    assert torch.allclose(branch.scores, torch.tensor([0.95, 0.855, 0.7695, 0.72, 0.5, 0.432, 0.4, 0.288]))
    cut = add_branch(tree, [10, 21, 40], torch.tensor([0.95, 0.9, 0.9]), torch.tensor([100, 101, 102]), 4)
    assert cut.tokens.tolist() == [10, 21, 40, 20] and cut.parents == [-1, 0, 1, 0]
    # a branch the tree already holds adds no node; its scores can lift a path to the front
    same = add_branch(tree, [11, 20], torch.tensor([1.0, 1.0]), torch.tensor([100, 101]), 8)

    def edges(t):  # (token, its parent's token) for every node
        tokens = t.tokens.tolist()
        return sorted((tokens[j], tokens[q] if q >= 0 else -1) for j, q in enumerate(t.parents))

    assert edges(same) == edges(tree)
    assert same.tokens.tolist()[:2] == [11, 20] and same.parents[:2] == [-1, 0]
    for t in (branch, cut, same):
        assert all(parent < j for j, parent in enumerate(t.parents))
        assert t.scores.tolist() == sorted(t.scores.tolist(), reverse=True)


def test_block_layout_mask_and_walk():
    parents = block_parents([-1, 0, -1, 1], 7)  # anchor, two branches, then padding continuing the last node
    assert parents == [-1, 0, 1, 0, 2, 4, 5]
    assert depths(parents) == [0, 1, 2, 1, 3, 4, 5]
    sees = ancestor_mask(parents)
    assert sees[4].nonzero().flatten().tolist() == [0, 1, 2, 4]
    assert sees[3].nonzero().flatten().tolist() == [0, 3]
    block = [7, 10, 20, 11, 30, 30, 30]
    # the target wants 11 after the anchor: the second branch; then a token no child of 3 holds
    assert accepted_path(parents, block, [11, 0, 0, 99, 0, 0, 0]) == [0, 3]
    assert accepted_path(parents, block, [10, 20, 30, 0, 30, 30, 5]) == [0, 1, 2, 4, 5, 6]
    assert accepted_path(parents, block, [5, 0, 0, 0, 0, 0, 0]) == [0]


def test_check_tree_settings():
    assert check_tree(None) is None and check_tree("off") is None
    assert check_tree("auto") == 24 and check_tree(8) == 8 and check_tree("12") == 12
    for bad in (0, -1, "x", 2.5, True):
        with pytest.raises(ValueError, match="tree must be"):
            check_tree(bad)


# ------------------------------------------------------------------------------------------------- mask and positions
def tree_logits(target: Target, prompts, parents, tokens, broken: bool = False, static: bool = False):
    """The logits of every block column of a tree verify after each prompt (one batch), with the engine's mask."""
    decoder = BatchDecoder(target, OracleTreeProposer({}, 1, random.Random(0)))
    for p in prompts:
        decoder.proposer.references[tuple(p)] = p
        decoder.add(p, 50, SamplingParams(), stop_token_ids=[])
    decoder.static = static
    rows = decoder.rows
    n = len(parents[0])
    block = torch.tensor([[r.tokens[-1], *t] for r, t in zip(rows, tokens, strict=True)])
    positions = torch.tensor(
        [[r.anchor_position + d for d in depths(p)] for r, p in zip(rows, parents, strict=True)]
    )
    mask = torch.stack([ancestor_mask(p) for p in parents])
    if broken:  # a causal block instead of the ancestors
        mask = torch.ones(len(rows), n, n, dtype=torch.bool).tril()
    return decoder.forward_block(block, positions, mask).logits, rows


@pytest.mark.parametrize("arch", TREE_ARCHS)
def test_tree_logits_equal_each_path_decoded_alone(arch):
    """Every node's logits in one tree verify (two rows of different lengths, so the cached part has holes) equal
    the logits of its path decoded alone; a causal mask in place of the ancestor mask changes them."""
    target = tree_target(arch)
    rng = random.Random(1)
    prompts = [[5, 9, 17, 33, 8, 12, 40], [3, 4]]
    parents = [block_parents(random_tree(rng, 9, 5), 10) for _ in prompts]
    tokens = [[rng.randrange(3, VOCAB) for _ in range(9)] for _ in prompts]
    got, rows = tree_logits(target, prompts, parents, tokens)
    broken, _ = tree_logits(target, prompts, parents, tokens, broken=True)
    differs = False
    for r, (row, par, toks) in enumerate(zip(rows, parents, tokens, strict=True)):
        block = [row.tokens[-1], *toks]
        for col in range(10):
            path = [col]
            while par[path[-1]] >= 0:
                path.append(par[path[-1]])
            ids = row.prompt[0].tolist() + [block[c] for c in reversed(path)]
            with torch.no_grad():
                alone = target.model(torch.tensor([ids])).logits[0, -1]
            torch.testing.assert_close(got[r, col], alone, atol=1e-4, rtol=1e-4)
            differs |= not torch.allclose(broken[r, col], alone, atol=1e-4, rtol=1e-4)
    assert differs, "a causal block mask gave the same logits: the test cannot see a broken mask"


def test_static_mask_takes_the_tree():
    valid = torch.tensor([[True, False, True]])
    tree = ancestor_mask([-1, 0, 0])[None]
    mask = static_mask(valid, 3, 8, torch.float32, tree)
    sees = mask[0, 0] == 0
    assert sees[2].nonzero().flatten().tolist() == [
        0,
        2,
        3,
        5,
    ]  # cached 0 and 2, the anchor (3) and itself (5)
    assert not sees[:, 6:].any()


# ------------------------------------------------------------------------------------------------- decoding
@pytest.mark.parametrize(
    ("arch", "static"),
    [*((a, False) for a in [*TREE_ARCHS, "qwen2", "mistral"]), ("llama", True), ("qwen3", True)],
)
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_oracle_trees_decode_as_plain(arch, static, temperature):
    """Random trees hiding the true continuation on random branches, 5 prompts through a batch of at most 3 rows
    (rows join and leave): every output equals plain decoding (greedy, or the same seed's sample), on the growing
    cache and on the static one (kv_cache.py; what --compile runs)."""
    oracle_trees_decode_as_plain(tree_target(arch, seed=2), arch, static, temperature)


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU (the device playbook's first call runs it)"
)
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_oracle_trees_decode_as_plain_on_a_gpu(static, temperature):
    """The same on CUDA, fp32: the tree's 4-D mask through SDPA's GPU kernels, on the growing and the static cache,
    against plain decoding on the same device."""
    target = Target(tiny_model("llama", seed=2).cuda())
    oracle_trees_decode_as_plain(target, "llama", static, temperature)


def oracle_trees_decode_as_plain(target: Target, arch: str, static: bool, temperature: float) -> None:
    prompts = random_prompts(5, seed=len(arch))
    limits = [30, 9, 40, 2, 25]
    seeds = [11, 12, 13, 14, 15]
    sampling = dict(temperature=temperature, top_p=0.9) if temperature else {}
    refs = references(target, prompts, limits, seeds=seeds, **sampling)
    proposer = OracleTreeProposer(refs, 10, random.Random(4))
    replan(target, static_cache=static)
    decoder = BatchDecoder(target, proposer, max_batch_size=3)
    assert decoder.static == static
    params = SamplingParams(temperature, sampling.get("top_p", 1.0))
    results = run(decoder, prompts, limits, params, [], seeds)
    for r, p, m in zip(results, prompts, limits, strict=True):
        assert r.new_tokens == refs[tuple(p)][len(p) : len(p) + m]
    assert proposer.tree_steps > 10
    assert max(a for r in results for a in r.accepted_drafts) >= 3  # whole paths accepted, not only one token


def drafter(config, block_size=5, seed=1, **kw):
    return DFlashDraftModel.for_target(
        config, num_layers=1, block_size=block_size, mask_token_id=config.vocab_size - 1, seed=seed, **kw
    ).eval()


@pytest.mark.parametrize("arch", TREE_ARCHS)
@pytest.mark.parametrize("mode", ["fixed", "auto"])
def test_dflash_trees_decode_as_plain(arch, mode):
    """The DFlash proposer's trees (forced: a fixed block with 8 nodes; the policy with a free verify, so it takes
    big trees): outputs equal plain decoding, single and batched, and trees really ran."""
    target = tree_target(arch, seed=3)
    draft = drafter(target.config)
    prompts = random_prompts(3, seed=7)
    costs = CostModel(lengths=[1, 16], verify_base=[1.0, 1.0], verify_slope=[0.0, 0.0], draft_base=1e-3)
    block = 5 if mode == "fixed" else "auto"
    one = generate(target, draft, prompts[0], 30, stop_token_ids=[], block_size=block, costs=costs, tree=8)
    assert one.new_tokens == generate_ar(target, prompts[0], 30, stop_token_ids=[]).new_tokens
    assert one.proposer_stats["tree_steps"] > 0
    got = generate_batch(target, draft, prompts, 30, stop_token_ids=[], block_size=block, costs=costs, tree=8)
    for g, p in zip(got, prompts, strict=True):
        assert g.new_tokens == generate_ar(target, p, 30, stop_token_ids=[]).new_tokens
    if arch == "gemma3":  # past its window the rows verify chains, and stay exact
        long = generate(
            target, draft, prompts[0], 80, stop_token_ids=[], block_size=block, costs=costs, tree=8
        )
        assert long.new_tokens == generate_ar(target, prompts[0], 80, stop_token_ids=[]).new_tokens
        assert tree_window(target) == 64


def test_a_fixed_block_verifies_n_nodes_also_where_the_best_n_form_a_chain(monkeypatch):
    """`--block-size B --tree N`: every step verifies the tree of its N best nodes, also where those are the block's
    first N drafts (a chain: here the drafter is sure of its own drafts), never the whole block (which measured a
    2-node "tree" at a 15-node chain's τ)."""
    import flashdraft.engine.batched_dflash as batched

    def sure_of_its_drafts(candidates, p, keys, budget, below=None):
        sure = torch.full_like(p, 0.01)
        sure[:, 0] = 0.9
        return grow_tree(candidates, sure, keys, budget, below=None if below is None else (sure, below[1]))

    monkeypatch.setattr(batched, "grow_tree", sure_of_its_drafts)
    target = tree_target("llama", seed=3)
    proposer = BatchedDFlashProposer(drafter(target.config, block_size=8), target, block_size=8, tree=2)
    sizes, propose = [], proposer.propose

    def recording(rows, max_drafts):
        out = propose(rows, max_drafts)
        sizes.extend(len(t) for t in out)
        return out

    proposer.propose = recording
    prompt = random_prompts(1, seed=7)[0]
    got = generate(target, proposer, prompt, 30, stop_token_ids=[])
    assert got.new_tokens == generate_ar(target, prompt, 30, stop_token_ids=[]).new_tokens
    # the trees were chains (a last step with one slot left branches at it)
    assert got.proposer_stats["tree_steps"] <= 1 and len(sizes) == got.num_steps > 5
    assert max(sizes) == 2


def test_dflash_trees_through_the_compiled_graphs_decode_as_plain():
    """Compiled (static cache, frozen graphs): the drafter's head reduces each slot's tree candidates inside its
    graph and the verify reduces the target's greedy tokens inside its own; the DFlash proposer's trees decode as
    plain decoding, and trees really ran (rows joining and leaving: the eager tests and the compiled oracle's)."""
    from flashdraft.engine.compiled import compile_verify

    target = Target(tiny_model("llama", seed=3, max_position_embeddings=512))
    assert compile_verify(target) is None
    draft = drafter(target.config)
    prompt = random_prompts(1, seed=7)[0]
    proposer = BatchedDFlashProposer(draft, target, block_size=5, tree=8)
    assert proposer.head_drafts is not None  # the compiled head, whose graph gives the candidates
    got = generate(target, proposer, prompt, 30, stop_token_ids=[])
    assert got.new_tokens == generate_ar(target, prompt, 30, stop_token_ids=[]).new_tokens
    assert got.proposer_stats["tree_steps"] > 0


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_lookup_branches_in_trees_decode_as_plain(monkeypatch, temperature):
    """Prompts that repeat themselves, so prompt lookup matches: its continuation joins the drafter's trees as a
    branch; single and batched (rows joining and leaving), greedy and seeded, the output is plain decoding's."""
    import flashdraft.engine.batched_dflash as batched

    grafted = []

    def counting(tree, tokens, *args):
        grafted.append(len(tokens))
        return add_branch(tree, tokens, *args)

    monkeypatch.setattr(batched, "add_branch", counting)
    # Prices from the cost model alone: a batch's online correction follows this machine's timings, and with it
    # which steps graft a lookup branch (a busy CI run once grafted none, every output still plain decoding's).
    observed = batched.ObservedCosts
    monkeypatch.setattr(batched, "ObservedCosts", lambda costs, online=True: observed(costs, False))
    target = tree_target("qwen3", seed=4)
    draft = drafter(target.config)
    rng = random.Random(3)
    prompts = []
    for _ in range(4):
        piece = [rng.randrange(3, VOCAB) for _ in range(6)]
        prompts.append(piece * 3 + piece[:3])  # its last 3-gram seen before: lookup proposes what followed
    costs = CostModel(lengths=[1, 16], verify_base=[1.0, 1.0], verify_slope=[0.0, 0.0], draft_base=1e-3)
    kw = dict(stop_token_ids=[], temperature=temperature, block_size="auto", costs=costs, tree=8)
    one = generate(target, draft, prompts[0], 24, seed=1, **kw)
    assert (
        one.new_tokens
        == generate_ar(target, prompts[0], 24, stop_token_ids=[], temperature=temperature, seed=1).new_tokens
    )
    # three rows at a time, rows joining and leaving (under the policy a batch of several rows verifies chains,
    # TREE_POLICY_ROWS; a row drafting alone may take a tree), then one row at a time
    for rows in (3, 1):
        got = generate_batch(target, draft, prompts, 24, seed=[1, 2, 3, 4], max_batch_size=rows, **kw)
        for g, p, seed in zip(got, prompts, [1, 2, 3, 4], strict=True):
            plain = generate_ar(target, p, 24, stop_token_ids=[], temperature=temperature, seed=seed)
            assert g.new_tokens == plain.new_tokens
    assert any(n > 0 for n in grafted)  # lookup branches were grafted


def test_dflash2_trees_decode_as_plain():
    target = tree_target("qwen3", seed=5)
    draft = drafter(target.config, arch="dflash2")
    draft.candidate_selector.top_k = 4
    prompt = random_prompts(1, seed=9)[0]
    got = generate(target, draft, prompt, 30, stop_token_ids=[], block_size=5, tree=8)
    assert got.new_tokens == generate_ar(target, prompt, 30, stop_token_ids=[]).new_tokens
    assert got.proposer_stats["tree_steps"] > 0


def test_hybrid_targets_verify_chains_and_stay_exact():
    target = Target(hybrid_model("qwen3_5"))
    draft = drafter(target.config)
    proposer = BatchedDFlashProposer(draft, target, block_size=5, tree=8)
    assert proposer.tree is None and "recurrent" in proposer.tree_note
    prompt = random_prompts(1, seed=3)[0]
    got = generate(target, draft, prompt, 20, stop_token_ids=[], block_size=5, tree=8)
    assert got.new_tokens == generate_ar(target, prompt, 20, stop_token_ids=[]).new_tokens
    assert got.proposer_stats["tree_steps"] == 0


def _tree_exact_cpu() -> bool:
    """A row-invariant kernel for bf16 rows (AMX, or the pair kernel with avx512_bf16: cpu_gemm.bf16_rows_kernel)
    and attention_cpp's kernel built: where it does not (torch 2.11 on an H200 machine's Xeon, 2026-11-29), trees
    are refused."""
    from flashdraft.kernels import attention_cpp
    from flashdraft.kernels.gemm_templates import bf16_rows_kernel

    return bf16_rows_kernel() is not None and attention_cpp.prepare(torch.bfloat16)


def test_the_compiled_cpu_path_in_reduced_precision_verifies_trees_only_where_they_are_exact():
    """Compiled on a CPU in bf16, trees where attention_cpp's kernel and AMX or the pair GEMM kernel keep a
    node's bits (the next test); chains elsewhere, and in fp16 (the refusal is what the proposer and `--verbose`
    report). Eager bf16 and compiled fp32 keep trees."""
    from flashdraft.engine.tree import tree_refusal
    from flashdraft.kernels.plan import CpuOffer, make_plan

    def compiled(target):  # the plan `--compile` makes, on this torch or another
        return target.use_plan(
            make_plan(target.device, target.dtype, compile=True, offer=CpuOffer(untested_torch=None))
        )

    bf16 = Target(tiny_model("llama").to(torch.bfloat16))
    assert tree_refusal(bf16) is None
    assert compiled(bf16).compiled_cpu_reduced
    proposer = BatchedDFlashProposer(drafter(bf16.config).to(torch.bfloat16), bf16, block_size=5, tree=8)
    if _tree_exact_cpu():
        assert tree_refusal(bf16) is None and proposer.tree is not None
        # a budget past the short-query kernel's block is cut to it (a longer verify would go to SDPA)
        wide = BatchedDFlashProposer(drafter(bf16.config).to(torch.bfloat16), bf16, block_size=5, tree=200)
        assert wide.tree == attention.SHORT_QUERY - 1
    else:
        assert "compiled CPU path" in tree_refusal(bf16)
        assert proposer.tree is None and "compiled" in proposer.tree_note
    fp16 = Target(tiny_model("llama").to(torch.float16))
    compiled(fp16)
    assert "compiled CPU path" in tree_refusal(fp16)
    fp32 = Target(tiny_model("llama"))
    assert compiled(fp32).compiled
    assert tree_refusal(fp32) is None


@needs_kernel(_tree_exact_cpu, "avx512_bf16|amx_bf16", "exact bf16 trees (cpu_gemm's bf16 row kernels)")
def test_oracle_trees_decode_as_plain_compiled_in_bf16():
    """The compiled bf16 CPU path (frozen graphs, attention_cpp's kernel over a mask as narrow as the columns in
    use): random trees, rows joining and leaving, greedy and seeded sampling, every output equal to the same
    compiled target's plain decoding, bit for bit (a node's logits are its path's)."""
    from flashdraft.engine.compiled import compile_verify

    target = Target(tiny_model("llama", seed=2, max_position_embeddings=512).to(torch.bfloat16))
    assert compile_verify(target) is None
    for temperature in (0.0, 0.8):
        oracle_trees_decode_as_plain(target, "llama", True, temperature)


def test_a_tree_past_a_sliding_window_is_refused_not_run():
    """The engine never verifies a tree under the full mask where the window would cut it."""
    target = Target(tiny_model("gemma3"))  # an 8-token window
    prompt = random_prompts(1, seed=1)[0] + [5] * 10
    refs = {tuple(prompt): prompt + [0] * 60}
    proposer = OracleTreeProposer(refs, 6, random.Random(0))
    proposer.rng.random = lambda: 0.0  # noqa: ARG005 - never a chain by chance
    with pytest.raises(RuntimeError, match="window"):
        generate(target, proposer, prompt, 10, stop_token_ids=[])


# ------------------------------------------------------------------------------------------------- the law
N_TREE = 4_000


def test_sampled_outputs_with_trees_follow_the_target_s_law(small_target):  # noqa: F811
    """Seed-exact sampling through trees (near-uniform drafts, 4 candidates per slot: most steps accept along some
    branch), rows of other lengths beside them: the joint law of the first three tokens is the target's."""
    target = Target(small_target)
    params = SamplingParams(temperature=0.9, top_p=0.95)
    torch.manual_seed(0)
    draft = DFlashDraftModel.for_target(
        small_target.config, num_layers=1, block_size=4, mask_token_id=V - 1
    ).eval()
    with torch.no_grad():
        draft.norm.weight.fill_(0.05)
    samples: Counter = Counter()
    tree_steps = 0
    chunk = 200
    for start in range(0, N_TREE, chunk):
        prompts = [PROMPT if j % 4 else [2, 3, 1] for j in range(chunk)]
        limits = [3 if j % 4 else 2 + j % 5 for j in range(chunk)]
        seeds = [start + j for j in range(chunk)]
        results = generate_batch(
            target, draft, prompts, limits, params.temperature, params.top_p, stop_token_ids=[], block_size=4,
            seed=seeds, max_batch_size=16, tree=8,
        )  # fmt: skip
        for j, r in enumerate(results):
            if j % 4:
                samples[tuple(r.new_tokens)] += 1
                tree_steps += r.proposer_stats["tree_steps"]
    assert tree_steps > N_TREE // 2
    assert_same_law(samples, exact_joint(small_target, params), sum(samples.values()))


# ------------------------------------------------------------------------------------------------- command line
def test_cli_generate_with_trees_equals_plain_and_a_bad_tree_is_one_line(tmp_path):
    import json

    from typer.testing import CliRunner

    from conftest import byte_tokenizer, on_disk
    from flashdraft.cli import app
    from test_grammar import CORPUS, PROMPT
    from test_grammar import VOCAB as BYTE_VOCAB

    tok = byte_tokenizer(CORPUS * 4, BYTE_VOCAB)
    saved = on_disk(Target(tiny_model("llama", seed=6, vocab=BYTE_VOCAB), tok), tmp_path)
    base = ["generate", "--target", saved["target"], "--draft", saved["draft"], "--block-size", "4",
            "--max-new-tokens", "24"]  # fmt: skip
    result = CliRunner().invoke(app, [*base, "--tree", "6", "--compare-ar", "--json", PROMPT])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout[result.stdout.index("{") :])
    assert report["identical_to_ar"] and report["tree"] == 6
    assert report["dflash"]["proposer_stats"]["tree_steps"] > 0
    for bad in ("0", "wide"):
        result = CliRunner().invoke(app, [*base, "--tree", bad, PROMPT])
        assert result.exit_code == 2
        lines = result.output.strip().splitlines()
        assert lines == [f"error: --tree must be 'auto', 'off' or a number of nodes >= 1, got '{bad}'"], (
            result.output
        )


def test_served_answers_with_trees_equal_the_plain_server():
    """`serve --tree`: concurrent requests through the official client, streamed and not, answer what the plain
    server answers (T=0), and their speculative statistics count the tree steps."""
    from concurrent.futures import ThreadPoolExecutor

    import openai

    from conftest import byte_tokenizer, running_server
    from flashdraft.serve import Engine, build_app
    from test_grammar import CORPUS
    from test_grammar import VOCAB as BYTE_VOCAB

    target = Target(tiny_model("qwen3", seed=8, vocab=BYTE_VOCAB), byte_tokenizer(CORPUS * 4, BYTE_VOCAB))
    engines = {"tree": Engine(target, drafter(target.config), block_size=4, tree=6), "plain": Engine(target)}
    questions = ["name the color as JSON", "[1, 2, 3]", "yes no maybe", '{"a": {"b": [null, false]}}']
    try:
        with (
            running_server(build_app(engines["tree"], "t")) as a,
            running_server(build_app(engines["plain"], "t")) as b,
        ):
            clients = {name: openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
                       for name, url in (("tree", a), ("plain", b))}  # fmt: skip

            def ask(name, question, stream=False):
                args = dict(
                    model="t", messages=[{"role": "user", "content": question}], max_tokens=24, temperature=0
                )
                if not stream:
                    return clients[name].chat.completions.create(**args)
                return "".join(c.choices[0].delta.content or "" for c in clients[name].chat.completions.create(
                    stream=True, **args) if c.choices)  # fmt: skip

            with ThreadPoolExecutor(4) as pool:
                served = list(pool.map(lambda q: ask("tree", q), questions))
            for question, answer in zip(questions, served, strict=True):
                assert answer.choices[0].message.content == ask("plain", question).choices[0].message.content
            assert ask("tree", questions[0], stream=True) == served[0].choices[0].message.content
            assert sum(a.model_extra["spec_decode"]["tree_steps"] for a in served) > 0
    finally:
        for engine in engines.values():
            engine.close()

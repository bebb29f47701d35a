"""Draft trees: several candidates per block slot, verified in the one target forward (EAGLE-2 / SpecInfer style).

A DFlash drafter gives a distribution for every slot of its block in one pass; a chain keeps each slot's top token.
A tree keeps a few candidates per slot and grows best-first under a node budget:

    candidates   slot d's tokens: the drafter's own draft first (its argmax; DFlash2: the selector's token), then the
                 slot's next most likely tokens, each with its acceptance estimate p (the calibrated confidence)
    best-first   a node's score is the product of p along its path from the anchor; the n best nodes form the tree
                 (scores fall along a path, so the n best are closed under ancestors), and since every node counts
                 once, E(n) = 1 + the sum of their scores is the expected number of tokens a verify of them emits
                 (the chain is the tree with one candidate per slot)
    branches     prompt lookup's continuation joins the tree as one more path from the anchor (`add_branch`),
                 sharing the nodes it agrees with, before the n best are taken

The engine lays the tree out after the anchor in its block, parents before children: node j (block column 1 + j)
has parent `parents[j]` (-1: the anchor), sits at position anchor + depth, and attends to the cached context and to
its ancestors only (`ancestor_mask`). The target's token at each node (its greedy token, or the token plain sampling
draws there with the row's seed: the uniform of the node's position) decides the walk (`accepted_path`): from the
anchor, into the child holding the target's token, until no child does; the target's token there ends the step.
So the output is plain decoding's, token for token, whichever tree was verified.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any

import torch

from ..sampling import SamplingParams, check_finite, inverse_cdf_sample, target_probs
from ..targets.capabilities import is_sliding, mask_refusal


@dataclass
class DraftTree:
    """Draft tokens as a tree under the anchor, parents before children."""

    tokens: torch.Tensor  # [k] long, on the host
    parents: list[int]  # [k]: each node's parent node (an index < its own), -1 for the anchor
    keys: torch.Tensor  # [k] long: each node's calibration key (its confidence bin)
    scores: (
        torch.Tensor
    )  # [k] float: each node's estimated probability of being accepted (its path's product)

    def __len__(self) -> int:
        return len(self.parents)

    @property
    def is_chain(self) -> bool:
        return all(p == j - 1 for j, p in enumerate(self.parents))

    def first(self, n: int) -> DraftTree:
        """The tree of its n best nodes (closed under ancestors: nodes come best-first)."""
        return DraftTree(self.tokens[:n], self.parents[:n], self.keys[:n], self.scores[:n])

    def expected_tokens(self) -> torch.Tensor:
        """[k + 1]: expected tokens a verify of its first 0, 1, .., k nodes emits."""
        return torch.cat([torch.ones(1), 1.0 + torch.cumsum(self.scores.float(), 0)])


# `tree="auto"`: the node budget the policy grows its trees to (it verifies the best n <= this many nodes).
TREE_AUTO_NODES = 24


def check_tree(tree: int | str | None) -> int | None:
    """The node budget of a `tree` setting: an integer >= 1, "auto" (TREE_AUTO_NODES), None or "off" (chains)."""
    if tree is None or tree == "off":
        return None
    if tree == "auto":
        return TREE_AUTO_NODES
    try:
        nodes = int(tree)
    except (TypeError, ValueError):
        nodes = 0
    if isinstance(tree, bool) or nodes < 1 or str(nodes) != str(tree).strip():
        raise ValueError(f"tree must be 'auto', 'off' or a number of nodes >= 1, got {tree!r}")
    return nodes


def chain_parents(k: int) -> list[int]:
    return list(range(-1, k - 1))


def grow_tree(
    candidates: torch.Tensor,
    p: torch.Tensor,
    keys: torch.Tensor,
    budget: int,
    below: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> DraftTree:
    """The best-first tree of at most `budget` nodes. `candidates` [D, W]: slot d's tokens (distinct within a slot,
    most likely first), `p` [D, W] their acceptance estimates, `keys` [D, W] their calibration keys; nodes go at
    most D deep. `below` (p, keys), each [D, W]: the estimates and keys of the candidates placed below a lower
    candidate of an earlier slot, off the drafter's own line (the drafter predicted their slot after its own draft
    there); without it they take `p` and `keys` too."""
    depth, width = candidates.shape
    estimates = [p.tolist(), (below[0] if below is not None else p).tolist()]
    node_keys = [keys, below[1] if below is not None else keys]
    # (parent, slot, candidate, score, off the drafter's line)
    nodes: list[tuple[int, int, int, float, int]] = []
    # Heap of (-score, tie-break, parent node, slot, candidate, off): a node's first child and its next sibling join
    # the heap when it is taken, so the heap holds at most two entries per node taken.
    heap = [(-estimates[0][0][0], 0, -1, 0, 0, 0)] if depth and width and budget > 0 else []
    counter = 1
    while heap and len(nodes) < budget:
        neg, _, parent, slot, cand, off = heapq.heappop(heap)
        score = -neg
        if score <= 0.0:
            break
        nodes.append((parent, slot, cand, score, off))
        me = len(nodes) - 1
        base = 1.0 if parent < 0 else nodes[parent][3]
        if cand + 1 < width:  # its next sibling
            heapq.heappush(
                heap, (-base * estimates[off][slot][cand + 1], counter, parent, slot, cand + 1, off)
            )
            counter += 1
        if slot + 1 < depth:  # its first child, off the drafter's line below a lower candidate
            child_off = int(off or cand > 0)
            heapq.heappush(
                heap, (-score * estimates[child_off][slot + 1][0], counter, me, slot + 1, 0, child_off)
            )
            counter += 1
    if not nodes:
        empty = torch.empty(0, dtype=torch.long)
        return DraftTree(empty, [], empty, torch.empty(0))
    slots = torch.tensor([n[1] for n in nodes])
    cands = torch.tensor([n[2] for n in nodes])
    offs = torch.tensor([n[4] for n in nodes], dtype=torch.bool)
    return DraftTree(
        tokens=candidates[slots, cands],
        parents=[n[0] for n in nodes],
        keys=torch.where(offs, node_keys[1][slots, cands], node_keys[0][slots, cands]),
        scores=torch.tensor([n[3] for n in nodes]),
    )


def add_branch(
    tree: DraftTree, tokens: list[int], p: torch.Tensor, keys: torch.Tensor, budget: int
) -> DraftTree:
    """The tree with a chain from another source (prompt lookup's continuation) grafted on below the anchor, cut
    to its best `budget` nodes. Where the chain follows the tree's nodes it shares them, and a shared node keeps the
    higher of its two scores; the rest of the chain hangs below as new nodes scored by the chain's running product
    of `p`, with calibration keys `keys`. Scores never rise along a path and parents come before children, so the
    nodes sorted best-first (ties in order) stay closed under ancestors, as `grow_tree`'s are."""
    parents, toks = list(tree.parents), tree.tokens.tolist()
    node_keys, scores = tree.keys.tolist(), tree.scores.tolist()
    child_of = {(parent, token): j for j, (parent, token) in enumerate(zip(parents, toks, strict=True))}
    node, score = -1, 1.0
    for token, q, key in zip(tokens, p.tolist(), keys.tolist(), strict=True):
        score *= q
        if score <= 0.0:
            break
        child = child_of.get((node, token))
        if child is None:
            child = child_of[(node, token)] = len(parents)
            parents.append(node)
            toks.append(token)
            node_keys.append(key)
            scores.append(score)
        else:
            scores[child] = max(scores[child], score)
        node = child
    order = sorted(range(len(parents)), key=lambda j: -scores[j])[:budget]
    index = {old: new for new, old in enumerate(order)}
    return DraftTree(
        tokens=torch.tensor([toks[j] for j in order], dtype=torch.long),
        parents=[-1 if parents[j] < 0 else index[parents[j]] for j in order],
        keys=torch.tensor([node_keys[j] for j in order], dtype=torch.long),
        scores=torch.tensor([scores[j] for j in order]),
    )


def top_candidates(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's k most likely tokens [..., k] and their probabilities under the softmax of `logits` [..., V] (fp32):
    a draft tree's candidates for a slot, reduced eagerly or inside the compiled head (compiled_draft.draft_head)."""
    top_logits, top_tokens = logits.topk(k, dim=-1)
    return top_tokens, (top_logits.float() - torch.logsumexp(logits.float(), -1, keepdim=True)).exp()


def slot_candidates(
    top_tokens: torch.Tensor, top_p: torch.Tensor, drafts: torch.Tensor, confidence: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each slot's candidates for a tree, on the host: tokens [b, D, width] and their draft probabilities. The
    drafter's own draft comes first, with its confidence (v1: the slot's argmax; DFlash2: the selector's token), then
    the slot's most likely other tokens. `top_tokens`, `top_p` [b, D, width]: the slots' `top_candidates`; `drafts`
    and `confidence` [b, D]."""
    width = top_tokens.shape[-1]
    top_p = top_p.masked_fill(top_tokens == drafts[..., None], -1.0)  # the draft itself is already first
    order = top_p.argsort(-1, descending=True)[..., : width - 1]
    tokens = torch.cat([drafts[..., None], top_tokens.gather(-1, order)], -1)
    p = torch.cat([confidence[..., None].float(), top_p.gather(-1, order).clamp(min=0.0)], -1)
    return tokens.cpu(), p.cpu()


# Families whose attention takes the engine's [b, 1, n, C + n] mask as given, checked token for token against plain
# decoding with trees forced on (tests/test_tree.py).
TREE_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma3_text")


def tree_refusal(target: Any) -> str | None:
    """Why draft trees cannot be verified exactly on this target (None: they can); it then verifies chains."""
    if target.recurrent is not None:
        return "recurrent layers (their state cannot branch within one forward)"
    family = getattr(target.config, "model_type", None)
    if family not in TREE_FAMILIES:
        return f"a model family ({family}) trees are not verified on (they are: {', '.join(TREE_FAMILIES)})"
    # logit soft-capping sends attention.py's short queries to SDPA, around the kernel that keeps a node's bits
    softcap = getattr(target.config, "attn_logit_softcapping", None)
    if target.plan.compiled_cpu_reduced and (softcap or not target.plan.trees_exact):
        # Its chains keep a one-token step's bits (tests/test_static_cache.py); a tree verify is shown to only with
        # attention_cpp's kernel and the pair GEMM kernel (tests/test_tree.py); before them, 1 of 24 bench outputs
        # with trees parted from plain decoding on a near-tie (benchmarks/README.md).
        return (
            "the compiled CPU path in reduced precision (a tree's verify is not bit-exact there; chains are)"
        )
    return mask_refusal(target)


def tree_budget(target: Any, nodes: int) -> int:
    """The node budget `target` verifies exactly: on the compiled CPU path in reduced precision at most
    attention.SHORT_QUERY - 1 nodes (with the anchor, a block the short-query kernel takes; a longer verify goes to
    SDPA, whose bits are not a one-token step's)."""
    from ..kernels.attention import SHORT_QUERY

    return min(nodes, SHORT_QUERY - 1) if target.plan.compiled_cpu_reduced else nodes


def tree_window(target: Any) -> int | None:
    """A sliding-window target's window: trees are verified under the full mask, so only while a row's context and
    tree fit inside it (past it, chains)."""
    return int(target.config.sliding_window) if is_sliding(target) else None


def block_parents(parents: list[int], n: int) -> list[int]:
    """Parents over a verify block of n columns (column 0 the anchor, node j at column 1 + j): the padding past the
    nodes continues from the last column, as a chain's padding does (verified like drafts, it only adds tokens)."""
    out = [-1] + [p + 1 for p in parents]
    return out + list(range(len(out) - 1, n - 1))


def depths(parents: list[int]) -> list[int]:
    """Each block column's depth below the anchor (0 for the anchor)."""
    out: list[int] = []
    for p in parents:
        out.append(0 if p < 0 else out[p] + 1)
    return out


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """[n, n] bool: column i sees column j iff j is i or one of its ancestors."""
    n = len(parents)
    sees = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        sees[i, i] = True
        if p >= 0:
            sees[i] |= sees[p]
    return sees


def block_layout(
    trees: dict[int, list[int]], lengths: list[int], n: int
) -> tuple[list[list[int]], torch.Tensor, torch.Tensor]:
    """A verify block of n columns per row, some rows trees (`trees[i]`: row i's parents) and the others chains of
    `lengths[i]` proposals: every row's parents over the block, its depths [b, n] (positions after the anchor's) and
    the [b, n, n] mask of the block columns each column sees."""
    parents = [block_parents(trees[i] if i in trees else chain_parents(k), n) for i, k in enumerate(lengths)]
    depth = torch.tensor([depths(p) for p in parents])
    return parents, depth, torch.stack([ancestor_mask(p) for p in parents])


def accepted_path(parents: list[int], block: list[int], target_tokens: list[int]) -> list[int]:
    """The block columns the target accepts, from the anchor (column 0): at each, into the child holding the target's
    token there, until no child does. `block` the block's tokens, `target_tokens` the target's token at each column."""
    children: dict[int, list[int]] = {}
    for j, p in enumerate(parents):
        if p >= 0:
            children.setdefault(p, []).append(j)
    path = [0]
    while True:
        want = target_tokens[path[-1]]
        nxt = next((c for c in children.get(path[-1], ()) if block[c] == want), None)
        if nxt is None:
            return path
        path.append(nxt)


def verify_tree(
    logits: torch.Tensor,
    block: list[int],
    parents: list[int],
    params: SamplingParams,
    uniforms: torch.Tensor | None,
    reduced: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[list[int], list[int]]:
    """Accept the longest path of a tree block whose tokens are the target's own, and add the target's next token.

    logits  [n, V] the target's logits at the block's n columns (column 0 the anchor)
    block   the block's tokens; `parents` each column's parent (`block_parents`)
    uniforms  [depth + 1] the uniforms of the output positions after the anchor (sampling only): a column at depth d
              draws the token of position anchor + 1 + d with the d-th, as plain sampling does there
    reduced  greedy: (argmax, non_finite_rows) of the logits [n] where the verify computed them already
    Returns (the accepted columns from the anchor, emitted tokens = the path's drafts + the target's token)."""
    if params.greedy and reduced is not None:
        target, bad = reduced
        if bool(bad.any()):
            check_finite(logits, None)  # raises, naming the row
    else:
        check_finite(logits, None)
        if params.greedy:
            target = logits.argmax(-1)
        else:
            at = torch.tensor(depths(parents))
            target = inverse_cdf_sample(target_probs(logits, params), uniforms[at])
    target = target.tolist()
    path = accepted_path(parents, block, target)
    return path, [block[c] for c in path[1:]] + [target[path[-1]]]


__all__ = [
    "TREE_AUTO_NODES",
    "check_tree",
    "DraftTree",
    "accepted_path",
    "add_branch",
    "ancestor_mask",
    "block_layout",
    "block_parents",
    "chain_parents",
    "depths",
    "grow_tree",
    "slot_candidates",
    "top_candidates",
    "tree_refusal",
    "tree_window",
    "verify_tree",
]

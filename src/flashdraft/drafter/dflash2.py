"""DFlash2's two additions to the DFlash drafter (z-lab's `DFlash2DraftModel`, model.py builds them in):

    every draft layer:  x + after_a(attn(before_a(ln1(x))))  then  x + after_m(mlp(before_m(ln2(x))))
                        (GroupedDynamicCausalConv: before/after share one dynamic kernel prediction per sublayer)
    after the norm:     logits -> top-k candidates per slot -> CandidateSelector walks them from the anchor

Weights keep z-lab's names: `layers.N.{attention,mlp}_conv.{base_kernel, kernel_projection.weight}`,
`candidate_selector.{predecessor_codebook, successor_codebook, hidden_projection.weight}`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from .config import DFlashConfig


class GroupedDynamicCausalConv(nn.Module):
    """DFlash2's local mixing around a sublayer: a causal convolution over the block's slots whose kernel is a
    learned per-channel base plus a per-slot, per-group dynamic part predicted from the sublayer's input.

        dyn = kernel_projection(x) -> [.., 2, K, G]        (G = H / group_size; one set before, one after)
        before(x)[t] = sum_o (base[0, o] + dyn[t, 0, o, g]) * x[t - o]      (x[t - o] = 0 before the block)
        after(y)[t]  = sum_o (base[1, o] + dyn[t, 1, o, g]) * y[t - o]

    Slot t mixes only slots <= t of its own block: each block's anchor starts from zero, in decoding (one block)
    as in training (many blocks side by side, `block_len` slots each)."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)

    def reset_parameters(self, std: float = 0.02) -> None:
        """The identity at init (base: 1 at offset 0, 0 elsewhere; no dynamic part), as the public DFlash2 trainers
        start: a fresh DFlash2 layer computes what a v1 layer does, so v1 weights are a sound starting point."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, x: torch.Tensor, block_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(the convolution before the sublayer, the dynamic kernel kept for `finish`). x: [b, q, H]."""
        dyn = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, self.groups)
        return self._convolve(x, dyn[..., 0, :, :], self.base_kernel[0], block_len), dyn[..., 1, :, :]

    def finish(self, y: torch.Tensor, dyn: torch.Tensor, block_len: int) -> torch.Tensor:
        return self._convolve(y, dyn, self.base_kernel[1], block_len)

    def _convolve(
        self, x: torch.Tensor, dyn: torch.Tensor, base: torch.Tensor, block_len: int
    ) -> torch.Tensor:
        b, q, h = x.shape
        nb = q // block_len
        xs = x.reshape(b * nb, block_len, self.groups, self.group_size)  # one row per block
        dyn = dyn.reshape(b * nb, block_len, self.kernel_size, self.groups, 1)
        out = torch.zeros_like(xs)
        for o in range(self.kernel_size):
            shifted = (
                xs if o == 0 else F.pad(xs[:, :-o], (0, 0, 0, 0, o, 0))
            )  # x[t - o], zero before the anchor
            out = out + base[o].view(1, 1, self.groups, self.group_size).to(x.dtype) * shifted
            out = torch.addcmul(out, dyn[:, :, o], shifted)
        return out.view(b, q, h)


class CandidateSelector(nn.Module):
    """DFlash2's candidate selector: instead of each slot's argmax, a path through the `top_k` best tokens of every
    slot, walked from the anchor, each candidate scored by its draft logit plus a rank-r predecessor -> successor
    term conditioned on the slot's hidden state:

        score(slot t, candidate c | predecessor p) = logit_t[c] + <P[p] * W h_t, S[c]>

    P, S: [V, r] codebooks (stored as `predecessor_codebook` / `successor_codebook`, no `.weight`, as z-lab's
    checkpoints), W: `hidden_projection` [r, H]. Greedy: the best candidate given the chosen predecessor."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.top_k = config.selector_top_k
        rank = config.selector_rank
        self.predecessor_codebook = nn.Parameter(torch.empty(config.vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(config.vocab_size, rank))
        self.hidden_projection = nn.Linear(config.hidden_size, rank, bias=False)

    def reset_parameters(self, std: float = 0.02) -> None:
        """Predecessor codes random, successor codes zero (as SpecForge and NeMo start): the pairwise term is zero,
        so a fresh selector picks each slot's argmax, as a v1 drafter does, and learns from there."""
        nn.init.normal_(self.predecessor_codebook, std=std)
        nn.init.zeros_(self.successor_codebook)
        nn.init.normal_(self.hidden_projection.weight, std=std)

    def scores(
        self,
        projected: torch.Tensor,
        unary: torch.Tensor,
        candidates: torch.Tensor,
        predecessors: torch.Tensor,
    ) -> torch.Tensor:
        """[.., k] scores of `candidates` [.., k] (draft logits `unary` [.., k]) after `predecessors` [..], for
        slots whose hidden states are already projected ([.., r])."""
        pred = F.embedding(predecessors, self.predecessor_codebook) * projected  # [.., r]
        succ = F.embedding(candidates, self.successor_codebook)  # [.., k, r]
        return unary + (succ @ pred.to(succ.dtype)[..., None])[..., 0].float()

    @torch.no_grad()
    def select(
        self, hidden: torch.Tensor, logits: torch.Tensor, anchors: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy walk: (tokens [b, n], the selector's probability of each choice among its candidates [b, n]) for
        draft hidden states [b, n, H] and their float logits [b, n, V], starting from `anchors` [b]."""
        unary, candidates = torch.topk(logits, self.top_k, dim=-1)  # [b, n, k]
        projected = self.hidden_projection(hidden)  # [b, n, r]
        predecessor, path, confidence = anchors, [], []
        for t in range(hidden.shape[1]):
            scores = self.scores(projected[:, t], unary[:, t], candidates[:, t], predecessor)  # [b, k]
            prob, index = scores.softmax(-1).max(-1)
            predecessor = candidates[:, t].gather(-1, index[:, None])[:, 0]
            path.append(predecessor)
            confidence.append(prob)
        return torch.stack(path, 1), torch.stack(confidence, 1)

    @torch.no_grad()
    def sample(
        self,
        hidden: torch.Tensor,
        logits: torch.Tensor,
        anchor: torch.Tensor,
        temperature: float,
        uniforms: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sampled walk for one row: (tokens [n], their distributions over the vocabulary [n, V]), each step drawn
        by inverse CDF (`uniforms` [n]) from softmax(scores / temperature) over the slot's candidates."""
        unary, candidates = torch.topk(logits[0].float(), self.top_k, dim=-1)  # [n, k]
        projected = self.hidden_projection(hidden[0])  # [n, r]
        predecessor, path = anchor.reshape(1), []
        q = torch.zeros_like(logits[0], dtype=torch.float32)  # [n, V]
        for t in range(hidden.shape[1]):
            scores = self.scores(projected[t : t + 1], unary[t : t + 1], candidates[t : t + 1], predecessor)[
                0
            ]
            probs = (scores / temperature).softmax(-1)
            cdf = probs.double().cumsum(-1)
            index = int(
                torch.searchsorted(cdf, uniforms[t : t + 1].to(cdf) * cdf[-1:], right=True).clamp(
                    max=len(cdf) - 1
                )
            )
            q[t].scatter_(0, candidates[t], probs)
            predecessor = candidates[t, index : index + 1]
            path.append(predecessor)
        return torch.cat(path), q

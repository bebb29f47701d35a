"""What the policy learns online of a drafter/target pair: how often each kind of proposal is accepted, as
`AcceptanceTable`s (policy.py) keyed by what predicts it (the drafter's confidence and the slot's depth, prompt
lookup's match, the grammar's forced text), shared by every generation of the process."""

from __future__ import annotations

import weakref
from typing import Any

import torch

from .lookup import LOOKUP_MAX_NGRAM, LOOKUP_MAX_TOKENS
from .policy import AcceptanceTable, confidence_keys, confidence_prior

# Jump-forward (constrained rows): at most this many tokens of the text the grammar forces, proposed for free.
JUMP_FORWARD_MAX_TOKENS = 15
# The drafter's acceptance estimates are kept apart for these depths (a group from each to the next): a draft's
# chance of being accepted once the drafts before it were is not its confidence's alone. With the shipped SmolLM2
# drafter (int8 compiled, 18 prompts, benchmarks/README.md) one table over all depths estimated the first drafts at
# 66 % on average where 57 % were accepted, the third and fourth at 59 % (64 % accepted), the fifth on at 86 % (96 %):
# a drafter on track stays on track, so one table over-rated drafting at all and under-rated verifying further.
DEPTH_GROUPS = (0, 1, 2, 4)
# A draft tree's node below a lower candidate of an earlier slot is keyed apart from the nodes of the drafter's own
# line: the drafter predicted its slot after its own draft there, not after that candidate, so the same confidence
# is worth less (nodes below a lower candidate were estimated at 0.58 where 0.29-0.50 were accepted on a 2-core
# EPYC, benchmarks/README.md 2026-12-01). Their prior: this share of the confidence.
BELOW_PRIOR = 0.5
# The drafter table's keys in each depth group: `confidence_bins` keys each for the drafter's own drafts (range 0),
# a tree slot's lower candidates (LOWER) and the nodes below a lower candidate (BELOW).
LOWER, BELOW = 1, 2


class Calibration:
    """Acceptance tables of one drafter/target pair."""

    def __init__(self, depth_groups: tuple[int, ...] = DEPTH_GROUPS) -> None:
        self.confidence_bins = 20
        self.depth_groups = depth_groups
        self._offsets: dict[int, torch.Tensor] = {}
        # Lookup: keyed by (matched n-gram size, slot); prior 0.5 for the first slot, lower further out.
        lookup_prior = [0.5 * 0.9**slot for _ in range(LOOKUP_MAX_NGRAM) for slot in range(LOOKUP_MAX_TOKENS)]
        self.lookup = AcceptanceTable(lookup_prior)
        # The drafter's, keyed by (depth group, confidence bin) (`draft_keys`): in each depth group, bins keys for
        # the drafter's own drafts, then bins for the other candidates of a draft tree's slots (a token the drafter
        # ranked lower is accepted at another rate than its top one with the same probability), then bins for a
        # tree's nodes below a lower candidate (`BELOW`); own and lower start calibrated (p = confidence). Then a
        # draft tree's nodes from prompt lookup (`tree.add_branch`), keyed as the lookup table is, from
        # `tree_lookup_key` on.
        calibrated = confidence_prior(self.confidence_bins)
        below = [BELOW_PRIOR * p for p in calibrated]
        drafts = (calibrated + calibrated + below) * len(depth_groups)
        self.tree_lookup_key = len(drafts)
        self.draft = AcceptanceTable(drafts + lookup_prior)
        # Jump-forward, keyed by slot: the forced text is certain, its spelling is not (RowGrammar.jump_forward).
        self.grammar = AcceptanceTable([0.8 * 0.9**slot for slot in range(JUMP_FORWARD_MAX_TOKENS)])

    def draft_keys(
        self, confidence: torch.Tensor, candidates: bool = False, below: bool = False
    ) -> torch.Tensor:
        """The drafter table's keys of drafts with these confidences: [..., D] the drafts of slots 0..D-1 (a slot's
        depth in a chain), or with `candidates` [D, W] each slot's W draft-tree candidates, the drafter's own draft
        first (a tree's node at slot d is d deep); with `below` too, the keys those candidates take below a lower
        candidate of an earlier slot (`BELOW`)."""
        keys = confidence_keys(confidence, self.confidence_bins)
        offset = self._depth_offsets(confidence.shape[-2] if candidates else confidence.shape[-1])
        if not candidates:
            return keys + offset
        if below:
            keys += BELOW * self.confidence_bins
        else:
            keys[:, 1:] += LOWER * self.confidence_bins
        return keys + offset[:, None]

    def _depth_offsets(self, slots: int) -> torch.Tensor:
        """[slots]: the first key of each slot's depth group (asked twice a step: made once per slot count)."""
        offsets = self._offsets.get(slots)
        if offsets is None:
            group = torch.bucketize(torch.arange(slots), torch.tensor(self.depth_groups), right=True) - 1
            offsets = self._offsets[slots] = 3 * self.confidence_bins * group
        return offsets


_CALIBRATIONS: weakref.WeakKeyDictionary[Any, Calibration] = weakref.WeakKeyDictionary()


def calibration_for(draft: Any, depth_groups: tuple[int, ...] | None = None) -> Calibration:
    """The process's tables for this drafter, made on first use (with these depth groups: an A/B's)."""
    calibration = _CALIBRATIONS.get(draft)
    if calibration is None:
        calibration = _CALIBRATIONS[draft] = Calibration(depth_groups or DEPTH_GROUPS)
    return calibration


__all__ = ["BELOW_PRIOR", "DEPTH_GROUPS", "JUMP_FORWARD_MAX_TOKENS", "Calibration", "calibration_for"]

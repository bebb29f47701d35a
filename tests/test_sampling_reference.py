"""The sampling law against an independent implementation: transformers' logits processors (temperature, then
top-k, then top-p, the order `generate` applies them in) give the distribution `target_probs` gives, for the three
together; and every invalid parameter is refused in one line that names it."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashdraft import SamplingParams
from flashdraft.sampling import SamplingError, target_probs


def transformers_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    processors = LogitsProcessorList([TemperatureLogitsWarper(params.temperature)])
    if params.top_k:
        processors.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        processors.append(TopPLogitsWarper(params.top_p))
    ids = torch.zeros(logits.shape[0], 1, dtype=torch.long)
    return processors(ids, logits.double()).softmax(-1)


@pytest.mark.parametrize("temperature", [0.3, 0.7, 1.0, 1.6])
@pytest.mark.parametrize("top_k", [0, 1, 5, 40])
@pytest.mark.parametrize("top_p", [1.0, 0.95, 0.6, 0.05])
def test_the_law_is_transformers_temperature_top_k_and_top_p_together(temperature, top_k, top_p):
    generator = torch.Generator().manual_seed(hash((temperature, top_k, top_p)) % 2**31)
    logits = torch.randn(64, 300, generator=generator) * 3  # 64 rows, spread enough for top-p to cut
    params = SamplingParams(temperature, top_p, top_k)
    ours, theirs = target_probs(logits, params).double(), transformers_probs(logits, params)
    assert torch.equal(ours > 0, theirs > 0), "a different set of tokens kept"
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)
    kept = (ours > 0).sum(-1)
    if top_k:
        assert int(kept.max()) <= top_k
    if top_p < 0.1 and top_k != 1:
        assert int(kept.min()) >= 1 and float(kept.float().mean()) < 3  # the head of each row only


def _refused(**kwargs) -> str:
    with pytest.raises(SamplingError) as info:
        SamplingParams(**kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


@settings(max_examples=60, deadline=None)
@given(
    st.one_of(
        st.floats(max_value=0.0, exclude_max=False),
        st.floats(min_value=1.0, exclude_min=True),
        st.just(math.nan),
    )
)
def test_every_top_p_outside_zero_to_one_is_refused_naming_it(top_p):
    assert _refused(top_p=top_p).startswith("top_p must be in (0, 1]")


@settings(max_examples=60, deadline=None)
@given(st.one_of(st.floats(max_value=0.0, exclude_max=True), st.just(math.inf), st.just(math.nan)))
def test_every_negative_or_non_finite_temperature_is_refused_naming_it(temperature):
    assert _refused(temperature=temperature).startswith("temperature must be a finite number >= 0")


@settings(max_examples=40, deadline=None)
@given(st.one_of(st.integers(max_value=-1), st.booleans(), st.floats(allow_nan=True)))
def test_every_top_k_that_is_not_a_count_is_refused_naming_it(top_k):
    assert _refused(top_k=top_k).startswith("top_k must be an integer >= 0")


@pytest.mark.parametrize(("top_p", "kept"), [(0.5, 1), (0.75, 2), (0.875, 3), (0.9, 4), (0.9375, 4)])
def test_top_p_keeps_the_smallest_head_whose_mass_reaches_it_exactly(top_p, kept):
    """Probabilities that are powers of two sum exactly: at a mass equal to top_p the head stops there (as in
    transformers), one token later it does not."""
    logits = torch.tensor([[0.5, 0.25, 0.125, 0.0625, 0.03125, 0.03125]]).log()
    params = SamplingParams(1.0, top_p, 0)
    ours = target_probs(logits, params).double()
    assert int((ours > 0).sum()) == kept
    assert torch.equal(ours > 0, transformers_probs(logits, params) > 0)

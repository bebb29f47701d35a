"""The drafter's vocabulary (vocab.py): the LM head over the most frequent tokens, output still plain decoding's."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from conftest import (
    VOCAB,
    assert_batched_dflash_is_plain_decoding,
    assert_dflash_is_plain_decoding,
    compiled_plan,
)
from flashdraft import DFlashDraftModel, Target, generate, generate_ar
from flashdraft.drafter.vocab import (
    DraftVocabError,
    drafter_vocabulary,
    expand_logits,
    restrict_head,
    vocabulary_ids,
)
from flashdraft.engine.batched_dflash import BatchedDFlashProposer
from flashdraft.engine.decoder import BatchDecoder
from flashdraft.kernels.packed_linear import PackedLinear
from flashdraft.kernels.packed_linear import available as onednn_available
from flashdraft.kernels.quantize import Fp16Linear, Int8Linear, fp16_available
from flashdraft.sampling import SamplingParams


def drafter_for(target: Target, size: int | None, seed: int = 0) -> DFlashDraftModel:
    """A random block-6 drafter whose token counts favour a random half of the vocabulary."""
    torch.manual_seed(seed)
    draft = DFlashDraftModel.for_target(
        target.model.config, num_layers=1, block_size=6, mask_token_id=VOCAB - 1
    ).eval()
    draft.token_counts = torch.randint(0, 1000, (VOCAB,), generator=torch.Generator().manual_seed(seed))
    draft.draft_vocab_size = size
    return draft


def test_the_vocabulary_is_the_most_counted_tokens_and_the_ones_always_kept():
    counts = torch.tensor([5, 9, 9, 0, 7, 1, 9, 3])
    # 9, 9, 9 (ids 1, 2, 6, lower id first), then 7 (id 4); id 3 (never counted) kept as a stop token
    assert vocabulary_ids(counts, 4, 8, always=[3]).tolist() == [1, 2, 3, 4, 6]
    assert vocabulary_ids(counts, 2, 8).tolist() == [1, 2]
    assert vocabulary_ids(counts, 8, 8) is None  # the whole vocabulary: no restriction
    assert vocabulary_ids(counts, 7, 8, always=[0, 3, 5, 7]) is None
    with pytest.raises(DraftVocabError, match="cover 8 tokens"):
        vocabulary_ids(counts, 4, 9)
    with pytest.raises(DraftVocabError, match="at least one"):
        vocabulary_ids(counts, 0, 8)


def test_a_drafter_without_token_counts_covers_every_token_unless_asked(models):
    target = Target(models["llama"])
    draft = drafter_for(target, None)
    draft.token_counts = None
    assert drafter_vocabulary(draft, target, VOCAB) is None  # auto: z-lab's drafters ship no counts
    draft.draft_vocab_size = 32
    with pytest.raises(DraftVocabError, match="token counts"):
        drafter_vocabulary(draft, target, VOCAB)
    draft = drafter_for(target, 0)
    assert drafter_vocabulary(draft, target, VOCAB) is None  # --draft-vocab all
    draft.draft_vocab_size = 40
    ids = drafter_vocabulary(draft, target, VOCAB)
    stops = set(target.eos_token_ids)
    assert stops and stops <= set(ids.tolist()) and 40 <= ids.numel() <= 40 + len(stops)


def _heads():
    torch.manual_seed(0)
    linear = nn.Linear(48, VOCAB, bias=True)
    yield "dense", linear
    yield "int8", Int8Linear(linear, compute_dtype=torch.float32)
    yield "int8-bf16", Int8Linear(linear, compute_dtype=torch.bfloat16)
    if fp16_available():
        yield "fp16", Fp16Linear(linear)
    if onednn_available():
        yield "onednn", PackedLinear(linear)


@pytest.mark.parametrize("kind", [k for k, _ in _heads()])
def test_a_restricted_head_gives_the_whole_head_s_logits_for_its_tokens(kind):
    head = dict(_heads())[kind]
    ids = torch.tensor(sorted(random.Random(1).sample(range(VOCAB), 30)))
    hidden = torch.randn(7, 48)
    with torch.no_grad():
        if kind == "dense":
            weight, bias = restrict_head(head.weight, head.bias, ids)
            part = torch.nn.functional.linear(hidden, weight, bias)
            whole = head(hidden)
        else:
            part_head = restrict_head(head, None, ids)
            assert type(part_head) is type(head) and part_head.out_features == 30
            dtype = getattr(head, "compute_dtype", torch.float32)
            part, whole = part_head(hidden.to(dtype)).float(), head(hidden.to(dtype)).float()
    tolerance = {"rtol": 1e-2, "atol": 1e-2} if "bf16" in kind else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(part, whole[:, ids], **tolerance)
    full = expand_logits(part, ids, VOCAB)
    assert full.shape == (7, VOCAB) and torch.equal(full[:, ids], part)
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[ids] = False
    assert torch.isneginf(full[:, outside]).all()


def test_drafts_come_from_the_drafter_s_vocabulary(models):
    target = Target(models["llama"])
    prompts = ([5, 6, 7, 8], [9, 10, 11])

    def drafts(draft):
        proposer = BatchedDFlashProposer(draft, target, block_size=6)
        decoder = BatchDecoder(target, proposer)
        for prompt in prompts:
            decoder.add(prompt, 4, SamplingParams(), stop_token_ids=[], seed=0)
        decoder.step()  # prefill
        tokens, confidence = proposer.draft_rows(decoder.rows)
        assert ((confidence > 0) & (confidence <= 1)).all()
        return set(tokens.flatten().tolist())

    whole = drafts(drafter_for(target, 0))
    # a vocabulary without the tokens the whole head drafts (never counted): drafts of other tokens
    draft = drafter_for(target, 24)
    draft.token_counts[list(whole)] = -1
    ids = set(drafter_vocabulary(draft, target, VOCAB).tolist())
    assert not whole & ids - set(target.eos_token_ids)
    assert drafts(draft) <= ids


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_dflash_with_a_draft_vocabulary_is_plain_decoding(models, arch):
    """Greedy and seeded sampling, one row and batches with rows joining, draft trees (sampled p/q drafts:
    test_draft_sampling.py, the target's law)."""
    target = Target(models[arch])
    draft = drafter_for(target, 20)
    assert_dflash_is_plain_decoding(target, draft)
    assert_batched_dflash_is_plain_decoding(target, draft)
    prompt = [3, 14, 15, 92, 65, 35]
    for temperature, sampling, tree in ((0.0, "match", 8), (0.9, "match", 6)):
        plain = generate_ar(target, torch.tensor([prompt]), 24, temperature=temperature, seed=2)
        got = generate(
            target, draft, prompt, 24, temperature=temperature, seed=2, block_size=6,
            draft_sampling=sampling, tree=tree,
        )  # fmt: skip
        assert got.new_tokens == plain.new_tokens, (temperature, sampling, tree)


def test_token_counts_travel_with_the_drafter(models, tmp_path):
    target = Target(models["llama"])
    draft = drafter_for(target, None)
    draft.token_counts_source = "answer tokens of somewhere"
    draft.save_pretrained(tmp_path / "d")
    loaded = DFlashDraftModel.from_pretrained(tmp_path / "d")
    assert torch.equal(loaded.token_counts, draft.token_counts)
    assert loaded.token_counts_source == "answer tokens of somewhere"
    # vLLM and SGLang load every *.safetensors file of the folder as the drafter's weights (vLLM refuses a stray one)
    assert [f.name for f in (tmp_path / "d").glob("*.safetensors")] == ["model.safetensors"]
    (tmp_path / "d" / "token_counts.json").unlink()
    assert DFlashDraftModel.from_pretrained(tmp_path / "d").token_counts is None  # z-lab's layout alone
    for broken in ("not json", '{"vocab_size": 64, "ids": [1, 2], "counts": [5]}', '{"ids": [1], "counts": [5]}',
                   '{"vocab_size": 64, "ids": [99], "counts": [5]}'):  # fmt: skip
        (tmp_path / "d" / "token_counts.json").write_text(broken)
        with pytest.raises(DraftVocabError, match="token_counts.json"):
            DFlashDraftModel.from_pretrained(tmp_path / "d")


@pytest.mark.parametrize("quantized", [False, True])
def test_the_compiled_draft_head_over_a_vocabulary_gives_the_eager_head_s_logits(quantized):
    """Compiled as the verify is (frozen weights, inductor's GEMM template), expanded inside the graph, its greedy
    drafts mapped back to the whole vocabulary's ids; a compiled head is kept per vocabulary, never handed to another
    one."""
    from types import SimpleNamespace

    from flashdraft.drafter.model import draft_logits, scale_draft_logits
    from flashdraft.engine.compiled_draft import draft_head
    from flashdraft.engine.tree import top_candidates
    from flashdraft.kernels.plan import compile_options

    torch.manual_seed(0)
    target = SimpleNamespace(
        plan=compiled_plan(compile_options(torch.device("cpu"))), model=torch.nn.Module()
    )
    config = SimpleNamespace(output_multiplier=0.5, final_logit_softcapping=3.0)
    linear = nn.Linear(48, VOCAB, bias=True)
    ids = torch.tensor(sorted(random.Random(2).sample(range(VOCAB), 40)))
    other = torch.tensor(sorted(random.Random(3).sample(range(VOCAB), 40)))
    torch._dynamo.reset()
    with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False):
        if quantized:
            module = Int8Linear(linear, compute_dtype=torch.float32)

            def head_for(vocab):
                return draft_head(config, None, None, target, module=restrict_head(module, None, vocab),
                                  vocab=(vocab, VOCAB))  # fmt: skip

            def eager(hidden, vocab):
                part = restrict_head(module, None, vocab)
                return expand_logits(scale_draft_logits(config, part(hidden).float()), vocab, VOCAB)
        else:

            def head_for(vocab):
                weight, bias = restrict_head(linear.weight, linear.bias, vocab)
                return draft_head(config, weight, bias, target, vocab=(vocab, VOCAB))

            def eager(hidden, vocab):
                weight, bias = restrict_head(linear.weight, linear.bias, vocab)
                return expand_logits(draft_logits(config, hidden, weight, bias), vocab, VOCAB)

        head = head_for(ids)
        assert head_for(ids) is head and head_for(other) is not head
        for rows in (15, 4):
            hidden = torch.randn(rows, 48)
            got, tokens, confidence = head(hidden)
            torch.testing.assert_close(got, eager(hidden, ids), rtol=1e-5, atol=1e-5)
            assert torch.isneginf(got).sum() == rows * (VOCAB - 40)
            torch.testing.assert_close(head_for(other)(hidden)[0], eager(hidden, other), rtol=1e-5, atol=1e-5)
            # the greedy drafts are token ids of the whole vocabulary, with or without the expanded logits
            assert torch.equal(tokens, got.argmax(-1)) and bool(torch.isin(tokens, ids).all())
            none, alone, sure = head(hidden, logits=False)
            assert none is None and torch.equal(alone, tokens)
            torch.testing.assert_close(sure, confidence, rtol=1e-5, atol=1e-6)
            # a draft tree's candidates, token ids of the whole vocabulary too
            _, _, _, top_tokens, top_p = head(hidden, logits=False, top=3)
            want_tokens, want_p = top_candidates(got, 3)
            assert torch.equal(top_tokens, want_tokens)
            torch.testing.assert_close(top_p, want_p, rtol=1e-5, atol=1e-6)

"""The one loader every entry point uses (`generate`, `serve`, `bench`, `eval`, the Python API): the pair checked
before any weight is read, the drafter in the target's dtype and on its device, the price list when asked."""

from __future__ import annotations

import pytest
import torch

from conftest import VOCAB, on_disk, tiny_config, tiny_model
from flashdraft import DFlashDraftModel, DraftTargetMismatchError, Pipeline, Target, load_pipeline
from test_serve import tiny_tokenizer


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    dirs = on_disk(Target(tiny_model("llama"), tiny_tokenizer()), root)
    other = tiny_config("llama", hidden_size=128)
    wrong = root / "wrong-draft"
    DFlashDraftModel.for_target(other, num_layers=1, block_size=4, mask_token_id=VOCAB - 1).save_pretrained(
        wrong
    )
    return {**dirs, "wrong": str(wrong)}


def test_a_pipeline_is_the_target_its_drafter_and_the_price_list_when_asked(pair, monkeypatch):
    import flashdraft.engine.measure as measure

    measured = []
    monkeypatch.setattr(
        measure, "load_or_measure_costs", lambda t, d, log=None: measured.append((t, d)) or "prices"
    )
    pipeline = load_pipeline(pair["target"], pair["draft"], dtype="bfloat16", draft_vocab=100)
    assert isinstance(pipeline, Pipeline) and pipeline.costs is None and measured == []
    assert pipeline.target.name == pair["target"] and pipeline.target.dtype == torch.bfloat16
    drafter = pipeline.drafter
    assert isinstance(drafter, DFlashDraftModel) and drafter.draft_vocab_size == 100
    assert next(drafter.parameters()).dtype == torch.bfloat16  # in the target's dtype, on its device
    assert pipeline.compile_note is None
    assert pipeline.measure_costs() == "prices" and pipeline.costs == "prices"
    assert measured == [(pipeline.target, drafter)]
    asked = load_pipeline(pair["target"], pair["draft"], costs=True)
    assert asked.costs == "prices" and len(measured) == 2
    plain = load_pipeline(pair["target"])  # no drafter: plain decoding, and nothing to price
    assert plain.drafter is None
    with pytest.raises(ValueError, match="has none"):
        plain.measure_costs()


def test_a_drafter_made_for_another_target_is_refused_before_any_weight_is_read(pair, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("weights were loaded before the pair was checked")

    monkeypatch.setattr("flashdraft.targets.target.load_target", refuse)
    monkeypatch.setattr(DFlashDraftModel, "from_pretrained", refuse)
    with pytest.raises(DraftTargetMismatchError, match="hidden"):
        load_pipeline(pair["target"], pair["wrong"])

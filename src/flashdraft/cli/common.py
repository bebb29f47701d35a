"""What the command modules share: the consoles and argument parsers used by more than one command."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.console import Console

console = Console(stderr=True)
out = Console()

# `--compile` of the decoding commands (generate, bench, serve).
CompileOption = Annotated[
    bool,
    typer.Option(
        "--compile",
        help="verify through the static KV cache, compiled (CUDA graphs on a GPU); attention-only targets",
    ),
]
QuantizeOption = Annotated[
    str | None,
    typer.Option(
        "--quantize",
        help="int8: the target's linear layers int8 weight-only with bf16 activations (CPU), or fp32 ones with "
        "--dtype float32 (fast with --compile); w8a8: int8 weights and int8 activations, each row quantized alone "
        "(CPUs with VNNI; compiled with avx512_vnni or AMX; a little less accurate than int8); w8a16: int8 weights "
        "and each row as 16-bit integers, an integer kernel bound by the weights' bytes (CPUs with avx512_vnni and "
        "avx512_bf16); "
        "fp16: fp16 weight-only with fp32 activations (x86 CPUs); lossless against plain decoding of the same "
        "quantized model",
    ),
]

TreeOption = Annotated[
    str,
    typer.Option(
        "--tree",
        help="draft trees: off (chains) | N (at most N draft nodes verified per step, the best of the drafter's "
        "few candidates per slot) | auto (the policy picks the tree size); the output is unchanged",
    ),
]
DraftVocabOption = Annotated[
    str,
    typer.Option(
        "--draft-vocab",
        help="the drafter's LM head over the N most frequent tokens of what it was trained on (its "
        "token_counts.json): N | all | auto (8192 where the drafter ships token counts, else all); the "
        "output is unchanged",
    ),
]


def parse_draft_vocab(text: str) -> int | None:
    """`--draft-vocab`: N tokens, 0 for all, None for auto."""
    from ..drafter.vocab import DraftVocabError

    word = text.strip().lower()
    if word == "auto":
        return None
    if word == "all":
        return 0
    if not word.isdigit() or int(word) < 1:
        raise DraftVocabError(f"--draft-vocab must be a number of tokens, all or auto, not {text!r}")
    return int(word)


def parse_tree(text: str) -> int | None:
    """`--tree`: its node budget (None: chains), checked by the engine's own `check_tree`."""
    from ..engine.request import GenerationError
    from ..engine.tree import check_tree

    try:
        return check_tree(text)
    except ValueError as e:
        raise GenerationError(str(e).replace("tree", "--tree", 1)) from None


def tree_note(target: Any, nodes: int | None) -> str | None:
    """One line for --verbose when --tree is asked of a target that verifies chains only (not an error)."""
    from ..engine.tree import tree_refusal

    reason = None if nodes is None else tree_refusal(target)
    return None if reason is None else f"--tree: {target.name} has {reason}; verifying chains"


def load_noting(target: str, draft: Any, **options: Any) -> Any:
    """`flashdraft.load_pipeline` for a command: what `--compile` could not compile said in one note line."""
    from ..pipeline import load_pipeline

    pipeline = load_pipeline(target, draft, **options)
    if pipeline.compile_note:
        console.print(f"[yellow]note:[/] {pipeline.compile_note}")
    return pipeline


def parse_block_size(text: str, drafter_block_size: int | None) -> int | str:
    """`--block-size`: "auto" (the cost-aware default) or a fixed verify length within the drafter's block, checked
    by the engine's own `check_block_size` (one name and one check from the command line to the engine)."""
    from ..engine.request import GenerationError, check_block_size

    try:
        verify = check_block_size(text, drafter_block_size)
    except GenerationError as e:
        raise GenerationError(str(e).replace("block_size", "--block-size", 1)) from None
    return "auto" if verify is None else verify

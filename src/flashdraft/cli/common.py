"""What the command modules share: the consoles and argument parsers used by more than one command."""

from __future__ import annotations

from rich.console import Console

console = Console(stderr=True)
out = Console()


def parse_block_size(text: str, drafter_block_size: int | None) -> int | str:
    """`--block-size`: "auto" (the cost-aware default) or a fixed verify length within the drafter's block."""
    from ..generate import GenerationError

    if text.strip().lower() == "auto":
        return "auto"
    try:
        verify = int(text)
    except ValueError:
        raise GenerationError(f"--block-size must be 'auto' or an integer, got {text!r}") from None
    if drafter_block_size is not None and not 1 <= verify <= drafter_block_size:
        raise GenerationError(
            f"--block-size must be between 1 and the drafter's block size {drafter_block_size}, got {verify}"
        )
    return verify

"""What the command modules share: the consoles and argument parsers used by more than one command."""

from __future__ import annotations

from rich.console import Console

console = Console(stderr=True)
out = Console()


def parse_block_size(text: str, drafter_block_size: int | None) -> int | str:
    """`--block-size`: "auto" (the cost-aware default) or a fixed verify length within the drafter's block, checked
    by the engine's own `check_block_size` (one name and one check from the command line to the engine)."""
    from ..engine import GenerationError, check_block_size

    try:
        verify = check_block_size(text, drafter_block_size)
    except GenerationError as e:
        raise GenerationError(str(e).replace("block_size", "--block-size", 1)) from None
    return "auto" if verify is None else verify

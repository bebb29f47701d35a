"""Bad input is one line, never a traceback: the error types that mean it, and how commands report them."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def user_errors() -> tuple[type[BaseException], ...]:
    """Errors that mean bad input (or a missing resource): shown as one line, never as a traceback."""
    from .bench import BenchError
    from .config import DFlashConfigError
    from .data_layout import DataError
    from .datasets import DatasetError
    from .draft_vocab import DraftVocabError
    from .drafter_files import DFlashCheckpointError
    from .extras import MissingExtraError
    from .grammar import GrammarError
    from .memory_plan import PlanError
    from .packs import PackError
    from .prompts import PromptFormatError
    from .quantize import QuantizeError
    from .remote import RemoteError
    from .request import GenerationError
    from .sampling import SamplingError
    from .target import TargetError
    from .train import TrainError

    return (
        BenchError,
        DataError,
        DatasetError,
        DraftVocabError,
        DFlashConfigError,
        DFlashCheckpointError,
        RemoteError,
        GenerationError,
        GrammarError,
        PackError,
        PromptFormatError,
        QuantizeError,
        SamplingError,
        TargetError,
        MissingExtraError,
        PlanError,
        TrainError,
        FileNotFoundError,
    )


def print_error(error: BaseException) -> None:
    """`error: <message>` on stderr, on one line (logs and scripts read it), markup off so paths print as they are."""
    from rich.console import Console

    Console(stderr=True).print(
        " ".join(f"error: {error}".splitlines()), style="bold red", markup=False, soft_wrap=True
    )


def one_line_errors(command: F) -> F:
    """Wrap a CLI command: a user error prints one line and exits with status 2."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        import typer

        try:
            return command(*args, **kwargs)
        except user_errors() as e:
            print_error(e)
            raise typer.Exit(2) from None

    return wrapper  # type: ignore[return-value]

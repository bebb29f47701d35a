"""Bad input is one line, never a traceback: the error types that mean it, and how commands report them."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def user_errors() -> tuple[type[BaseException], ...]:
    """Errors that mean bad input (or a missing resource): shown as one line, never as a traceback."""
    from .bench import BenchError
    from .drafter.checkpoint import DFlashCheckpointError
    from .drafter.config import DFlashConfigError
    from .drafter.vocab import DraftVocabError
    from .engine.grammar import GrammarError
    from .engine.request import GenerationError
    from .extras import MissingExtraError
    from .kernels.plan import KernelPlanError
    from .kernels.quantize import QuantizeError
    from .models.packs import PackError
    from .prompts.benchmarks import DatasetError
    from .prompts.files import PromptFormatError
    from .sampling import SamplingError
    from .targets.target import TargetError
    from .training.data_layout import DataError
    from .training.memory_plan import PlanError
    from .training.remote import RemoteError
    from .training.trainer import TrainError

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
        KernelPlanError,
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

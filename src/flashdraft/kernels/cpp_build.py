"""How flashdraft's C++ operator libraries are built (w8a16_cpp.py, attention_cpp.py, decoder_layer_cpp.py) from
their sources in `csrc/` (package data): with inductor's compiler, flags and vector ISA, linked to libtorch, through
inductor's C++ code cache (`CppCodeCache`: cached on disk as inductor's own kernels are, so a later process loads the
library instead of compiling it). A library registers its operators' CPU kernels (`TORCH_LIBRARY_IMPL`) as it loads.

inductor compiles with `-march=native` and keys its cache on the source and the command line, which reads the same on
every x86 CPU: a cache shared by two machines (a home directory on a network, a copied image) would hand a library
with AMX or avx512 instructions to a CPU without them. So the source built carries the CPU's instruction-set
features in a first comment line (`cpu_info.cpu_features`): one library per source and feature set."""

from __future__ import annotations

import inspect
import logging
from importlib import resources
from typing import Any

from .cpu_info import cpu_features

log = logging.getLogger(__name__)


def source_file(name: str) -> str:
    """The text of `csrc/<name>`, a C++ source (or a template of one) shipped with the package."""
    return (resources.files(__package__) / "csrc" / name).read_text(encoding="utf-8")


def load(source: str, what: str) -> Any | None:
    """Build (or load from the cache) the library of C++ `source`; the loaded module, or None where it cannot be
    built (no C++ compiler, another torch), with one warning naming `what`. Outside any graph being traced."""
    try:
        from torch._inductor.codecache import CppCodeCache

        class OperatorCodeCache(CppCodeCache):  # a library with libtorch's headers and libraries
            cache: dict[str, Any] = {}
            cache_clear = staticmethod(cache.clear)
            cpp_compile_command_flags = {"include_pytorch": True, "shared": True}

        # torch 2.13 infers the vector ISA's flags from the source unless told; 2.11 has no such keyword (the
        # attention kernel did not build there, and trees were refused: an H200 machine's torch, 2026-11-29)
        told = "needs_vec_isa" in inspect.signature(CppCodeCache.load_async).parameters
        stamped = (
            f"// built for: {cpu_features()}\n{source}"  # one library per feature set (module docstring)
        )
        return OperatorCodeCache.load(stamped, device_type="cpu", **({"needs_vec_isa": True} if told else {}))
    except Exception as err:  # noqa: BLE001 - any build failure means: the operator's caller goes without it
        log.warning(
            "flashdraft: %s did not build (%s)",
            what,
            str(err).splitlines()[0] if str(err) else type(err).__name__,
        )
        return None

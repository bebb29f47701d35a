"""How flashdraft's C++ operator libraries are built (w8a16_cpp.py, attention_cpp.py, decoder_layer_cpp.py): with
inductor's compiler, flags and vector ISA, linked to libtorch, through inductor's C++ code cache (`CppCodeCache`:
cached on disk as inductor's own kernels are, so a later process loads the library instead of compiling it). A
library registers its operators' CPU kernels (`TORCH_LIBRARY_IMPL`) as it loads."""

from __future__ import annotations

import inspect
import logging
from typing import Any

log = logging.getLogger(__name__)


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
        return OperatorCodeCache.load(source, device_type="cpu", **({"needs_vec_isa": True} if told else {}))
    except Exception as err:  # noqa: BLE001 - any build failure means: the operator's caller goes without it
        log.warning(
            "flashdraft: %s did not build (%s)",
            what,
            str(err).splitlines()[0] if str(err) else type(err).__name__,
        )
        return None

"""The environment switches that choose kernels, read here and only here (each at the moment it is asked, so a
process that sets one before its first model sees it). They turn a kernel off for an A/B or a bug report; none
changes what a model computes beyond its last bits, and the compiled graphs are keyed on them (engine/compiled.py's
`kernels_tag`). The kernel plan issue 82 asks for is to be made from these and the CPU's features."""

from __future__ import annotations

import os

OFF = ("0", "false", "no", "off")


def _on(name: str) -> bool:
    return os.environ.get(name, "1").strip().lower() not in OFF


def compile_options_json() -> str | None:
    """`$FLASHDRAFT_COMPILE`: torch.compile's keywords as a JSON object, for the compiled decode path
    (engine/compiled.py's `compile_options`), or None."""
    return os.environ.get("FLASHDRAFT_COMPILE") or None


def fused_layers() -> bool:
    """`$FLASHDRAFT_FUSED_LAYERS` (on unless 0): a compiled w8a16 target's layers as decoder_layer_cpp.py's operator,
    else inductor's graph of the model's own layers."""
    return _on("FLASHDRAFT_FUSED_LAYERS")


def short_query_attention() -> bool:
    """`$FLASHDRAFT_ATTENTION` (unless "sdpa"): the short-query attention of attention.py on a CPU, else
    transformers' SDPA function for every query."""
    return os.environ.get("FLASHDRAFT_ATTENTION", "").strip().lower() != "sdpa"


def attention_tiles() -> bool:
    """`$FLASHDRAFT_ATTENTION_TILES` (on unless 0): bf16 scores on AMX's tiles where the CPU has them."""
    return _on("FLASHDRAFT_ATTENTION_TILES")


def packed_linears() -> bool:
    """`$FLASHDRAFT_PACKED_LINEAR` (on unless 0 / false / no / off): an fp32 target's linears through oneDNN with
    packed weights on a CPU."""
    return _on("FLASHDRAFT_PACKED_LINEAR")

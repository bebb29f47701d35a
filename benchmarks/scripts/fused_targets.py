"""SmolLM2-135M `--dtype bfloat16 --quantize w8a16 --compile` twice in one process: with inductor's graph of the
model's own layers ("unfused") and with the fused decoder layer ("fused", decoder_layer_cpp.py), for the scripts
that compare them (fused_layer_ab.py, fused_layer_features.py; beside them, so they import it)."""

import os

from flashdraft.engine.compiled import compile_verify
from flashdraft.targets.target import load_target


def fused_and_unfused() -> dict:
    """{"unfused": target, "fused": target}, each compiled (`FLASHDRAFT_FUSED_LAYERS` set for each as it loads)."""
    targets = {}
    for name in ("unfused", "fused"):
        os.environ["FLASHDRAFT_FUSED_LAYERS"] = "1" if name == "fused" else "0"
        target = load_target(
            "smollm2-135m-instruct", dtype="bfloat16", device="cpu", quantize="w8a16", compiled=True
        )
        compile_verify(target)
        targets[name] = target
    return targets

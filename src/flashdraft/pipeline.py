"""What decoding needs, loaded once and the same way for every entry point: `flashdraft generate`, `serve`, `bench`
and `eval`, and the Python API (`load_pipeline`).

In order, so that a mistake costs a second and not a model load: the target's and the drafter's configs are read
and checked against each other (a target the engine cannot roll back exactly, a drafter made for another target),
then the target is loaded (quantized, compiled: `--compile`'s note says why it decodes eagerly, if it does), then
the drafter, in the target's dtype and on its device; the price list of the cost-aware verify length is measured (or
read from its cache) when asked, at load or later (`Pipeline.measure_costs`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .drafter.model import DFlashDraftModel
from .targets.target import Target


@dataclass
class Pipeline:
    """A loaded target, its drafter (None: plain decoding), and the price list (None until measured)."""

    target: Target
    drafter: DFlashDraftModel | None = None
    costs: Any = None  # engine.costs.CostModel
    compile_note: str | None = None  # why `--compile` decodes eagerly here, if it does

    def measure_costs(self, log: Callable[[str], None] | None = None) -> Any:
        """The price list of this target and drafter on this machine (engine/measure.py: cached), kept here."""
        from .engine.measure import load_or_measure_costs

        if self.drafter is None:
            raise ValueError("the price list prices a drafter's passes: this pipeline has none")
        self.costs = load_or_measure_costs(self.target, self.drafter, log=log)
        return self.costs


def load_pipeline(
    target: str | Path,
    draft: str | Path | None = None,
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    quantize: str | None = None,
    images: bool | None = None,
    compile: bool = False,
    draft_vocab: int | None = None,
    costs: bool = False,
    log: Callable[[str], None] | None = None,
) -> Pipeline:
    """Load `target` (a pack name, local path or hub id) and the drafter `draft` (a directory or hub id; None: none),
    checked against each other before any weight is read. `quantize`, `compile`, `images`: as `load_target`'s
    (`compile`: its verify compiled; the kernels are its plan's, `target.plan`). `draft_vocab`: the drafter's head over this
    many tokens (0: all; None: its own choice, drafter/vocab.py). `costs`: measure the price list now."""
    from .kernels.plan import check_quantize
    from .targets.target import load_target, parse_device, parse_dtype

    name = str(target)
    torch_dtype, dev = parse_dtype(dtype), parse_device(device)
    check_quantize(quantize, torch_dtype, dev)
    path, _ = check_pair(target, draft)
    loaded = load_target(
        path, dtype=torch_dtype, device=dev, quantize=quantize, images=images, compiled=compile
    )
    loaded.name = name
    loaded.check_decodable()
    pipeline = Pipeline(loaded, compile_note=loaded.plan.compile_note)
    if draft is not None:
        drafter = DFlashDraftModel.from_pretrained(draft, dtype=loaded.dtype, device=loaded.device)
        drafter.draft_vocab_size = draft_vocab
        pipeline.drafter = drafter
        if costs:
            pipeline.measure_costs(log)
    return pipeline


def check_pair(target: str | Path, draft: str | Path | None = None) -> tuple[str, Any]:
    """The target's path (a pack fetched once) and Hugging Face config, checked from the configs alone: a target the
    engine can decode exactly, a drafter (if any) made for it. One line for what is wrong, before any weight."""
    from transformers import AutoConfig

    from .drafter.checkpoint import load_drafter_config
    from .models.packs import resolve_model
    from .targets.target import TargetError, check_decodable_config, check_drafter_fits_config

    name = str(target)
    draft_config = load_drafter_config(draft) if draft is not None else None
    path = resolve_model(target)  # unknown pack names fail here
    try:
        target_config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TargetError(f"cannot read the config of target {name!r}: {first}") from None
    check_decodable_config(target_config, name)
    if draft_config is not None:
        check_drafter_fits_config(draft_config, target_config, name)
    return path, target_config

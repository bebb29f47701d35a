"""`flashdraft bench --backend mlx`: the local benchmark's methods ar, dflash and dflash-fixed decoded by the MLX
backend (flashdraft.mlx), behind the interface of local.py's `LocalMethods`, so the report is the same one."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from .config import BenchConfig, BenchError, console, drafter_record
from .metrics import RunOutput


@dataclass(frozen=True)
class MlxKernels:
    """What the report's kernel fields say of an MLX run: mlx-lm's own kernels, nothing compiled by flashdraft."""

    compiled: bool = False
    static_cache: bool = False

    def describe(self) -> str:
        import mlx.core as mx

        return f"mlx {mx.__version__} on {mx.default_device()}: mlx-lm's target, the MLX drafter (eager)"


class MlxBenchTarget:
    """The MLX target as the benchmark reads a target: the MlxTarget's own tokenizer, prompts, context, stops and
    dtype, and what the report says of its device, kernels and quantization."""

    def __init__(self, target: Any) -> None:
        self.mlx = target
        self.device = torch.device("cpu")  # the host the report describes (MLX's own device is in `kernels`)
        self.plan = MlxKernels()
        bits = (target.config.get("quantization") or {}).get("bits")
        self.quantize = f"mlx {bits}-bit" if bits else None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.mlx, name)


class MlxMethods:
    """Loads the MLX pipeline once and runs ar / dflash / dflash-fixed on a prompt."""

    weighs_flips = False  # greedy mismatches are reported, not re-scored by the torch target

    def __init__(self, cfg: BenchConfig) -> None:
        from ..mlx import load_pipeline

        self.cfg = cfg
        wants_draft = any(m != "ar" for m in cfg.methods)
        self.pipeline = load_pipeline(cfg.target, cfg.draft if wants_draft else None, dtype=cfg.dtype)
        self.target = MlxBenchTarget(self.pipeline.target)
        self.compile_note = None
        self.device = self.target.device
        self.stop_ids = self.target.eos_token_ids
        self.draft = self.pipeline.drafter
        self.block_size = self.draft.block_size if self.draft is not None else None
        self.verify: int | str = cfg.block_size or "auto"
        if self.block_size and cfg.block_size and cfg.block_size > self.block_size:
            raise BenchError(
                f"--block-size {cfg.block_size} exceeds the drafter's block size {self.block_size}"
            )
        self.cost_model = None
        if self.draft is not None and self.verify == "auto" and "dflash" in cfg.methods:
            from ..mlx.policy import measure_prices

            self.draft.prices = self.cost_model = measure_prices(self.pipeline.target, self.draft)
            console.print(self.cost_model.summary(), soft_wrap=True)
        self.assistant = self.llamacpp = None

    def close(self) -> None:
        pass

    @property
    def drafter_info(self) -> dict[str, Any] | None:
        if self.draft is None:
            return None
        from mlx.utils import tree_flatten

        parameters = sum(v.size for _, v in tree_flatten(self.draft.parameters()))
        return drafter_record(self.cfg.draft, self.draft.config, parameters, None)

    def hf_generation_settings(self) -> dict[str, Any]:
        return {}

    def run(self, method: str, input_ids: Any, max_new_tokens: int, seed: int, response_format: Any = None):
        from ..mlx import generate, generate_ar

        seen: list[float] = []
        common = dict(
            response_format=response_format,
            temperature=self.cfg.temperature,
            seed=seed,
            stop_token_ids=self.stop_ids,
            on_tokens=lambda _ids: seen.append(time.perf_counter()),
        )
        ids = input_ids[0].tolist()
        if method == "ar":
            res = generate_ar(self.pipeline, ids, max_new_tokens, **common)
        else:
            verify = self.block_size if method == "dflash-fixed" else self.verify
            res = generate(self.pipeline, None, ids, max_new_tokens, block_size=verify, **common)
        return RunOutput.of(res, method != "ar", seen)

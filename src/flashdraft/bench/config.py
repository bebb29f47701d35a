"""Benchmark settings: the methods, the local and server configurations and their checks, the machine record."""

from __future__ import annotations

import math
import os
import platform
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import Progress

from ..engine.measure import cpu_name
from ..progress import progress_bar
from ..prompts.benchmarks import BenchDataset, load_bench_dataset

METHODS: dict[str, str] = {
    "ar": "flashdraft plain decoding (same loop, no drafter)",
    "hf": "transformers generate (greedy / sampling, no speculation)",
    "dflash": "flashdraft DFlash speculative decoding (default: cost-aware verify length, --block-size auto)",
    "dflash-fixed": "flashdraft DFlash with a fixed verify length: the drafter's trained block (the paper's setting)",
    "dflash-pq": "dflash with drafts sampled from the drafter at T > 0 and speculative (p/q) rejection sampling",
    "dflash-tree": "dflash verifying draft trees (--tree nodes at most, default auto): the policy picks their size",
    "sd": "transformers assisted generation with a small draft model",
    "pld": "transformers prompt-lookup decoding",
    "llamacpp": "llama.cpp plain decoding: its llama-server on the same weights as a GGUF (--llamacpp-model)",
    "llamacpp-lookup": "llama.cpp prompt lookup (llama-server --spec-type ngram-simple)",
    "llamacpp-dflash": "llama.cpp DFlash (--spec-type draft-dflash) with the drafter as a GGUF (--llamacpp-draft)",
}


DFLASH_METHODS = ("dflash", "dflash-fixed", "dflash-pq", "dflash-tree")

# Methods whose sampled output is seed-exact: at T > 0 they emit the tokens ar draws with the same seed (the engine's
# seed-keyed sampler), so their outputs are compared with ar's at every temperature. dflash-pq draws by rejection
# (another law of the same distribution) and transformers' methods by torch's generator: compared at T=0 only.
SEED_EXACT_METHODS = ("dflash", "dflash-fixed", "dflash-tree")

# Another engine on another weight format: timed beside the others, its outputs not held to ar's (bench/llamacpp.py).
LLAMACPP_METHODS = ("llamacpp", "llamacpp-lookup", "llamacpp-dflash")


REFERENCE = "ar"  # the output every method must reproduce at T=0, and the first speedup baseline


HF_BASELINE = "hf"


console = Console(stderr=True)


class BenchError(ValueError):
    """A benchmark that cannot run as asked (bad method list, missing model, unreachable server, ...)."""


@dataclass
class BenchConfig:
    target: str
    datasets: list[str]
    methods: list[str] = field(default_factory=lambda: ["ar", "hf", "dflash"])
    draft: str | None = None
    assistant: str | None = None
    max_samples: int | None = None
    max_new_tokens: int = 256
    temperature: float = 0.0
    block_size: int | None = None
    tree: int | None = None  # dflash-tree's node budget (None: TREE_AUTO_NODES)
    draft_vocab: int | None = None  # --draft-vocab: the drafter head's tokens (0: all; None: auto)
    pld_tokens: int = 10
    seed: int = 0
    out_dir: Path | None = None
    device: str | None = None
    dtype: str | None = None
    threads: int | None = None
    compile_verify: bool = False  # every method's verify through the static cache, compiled (CUDA graphs)
    # "int8": the target's linear layers int8 weight-only (quantize.py), for every method alike
    quantize: str | None = None
    thinking: bool | None = None
    chat: bool = True
    save_outputs: bool = False
    warmup: bool = True
    plots: bool = True
    command: str | None = None
    show_progress: bool = True
    llamacpp: str | None = None  # llama-server (a file or its directory); None: on PATH
    llamacpp_model: str | None = None  # the target as a GGUF
    llamacpp_draft: str | None = None  # the drafter as a GGUF (llama.cpp's converter), for llamacpp-dflash
    llamacpp_draft_max: int | None = None  # llama-server --spec-draft-n-max (None: its default)
    llamacpp_args: str = ""  # more llama-server options for every llama.cpp method (its best on this CPU)
    llamacpp_context: int = 4096
    engine: str = "torch"  # "mlx": ar and the dflash methods decoded by flashdraft.mlx (bench/mlx_methods.py)


@dataclass
class ServerBenchConfig:
    base_url: str
    datasets: list[str]
    model: str | None = None
    concurrency: list[int] = field(default_factory=lambda: [1])
    api: str = "chat"  # chat -> /v1/chat/completions, completion -> /v1/completions
    stream: bool = True
    max_samples: int | None = None
    max_new_tokens: int = 256
    temperature: float = 0.0
    seed: int = 0
    timeout_s: float = 600.0
    thinking: bool | None = None
    api_key: str | None = None  # sent as a Bearer token; never written to results
    out_dir: Path | None = None
    save_outputs: bool = False
    warmup: bool = True
    plots: bool = True
    command: str | None = None
    show_progress: bool = True


def parse_methods(text: str | Sequence[str]) -> list[str]:
    items = [m.strip().lower() for m in (text.split(",") if isinstance(text, str) else text) if m.strip()]
    unknown = [m for m in items if m not in METHODS]
    if unknown:
        raise BenchError(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    if not items:
        raise BenchError(f"no methods given; choose from {', '.join(METHODS)}")
    methods = list(dict.fromkeys(items))
    if REFERENCE not in methods:
        methods.insert(0, REFERENCE)  # the output-equality check and speedups need the reference
    return methods


def parse_concurrency(text: str | Sequence[int]) -> list[int]:
    try:
        levels = (
            [int(x) for x in text.split(",") if x.strip()]
            if isinstance(text, str)
            else [int(x) for x in text]
        )
    except ValueError:
        raise BenchError(f"--concurrency expects comma-separated positive integers, got {text!r}") from None
    if not levels or any(c < 1 for c in levels):
        raise BenchError(f"--concurrency expects comma-separated positive integers, got {text!r}")
    return levels


def split_datasets(text: str) -> list[str]:
    """`gsm8k,humaneval` -> two datasets; a file path containing a comma stays whole."""
    if Path(text).expanduser().is_file():
        return [text]
    names = [d.strip() for d in text.split(",") if d.strip()]
    if not names:
        raise BenchError("no dataset given")
    return names


def validate_common(max_new_tokens: int, temperature: float, max_samples: int | None) -> None:
    if max_new_tokens < 1:
        raise BenchError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    if not math.isfinite(temperature) or temperature < 0:
        raise BenchError(f"--temperature must be >= 0, got {temperature}")
    if max_samples is not None and max_samples < 1:
        raise BenchError(f"--max-samples must be at least 1, got {max_samples}")


def validate_config(cfg: BenchConfig) -> None:
    """Every check that needs no model: fail in a second, not after loading weights."""
    cfg.methods = parse_methods(cfg.methods)
    if cfg.engine == "mlx":  # what that backend runs, before the methods' own checks
        check_mlx_config(cfg)
    validate_common(cfg.max_new_tokens, cfg.temperature, cfg.max_samples)
    if any(m in DFLASH_METHODS for m in cfg.methods) and not cfg.draft:
        raise BenchError("method dflash needs a drafter: pass --draft DIR")
    if "sd" in cfg.methods and not cfg.assistant:
        raise BenchError(
            "method sd needs a small draft model sharing the target's tokenizer: pass --assistant MODEL "
            "(e.g. qwen2.5-coder-0.5b-instruct for qwen2.5-coder-1.5b-instruct)"
        )
    if cfg.block_size is not None and cfg.block_size < 1:
        raise BenchError(f"--block-size must be at least 1, got {cfg.block_size}")
    if cfg.dtype is not None and cfg.dtype not in ("float32", "bfloat16", "float16"):
        raise BenchError(f"--dtype must be float32, bfloat16 or float16, got {cfg.dtype!r}")
    if cfg.pld_tokens < 1:
        raise BenchError(f"--pld-tokens must be at least 1, got {cfg.pld_tokens}")
    if cfg.quantize is not None and cfg.engine != "mlx":  # refused before any load, as every command does
        from ..kernels.plan import check_quantize
        from ..targets.target import parse_device, parse_dtype

        check_quantize(cfg.quantize, parse_dtype(cfg.dtype), parse_device(cfg.device))


def drafter_record(path: Any, config: Any, parameters: int, draft_vocab: int | None) -> dict[str, Any]:
    """What results.json says of the drafter a run used (either backend's)."""
    return {
        "path": str(path),
        "block_size": config.block_size,
        "layers": config.num_hidden_layers,
        "target_layer_ids": list(config.target_layer_ids),
        "mask_token_id": config.mask_token_id,
        "parameters": parameters,
        "draft_vocab": draft_vocab,  # the head's tokens (None: all)
        "flashdraft": getattr(config, "flashdraft", None) or {},
    }


def machine_info(
    device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> dict[str, Any]:
    import transformers

    from .._version import __version__

    info: dict[str, Any] = {
        "cpu": cpu_name(),
        "logical_cores": os.cpu_count(),
        "affinity_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "flashdraft": __version__,
        "device": str(device) if device is not None else None,
        "dtype": str(dtype).removeprefix("torch.") if dtype is not None else None,
    }
    try:
        import psutil

        info["physical_cores"] = psutil.cpu_count(logical=False)
        info["memory_gb"] = round(psutil.virtual_memory().total / 1e9, 1)
    except ImportError:
        pass
    if hasattr(os, "getloadavg"):  # other jobs on the machine make timings noisy: record how busy it was
        info["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    if device is not None and torch.device(device).type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


def progress_display(enabled: bool) -> Progress:
    return progress_bar(enabled, unit="prompts", console=console)


def default_out_dir(datasets: Sequence[str]) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    label = "-".join(Path(d).name.split(".")[0] for d in datasets)[:60]
    return Path("bench-results") / f"{label}-{stamp}"


def load_datasets(names: Sequence[str], max_samples: int | None, seed: int) -> list[BenchDataset]:
    return [load_bench_dataset(name, max_samples=max_samples, seed=seed) for name in names]


def dataset_info(ds: BenchDataset) -> dict[str, Any]:
    return {
        "name": ds.name,
        "source": ds.source,
        "records": ds.num_records,
        "conversations": len(ds.conversations),
        "turns": ds.num_turns,
        "sample_indices": ds.sample_indices,
    }


MLX_METHODS = ("ar", "dflash", "dflash-fixed")  # what `bench --backend mlx` runs (mlx_methods.py)


def check_mlx_config(cfg: BenchConfig) -> None:
    """The benchmark options the MLX backend does not run, refused by name before any load."""
    from ..extras import require_extra

    other = [m for m in cfg.methods if m not in MLX_METHODS]
    if other:
        raise BenchError(
            f"methods {', '.join(other)} do not run with --backend mlx (it runs {', '.join(MLX_METHODS)})"
        )
    asked = [
        name
        for name, value, unset in (
            ("--compile", cfg.compile_verify, False),
            ("--quantize", cfg.quantize, None),
            ("--device", cfg.device, None),
            ("--threads", cfg.threads, None),
            ("--draft-vocab", cfg.draft_vocab, None),
        )
        if value != unset
    ]
    if asked:
        raise BenchError(
            f"{', '.join(asked)} {'is' if len(asked) == 1 else 'are'} not available with --backend mlx"
        )
    require_extra("mlx", "mlx", "mlx_lm")

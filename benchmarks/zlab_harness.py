"""z-lab's own benchmark harness (`dflash benchmark`, PyPI dflash==0.1.0) with its prompts read from a local JSONL.

The harness loads its datasets from the Hugging Face hub (`datasets.load_dataset("openai/gsm8k", ...)`); on a
machine without the hub this script gives it the same rows from a local file and runs it otherwise unchanged: its
own request body (`send_openai`), its own prompt order and formatting, its own τ from the server's `meta_info`.
Run it in the venv `make test-zlab` builds, plus the harness's HTTP client (`.venv-zlab/bin/pip install requests`),
against a running `flashdraft serve`:

    .venv-zlab/bin/python benchmarks/zlab_harness.py --data ../shared/data/gsm8k_test.jsonl -- \
        benchmark openai --base-url http://127.0.0.1:8000 --model smollm2-135m-instruct \
        --dataset gsm8k --num-prompts 16 --concurrency 1 --max-new-tokens 128

Everything after `--` is `dflash`'s own command line.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", type=Path, required=True, help="JSONL rows with the hub dataset's fields")
    ap.add_argument("dflash_args", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    rest = args.dflash_args[1:] if args.dflash_args[:1] == ["--"] else args.dflash_args

    import dflash.benchmark as harness
    from dflash.cli import main as dflash_main

    def load_local(name: str) -> list[dict]:
        cfg = harness.DATASETS[name]
        with args.data.open() as f:
            rows = [json.loads(line) for line in f if line.strip()]
        return [{"turns": cfg["format"](r) if cfg.get("multi_turn") else [cfg["format"](r)]} for r in rows]

    harness.load_and_process_dataset = load_local
    dflash_main(rest)


if __name__ == "__main__":
    main()

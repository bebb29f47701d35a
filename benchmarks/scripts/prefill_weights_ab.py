"""An int8 target's prompt prefills with its layers keeping their bf16 weight (quantize.PREFILL_WEIGHT_BYTES, the
default) against converting it per call (room 0), two targets in one process, interleaved round by round.
Run: python benchmarks/scripts/prefill_weights_ab.py [--prompts 16] [--rounds 4]   (GSM8K prompts, 2 threads)"""

import argparse
import time

import torch

import flashdraft.kernels.quantize as quantize
from flashdraft.prompts.benchmarks import load_bench_dataset
from flashdraft.engine.kv_cache import batch_cache
from flashdraft.engine.measure import cpu_name
from flashdraft.targets.target import load_target


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kept = load_target(args.target, dtype="bfloat16", quantize="int8", compiled=True)
    room, quantize.PREFILL_WEIGHT_BYTES = quantize.PREFILL_WEIGHT_BYTES, 0
    converting = load_target(args.target, dtype="bfloat16", quantize="int8", compiled=True)
    quantize.PREFILL_WEIGHT_BYTES = room
    data = load_bench_dataset("gsm8k", max_samples=args.prompts, seed=0)
    prompts = [kept.encode_prompt(c.user_turns[0]) for c in data.conversations]
    print(
        f"machine: {cpu_name()}, {args.threads} threads; {len(prompts)} prompts of "
        f"{min(p.shape[1] for p in prompts)}-{max(p.shape[1] for p in prompts)} tokens"
    )

    def prefills(target) -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            for ids in prompts:
                target.forward(ids, batch_cache(target), [], last_logits_only=True, prefill=True)
        return time.perf_counter() - t0

    prefills(kept), prefills(converting)  # the kept weights made, untimed
    for r in range(args.rounds):
        a, b = prefills(kept), prefills(converting)
        print(f"round {r}: kept {a:.3f} s, converting per call {b:.3f} s: {a / b:.2f}x", flush=True)


if __name__ == "__main__":
    main()

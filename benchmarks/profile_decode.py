"""Where a decode step's time goes: one DFlash step (draft + verify) against one plain step, same process.

    python benchmarks/profile_decode.py --target smollm2-135m-instruct --draft drafters/smollm2-135m-instruct

Prints median times of: a plain one-token target step, the draft pass (B query tokens + LM head on B-1 slots, in
`--draft-dtype`, bf16 by default as the cost model picks on CPUs with fast bf16),
the target's verify pass over B tokens, the cache rollback, and the break-even τ = (draft + verify) / plain step:
the mean acceptance length above which speculation is faster than plain decoding on this machine. A torch.profiler
table of one full `generate` call follows (top operators by self CPU time).
"""

from __future__ import annotations

import argparse
import time

import torch

from flashdraft import DFlashDraftModel, DFlashProposer, generate, load_target
from flashdraft.measure import median_seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--draft", default="drafters/smollm2-135m-instruct")
    ap.add_argument("--context", type=int, default=256, help="tokens already in the cache")
    ap.add_argument("--block-sizes", default="4,8,16")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument(
        "--draft-dtype",
        default="bfloat16",
        help="precision of the drafter and its head copy (float32|bfloat16)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)

    target = load_target(args.target)
    draft = DFlashDraftModel.from_pretrained(args.draft, dtype=target.dtype, device=target.device)
    ids = torch.randint(10, 1000, (1, args.context))
    cache = target.new_cache()
    prefill = target.forward(ids, cache, draft.config.target_layer_ids)

    def plain_step():
        target.forward(ids[:, :1], cache)
        target.crop(cache, args.context)

    t_plain = median_seconds(plain_step, args.repeats)
    print(f"machine threads={args.threads}, context={args.context} tokens, draft dtype {args.draft_dtype}")
    print(f"plain step (1 token, target forward):            {t_plain * 1e3:8.1f} ms")
    print(
        f"{'B':>3} {'draft ms':>9} {'verify ms':>10} {'rollback ms':>12} {'step/plain':>11} {'break-even τ':>13}"
    )
    for block in (int(b) for b in args.block_sizes.split(",")):
        proposer = DFlashProposer(draft, target, dtype=getattr(torch, args.draft_dtype))
        proposer.start(prefill.features)
        proposer.draft_logits(5, args.context, block - 1)  # absorb the prompt context once

        def draft_pass(proposer=proposer, block=block):
            proposer.draft_logits(5, args.context, block - 1)

        def verify_pass(block=block):
            target.forward(ids[:, :block], cache, draft.config.target_layer_ids)
            target.crop(cache, args.context)

        t_draft = median_seconds(draft_pass, args.repeats)
        t_verify = median_seconds(verify_pass, args.repeats)
        target.forward(ids[:, :block], cache)  # rollback of a rejected block: time the crop alone
        t0 = time.perf_counter()
        target.crop(cache, args.context)
        t_crop = time.perf_counter() - t0
        ratio = (t_draft + t_verify) / t_plain
        print(
            f"{block:>3} {t_draft * 1e3:9.1f} {t_verify * 1e3:10.1f} {t_crop * 1e3:12.3f} {ratio:11.2f} {ratio:13.2f}"
        )

    prompt = target.encode_prompt("Janet's ducks lay 16 eggs per day. How many eggs in a week?")
    generate(target, draft, prompt, 16)  # also measures (or loads) the cost model of the default policy
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        res = generate(target, draft, prompt, 64)
    steps = res.proposer_stats.get("steps_by_source")
    print(
        f"\ntorch.profiler, one generate() (block_size=auto) of {res.num_new_tokens} tokens, "
        f"τ={res.mean_acceptance_length:.2f}, steps by source {steps}:"
    )
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()

"""Where a decode step's time goes: one DFlash step (draft + verify) against one plain step, same process.

    python benchmarks/profile_decode.py --target smollm2-135m-instruct --draft drafters/smollm2-135m-instruct

Prints median times of: a plain one-token target step, the draft pass (B query tokens + LM head on B-1 slots, in
`--draft-dtype`, bf16 by default as the cost model picks on CPUs with fast bf16),
the target's verify pass over B tokens, the cache rollback, and the break-even τ = (draft + verify) / plain step:
the mean acceptance length above which speculation is faster than plain decoding on this machine. A torch.profiler
table of one full `generate` call follows (top operators by self CPU time), and the share of that call spent
outside the model forwards (target and drafter; the engine's own work: proposing, accepting, rolling back).
`--device cuda --dtype bfloat16` profiles a GPU (the playbook does); `--compile` the compiled verify (CUDA graphs
there; its graphs are made by a warm-up first); `--json FILE` keeps the figures.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch

from flashdraft import DFlashDraftModel, DFlashProposer, Target, generate, load_target
from flashdraft.engine.compiled import VerifyForward, compile_verify
from flashdraft.engine.measure import median_seconds, static_decoder


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--draft", default="drafters/smollm2-135m-instruct")
    ap.add_argument("--context", type=int, default=256, help="tokens already in the cache")
    ap.add_argument("--block-sizes", default="4,8,16")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--device", default=None, help="cpu | cuda (default: cuda when there is one)")
    ap.add_argument("--dtype", default=None, help="target dtype (default: bf16 on GPUs, fp32 on CPUs)")
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    ap.add_argument(
        "--compile", action="store_true", help="the static cache's verify, compiled (compiled.py)"
    )
    ap.add_argument(
        "--draft-dtype",
        default="bfloat16",
        help="precision of the drafter and its head copy (float32|bfloat16)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)

    target = load_target(args.target, dtype=args.dtype, device=args.device)
    if args.compile:
        note = compile_verify(target)
        if note:
            raise SystemExit(note)
    draft = DFlashDraftModel.from_pretrained(args.draft, dtype=target.dtype, device=target.device)
    blocks = [int(b) for b in args.block_sizes.split(",")]
    # Room for the longest verify after the context (a small model's window may be shorter than --context).
    args.context = max(1, min(args.context, target.max_context - max(blocks) - 2))
    ids = torch.randint(10, min(1000, target.vocab_size), (1, args.context), device=target.device)
    figures: dict = {
        "device": str(target.device),
        "dtype": str(target.dtype),
        "context": args.context,
        "blocks": {},
        "compile_verify": args.compile,
    }
    if target.device.type == "cuda":
        figures["gpu"] = torch.cuda.get_device_name(target.device)
    cache = target.new_cache()
    prefill = target.forward(ids, cache, draft.config.target_layer_ids)
    decoder = static_decoder(target, draft, ids) if args.compile else None

    def plain_step():
        if decoder is not None:  # compiled: the one-token verify the engine runs for a plain step
            decoder.forward_block(ids[:, :1], torch.tensor([[args.context]], device=target.device))
            target.crop(decoder.cache, args.context)
            return
        target.forward(ids[:, :1], cache)
        target.crop(cache, args.context)

    t_plain = median_seconds(plain_step, args.repeats)
    figures["plain_step_ms"] = t_plain * 1e3
    print(f"machine threads={args.threads}, context={args.context} tokens, draft dtype {args.draft_dtype}")
    how = "the compiled verify of 1 token" if decoder is not None else "target forward"
    print(f"plain step (1 token, {how}): {t_plain * 1e3:8.1f} ms")
    if decoder is not None:
        print("(draft ms: the drafter's eager pass; the compiled engine's block pass is inside the generate() below)")
    print(
        f"{'B':>3} {'draft ms':>9} {'verify ms':>10} {'rollback ms':>12} {'step/plain':>11} {'break-even τ':>13}"
    )
    for block in blocks:
        proposer = DFlashProposer(draft, target, dtype=getattr(torch, args.draft_dtype))
        proposer.start(prefill.features)
        proposer.draft_logits(5, args.context, block - 1)  # absorb the prompt context once

        def draft_pass(proposer=proposer, block=block):
            proposer.draft_logits(5, args.context, block - 1)

        def verify_pass(block=block):
            if decoder is not None:  # compiled: the engine's own verify over its static cache
                decoder.forward_block(
                    ids[:, :block],
                    torch.arange(args.context, args.context + block, device=target.device)[None],
                )
                target.crop(decoder.cache, args.context)
                return
            target.forward(ids[:, :block], cache, draft.config.target_layer_ids)
            target.crop(cache, args.context)

        t_draft = median_seconds(draft_pass, args.repeats)
        t_verify = median_seconds(verify_pass, args.repeats)
        target.forward(ids[:, :block], cache)  # rollback of a rejected block: time the crop alone
        t0 = time.perf_counter()
        target.crop(cache, args.context)
        t_crop = time.perf_counter() - t0
        ratio = (t_draft + t_verify) / t_plain
        figures["blocks"][block] = {"draft_ms": t_draft * 1e3, "verify_ms": t_verify * 1e3, "rollback_ms": t_crop * 1e3,
                                    "break_even_tau": ratio}  # fmt: skip
        print(
            f"{block:>3} {t_draft * 1e3:9.1f} {t_verify * 1e3:10.1f} {t_crop * 1e3:12.3f} {ratio:11.2f} {ratio:13.2f}"
        )

    prompt = target.encode_prompt("Janet's ducks lay 16 eggs per day. How many eggs in a week?")
    # Also measures (or loads) the cost model of the default policy; compiled, the verify's graphs are made here.
    generate(target, draft, prompt, 64 if args.compile else 16)
    if args.compile:  # hooks on the target would enter its graphs: its two entry points are timed instead
        in_models = forward_timer(
            draft, target.lm_head, functions=[(Target, "forward"), (VerifyForward, "__call__")]
        )
    else:
        in_models = forward_timer(target.model, draft, target.lm_head)
    t0 = time.perf_counter()
    timed = generate(target, draft, prompt, 64)
    _sync(target.device)
    whole = time.perf_counter() - t0
    in_models.remove()
    outside = 1 - in_models.seconds / whole
    figures["generate"] = {"tokens": timed.num_new_tokens, "steps": timed.num_steps, "seconds": whole,
                           "model_forward_seconds": in_models.seconds, "outside_forward_share": outside}  # fmt: skip
    print(f"\none generate() of {timed.num_new_tokens} tokens in {timed.num_steps} steps: {whole * 1e3:.1f} ms, "
          f"{in_models.seconds * 1e3:.1f} ms in model forwards, {outside:.1%} outside them (the engine)")  # fmt: skip
    activities = [torch.profiler.ProfilerActivity.CPU]
    if target.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        res = generate(target, draft, prompt, 64)
    steps = res.proposer_stats.get("steps_by_source")
    print(
        f"\ntorch.profiler, one generate() (block_size=auto) of {res.num_new_tokens} tokens, "
        f"τ={res.mean_acceptance_length:.2f}, steps by source {steps}:"
    )
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class forward_timer:
    """Wall time inside the given modules' forwards (the target, the drafter, the LM head the drafter borrows;
    nested calls counted once; synchronised on a GPU so each forward's kernels count in it): what is left of a step
    is the engine's."""

    def __init__(self, *modules: torch.nn.Module, functions: list[tuple[type, str]] = ()) -> None:
        self.seconds = 0.0
        self._depth = 0
        self._started = 0.0
        self._handles = []
        self._wrapped = []
        for module in modules:
            self._handles.append(module.register_forward_pre_hook(self._pre))
            self._handles.append(module.register_forward_hook(self._post))
        for owner, name in functions:  # methods timed as a whole (a compiled forward cannot take hooks)
            original = getattr(owner, name)

            def timed(*args, _original=original, **kwargs):
                self._pre(_model_of(args), None)
                try:
                    return _original(*args, **kwargs)
                finally:
                    self._post(_model_of(args), None, None)

            setattr(owner, name, timed)
            self._wrapped.append((owner, name, original))

    def _pre(self, module, _args) -> None:
        if self._depth == 0:
            _sync(_device_of(module))
            self._started = time.perf_counter()
        self._depth += 1

    def _post(self, module, _args, _out) -> None:
        self._depth -= 1
        if self._depth == 0:
            _sync(_device_of(module))
            self.seconds += time.perf_counter() - self._started

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        for owner, name, original in self._wrapped:
            setattr(owner, name, original)


def _device_of(module: torch.nn.Module) -> torch.device:
    """Where a timed module runs: its first parameter's device, else its first buffer's (a packed head keeps its
    weights as buffers), else the CPU."""
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        return tensor.device
    return torch.device("cpu")


def _model_of(args: tuple) -> torch.nn.Module:
    """The module whose device a timed method's sync waits on: its target's model."""
    return args[0].model if isinstance(args[0], Target) else args[0].target.model


if __name__ == "__main__":
    main()

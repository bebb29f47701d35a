"""Grammar-steered drafts, on against off, paired in one process: does steering the drafter by the grammar pay?

For every record of the shipped structured-output set (JSON schemas, json_object, tool calls), decodes plain (the
reference), DFlash with the drafts steered by the grammar (the default) and DFlash with steering switched off, in a
rotating order so neither always runs first; checks all three answers are equal and reports tokens per second and
tokens per verify (τ) per category. Writes markdown and JSON.

    python benchmarks/steering_ab.py --out benchmarks/structured-output/steering
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import torch

import flashdraft.batched_dflash as proposers
from flashdraft import DFlashDraftModel, generate, generate_ar, load_target
from flashdraft.datasets import load_bench_dataset
from flashdraft.measure import cpu_name
from flashdraft.tool_calls import encode_tool_prompt, parse_tool_choice, parse_tools, tool_constraint


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--draft", default="drafters/smollm2-135m-instruct")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/structured-output/steering")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target(args.target)
    drafter = DFlashDraftModel.from_pretrained(args.draft).eval()
    steer = proposers.steer_drafts
    methods = {
        "plain": lambda ids, fmt: generate_ar(target, ids, args.max_new_tokens, response_format=fmt),
        "steered": lambda ids, fmt: generate(target, drafter, ids, args.max_new_tokens, response_format=fmt),
        "unsteered": lambda ids, fmt: generate(
            target, drafter, ids, args.max_new_tokens, response_format=fmt
        ),
    }
    records = load_bench_dataset("structured").conversations
    totals: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0, 0.0, 0]))
    unequal = []
    with torch.inference_mode():
        for index, conv in enumerate([records[0], *records]):  # the first one twice: a warm-up, not counted
            messages = [{"role": "user", "content": conv.user_turns[0]}]
            if conv.meta.get("tools"):
                tools = parse_tools(conv.meta["tools"])
                ids = encode_tool_prompt(target, messages, tools)
                fmt = tool_constraint(tools, parse_tool_choice(conv.meta.get("tool_choice"), tools))
            else:
                ids, fmt = target.encode_prompt(messages), conv.meta["response_format"]
            names = list(methods)
            order = names[index % 3 :] + names[: index % 3]
            outputs = {}
            for name in order:
                proposers.steer_drafts = steer if name == "steered" else (lambda *a: 0)
                t0 = time.perf_counter()
                result = methods[name](ids, fmt)
                outputs[name] = (result, time.perf_counter() - t0)
            proposers.steer_drafts = steer
            if index == 0:
                continue
            category = conv.meta.get("category", "other")
            if len({tuple(r.new_tokens) for r, _ in outputs.values()}) != 1:
                unequal.append(conv.id)
            for name, (result, seconds) in outputs.items():
                for key in (category, "all"):
                    row = totals[key][name]
                    row[0] += result.num_new_tokens
                    row[1] += seconds
                    row[2] += result.num_steps if name != "plain" else result.num_new_tokens
            print(
                conv.id, {n: f"{r.num_new_tokens / s:.1f} tok/s" for n, (r, s) in outputs.items()}, flush=True
            )
    table = {
        key: {
            name: {
                "tokens": row[0],
                "seconds": round(row[1], 3),
                "tok_s": round(row[0] / row[1], 2),
                "tau": round(row[0] / max(row[2], 1), 3),
            }  # fmt: skip
            for name, row in by_method.items()
        }
        for key, by_method in totals.items()
    }
    lines = [
        "# Grammar-steered drafts, on against off",
        "",
        f"`python benchmarks/steering_ab.py` — {args.target} + {args.draft}, fp32, {args.max_new_tokens} tokens, "
        f"greedy, {args.threads} threads, {cpu_name()}, torch {torch.__version__}; "
        f"the shipped structured set ({sum(1 for _ in records)} records), every answer checked equal to plain "
        f"({'all equal' if not unequal else 'UNEQUAL: ' + ', '.join(unequal)}). Each answer is one `generate()` "
        "call, whose policy starts without the acceptance tables a server or `flashdraft bench` has learnt by then, "
        "so compare the two DFlash columns with each other, not with the bench's.",
        "",
        "| set | plain tok/s | DFlash unsteered tok/s (τ) | DFlash steered tok/s (τ) | steered / unsteered |",
        "|---|---|---|---|---|",
    ]
    for key, t in table.items():
        p, u, s = t["plain"], t["unsteered"], t["steered"]
        lines.append(f"| {key} | {p['tok_s']} | {u['tok_s']} ({u['tau']}) | {s['tok_s']} ({s['tau']}) | "
                     f"{s['tok_s'] / u['tok_s']:.2f}× |")  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps({"table": table, "unequal": unequal}, indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

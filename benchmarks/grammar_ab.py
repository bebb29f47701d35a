"""The grammar's help to the proposer, on against off, paired in one process: do grammar-steered drafts and
jump-forward (the text a grammar forces, proposed without a draft pass) pay?

For every record of the shipped structured-output set (JSON schemas, json_object, tool calls), decodes plain (the
reference), DFlash as shipped (steering and jump-forward on) and DFlash with one of them switched off, in a rotating
order so none always runs first; checks every answer equals plain decoding's and reports tokens per second, tokens
per verify (τ) and the grammar's share of the time per category. Writes markdown and JSON.

    python benchmarks/grammar_ab.py --arms plain,shipped,no-jump --out benchmarks/structured-output/jump-forward
    python benchmarks/grammar_ab.py --arms plain,shipped,no-steer --out benchmarks/structured-output/steering
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import torch

import flashdraft.engine.batched_dflash as proposers
from flashdraft import DFlashDraftModel, generate, generate_ar, load_target
from flashdraft.prompts.benchmarks import load_bench_dataset
from flashdraft.engine.grammar import RowGrammar
from flashdraft.engine.measure import cpu_name
from flashdraft.engine.tool_calls import encode_tool_prompt, parse_tool_choice, parse_tools, tool_constraint


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--draft", default="drafters/smollm2-135m-instruct")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--arms", default="plain,shipped,no-jump", help="plain, shipped, no-steer, no-jump")
    ap.add_argument("--quantize", default=None, help="the target's weights: int8 | fp16 (default: as loaded)")
    ap.add_argument("--out", default="benchmarks/structured-output/jump-forward")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target(args.target, quantize=args.quantize)
    drafter = DFlashDraftModel.from_pretrained(args.draft).eval()
    steer, jump = proposers.steer_drafts, RowGrammar.jump_forward
    switches = {  # what each DFlash arm switches off
        "shipped": {},
        "no-steer": {"steer": lambda *a: 0},
        "no-jump": {"jump": lambda *a: []},
    }
    names = args.arms.split(",")
    if "plain" not in names or any(n != "plain" and n not in switches for n in names):
        ap.error(f"--arms: plain and any of {', '.join(switches)}")

    def run(name: str, ids: torch.Tensor, fmt: object):
        if name == "plain":
            return generate_ar(target, ids, args.max_new_tokens, response_format=fmt)
        proposers.steer_drafts = switches[name].get("steer", steer)
        RowGrammar.jump_forward = switches[name].get("jump", jump)
        try:
            return generate(target, drafter, ids, args.max_new_tokens, response_format=fmt)
        finally:
            proposers.steer_drafts, RowGrammar.jump_forward = steer, jump

    records = load_bench_dataset("structured").conversations
    totals: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0, 0.0, 0, 0.0, 0]))
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
            shift = index % len(names)
            outputs = {}
            for name in names[shift:] + names[:shift]:
                t0 = time.perf_counter()
                result = run(name, ids, fmt)
                outputs[name] = (result, time.perf_counter() - t0)
            if index == 0:
                continue
            category = conv.meta.get("category", "other")
            if len({tuple(r.new_tokens) for r, _ in outputs.values()}) != 1:
                unequal.append(conv.id)
            for name, (result, seconds) in outputs.items():
                sources = (result.proposer_stats or {}).get("steps_by_source", {})
                for key in (category, "all"):
                    row = totals[key][name]
                    row[0] += result.num_new_tokens
                    row[1] += seconds
                    row[2] += result.num_steps if name != "plain" else result.num_new_tokens
                    row[3] += result.grammar_s
                    row[4] += sources.get("grammar", 0)
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
                "steps": row[2],
                "grammar_share": round(row[3] / row[1], 4),
                "jump_forward_steps": row[4],
            }  # fmt: skip
            for name, row in by_method.items()
        }
        for key, by_method in totals.items()
    }
    arms = [n for n in names if n != "plain"]
    lines = [
        "# The grammar's help to the proposer, on against off",
        "",
        f"`python benchmarks/grammar_ab.py --arms {args.arms}` — {args.target} + {args.draft}, "
        f"{args.quantize or 'fp32'} weights, {args.max_new_tokens} tokens, greedy, {args.threads} threads, "
        f"{cpu_name()}, torch {torch.__version__}; the shipped structured set ({sum(1 for _ in records)} records), "
        "every answer checked equal to plain "
        f"({'all equal' if not unequal else 'UNEQUAL: ' + ', '.join(unequal)}). Each answer is one `generate()` "
        "call: the acceptance tables are the process's (shared by the arms), the cost corrections are each "
        "call's own. *shipped*: steering and jump-forward on; *no-steer*: the drafts not steered by the grammar; "
        "*no-jump*: no jump-forward proposals. Grammar: its share of the arm's time (masks, steering, "
        "jump-forward); jf steps: verifies that carried forced text.",
        "",
        "| set | plain tok/s | "
        + " | ".join(f"{a} tok/s (τ) | {a} grammar, jf steps" for a in arms)
        + " | "
        + " | ".join(f"shipped / {a}" for a in arms if a != "shipped")
        + " |",
        "|---|---|" + "---|---|" * len(arms) + "---|" * sum(a != "shipped" for a in arms),
    ]
    for key, t in table.items():
        cells = [key, str(t["plain"]["tok_s"])]
        for a in arms:
            cells += [f"{t[a]['tok_s']} ({t[a]['tau']})",
                      f"{100 * t[a]['grammar_share']:.1f} %, {t[a]['jump_forward_steps']}"]  # fmt: skip
        cells += [f"{t['shipped']['tok_s'] / t[a]['tok_s']:.2f}×" for a in arms if a != "shipped"]
        lines.append("| " + " | ".join(cells) + " |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps({"table": table, "unequal": unequal}, indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

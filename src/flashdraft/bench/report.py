"""Reports: results.json, report.md, the generated block of benchmarks/README.md, the terminal summary."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from .config import REFERENCE, BenchError
from .metrics import STALL_MIN_S, STALL_RATIO, SampleRecord
from .mismatches import NEAR_TIE, UNEXPLAINED
from .plots import plot_local, plot_server


def _verdicts(eq: dict[str, Any]) -> tuple[int, int]:
    """(near-ties, flips weighed) of a run's greedy mismatches; (0, 0) where none were weighed."""
    counts = eq.get("verdicts") or {}
    near, unexplained = counts.get(NEAR_TIE, 0), counts.get(UNEXPLAINED, 0)
    return near, near + unexplained


def _verdict_lines(eq: dict[str, Any]) -> list[str]:
    """What the near-tie test found (greedy runs): how many flips the rounding explains, how many it does not."""
    near, tested = _verdicts(eq)
    if not tested:
        return []
    return [
        f"At the first differing token, {near} of {tested} are **near-ties** and "
        f"**{tested - near} unexplained**: the plain margin (logit of ar's token minus the method's, from a "
        "one-token step) against how far that step and a batched forward over the same prefix disagree there "
        "(step vs batched, the largest logit difference) or the dtype's rounding; a flip the margin exceeds "
        "is unexplained, which is what a bug looks like. Outputs that only end at another length are not tested.",
        "",
    ]


def _fmt(value: float | None, spec: str = ".2f", scale: float = 1.0, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    return f"{value * scale:{spec}}{suffix}"


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    tmp.replace(path)


def _equal_cell(method: str, s: dict[str, Any], reference: str, unchecked: str) -> str:
    """How many outputs of `method` equal the reference's (the reference itself and methods not compared say so:
    at T>0 only the seed-exact ones are)."""
    if method == REFERENCE:
        return reference
    if not s["compared"]:
        return unchecked
    return f"{s['compared'] - s['mismatches']}/{s['compared']}"


def _seed_note(eq: dict[str, Any]) -> str:
    """At T>0 only seed-exact methods are compared: say so beside the count."""
    if not eq.get("temperature"):
        return ""
    return f" (sampled at T={eq['temperature']:g} with the same seed: the seed-exact methods)"


def _method_table(by_method: dict[str, dict[str, Any]]) -> list[str]:
    lines = [
        "| method | prompts | new tokens | tok/s | decode tok/s | TPOT ms | TTFT ms | speedup vs ar | "
        "speedup vs hf | τ | equal to ar |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for method, s in by_method.items():
        equal = _equal_cell(method, s, "reference", "not compared (sampled)")
        equal += " **MISMATCH**" if method != REFERENCE and s["mismatches"] else ""
        lines.append(
            f"| {method} | {s['samples']} | {s['new_tokens']} | {_fmt(s['tokens_per_s'], '.1f')} | "
            f"{_fmt(s['decode_tokens_per_s'], '.1f')} | {_fmt(s['tpot_s'], '.1f', 1000)} | "
            f"{_fmt(s['ttft_s'], '.1f', 1000)} | {_fmt(s['speedup_vs_ar'], '.2f', suffix='×')} | "
            f"{_fmt(s['speedup_vs_hf'], '.2f', suffix='×')} | {_fmt(s['tau'])} | {equal} |"
        )
    return lines


def _acceptance_tables(group: str, s: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    hist = s.get("acceptance_histogram")
    if hist and sum(hist):
        total = sum(hist)
        keys = list(range(1, len(hist)))
        lines += [
            f"τ histogram ({group}, {total} decode steps; share of steps emitting n tokens):",
            "",
            "| n | " + " | ".join(str(k) for k in keys) + " |",
            "|---|" + "---|" * len(keys),
            "| share | " + " | ".join(f"{hist[k] / total * 100:.1f}%" for k in keys) + " |",
            "",
        ]
    verify = s.get("verify_length_histogram")
    if verify:
        total = sum(verify.values())
        keys = sorted(verify, key=int)
        lines += [
            f"Verify lengths ({group}, {total} steps; share of steps verifying n proposals, 0 = a plain step):",
            "",
            "| n | " + " | ".join(keys) + " |",
            "|---|" + "---|" * len(keys),
            "| share | " + " | ".join(f"{verify[k] / total * 100:.1f}%" for k in keys) + " |",
            "",
        ]
    slots = s.get("slot_acceptance")
    if slots:
        lines += [
            f"Per-slot acceptance ({group}): P(slot k accepted | slots < k accepted), and vLLM-style "
            "P(slot k accepted):",
            "",
            "| slot | " + " | ".join(str(x["slot"]) for x in slots) + " |",
            "|---|" + "---|" * len(slots),
            "| conditional | " + " | ".join(_fmt(x["rate"], ".0%") for x in slots) + " |",
            "| unconditional | " + " | ".join(_fmt(x["unconditional_rate"], ".0%") for x in slots) + " |",
            "| reached | " + " | ".join(str(x["reached"]) for x in slots) + " |",
            "",
        ]
    return lines


def _machine_lines(machine: dict[str, Any]) -> list[str]:
    cores = f"{machine.get('logical_cores')} logical cores"
    if machine.get("affinity_cores") and machine.get("affinity_cores") != machine.get("logical_cores"):
        cores += f" ({machine['affinity_cores']} usable)"
    lines = [
        f"- machine: {machine.get('cpu')}, {cores}, torch threads {machine.get('torch_threads')}"
        + (f", GPU {machine['gpu']}" if machine.get("gpu") else ""),
        f"- software: python {machine.get('python')}, torch {machine.get('torch')}, transformers "
        f"{machine.get('transformers')}, flashdraft {machine.get('flashdraft')} ({machine.get('platform')})",
    ]
    if machine.get("device"):
        dtype_note = ""
        if machine.get("dtype") not in (None, "float32"):
            dtype_note = (
                " (below float32, a batched verify and a one-token step round differently: near-ties can flip, so "
                "outputs may differ from ar; the mismatch count below says how often)"
            )
        quantized = machine.get("quantize")
        weights = f", weights {quantized} (every method runs the same quantized target)" if quantized else ""
        lines.append(
            f"- device / dtype: {machine.get('device')} / {machine.get('dtype')}{weights}{dtype_note}"
        )
    if machine.get("load_average_end"):
        start = machine.get("load_average_start")
        lines.append(
            "- load average (1 min): "
            + (f"{start[0]:.2f} at the start, " if start else "")
            + f"{machine['load_average_end'][0]:.2f} at the end"
        )
    return lines


def _cost_model_lines(settings: dict[str, Any]) -> list[str]:
    """What method dflash's cost-aware policy worked from (measured on this machine before the run)."""
    if not settings.get("cost_model"):
        return [f"- dflash verify length: fixed, {settings.get('verify')}"] if settings.get("verify") else []
    from ..engine.costs import CostModel

    model = settings["cost_model"]
    if "summary" in model:  # a price list of its own kind (the MLX backend's): it says itself what it is
        return ["- dflash verify length: auto; " + model["summary"]]
    return ["- dflash verify length: auto; " + CostModel.from_dict(model).summary()]


def render_report(results: dict[str, Any]) -> str:
    s = results["settings"]
    eq = results["equality"]
    lines = ["# flashdraft bench", ""]
    if results.get("command"):
        lines += [f"- command: `{results['command']}`"]
    drafter = results.get("drafter") or {}
    untrained = (drafter.get("flashdraft") or {}).get("trained") is False
    lines += [
        f"- target: `{s['target']}`"
        + (f", drafter: `{s['draft']}` (block size {s['block_size']})" if s.get("draft") else "")
        + (f", assistant (sd): `{s['assistant']}`" if s.get("assistant") else ""),
        f"- methods: {', '.join(s['methods'])}; max_new_tokens {s['max_new_tokens']}, temperature "
        f"{s['temperature']:g}, seed {s['seed']}, chat template {'on' if s['chat_template'] else 'off'}"
        + (
            ""
            if s.get("enable_thinking") is None
            else f", thinking {'on' if s['enable_thinking'] else 'off'}"
        ),
        *_machine_lines(results["machine"]),
        *_cost_model_lines(s),
        "- datasets: "
        + "; ".join(
            f"{d['name']} ({d['conversations']} of {d['records']} records, {d['turns']} turns)"
            for d in results["datasets"]
        ),
        f"- run: {results['started']} → {results['finished']}"
        + (" (INTERRUPTED)" if results["interrupted"] else ""),
        "",
        "TPOT = decode time per token after the first emitted chunk (mean over prompts); speedup = mean TPOT of "
        "the baseline / mean TPOT of the method (decode only); tok/s = all new tokens / (TTFT + decode); "
        "τ = tokens per target forward in the decode phase (bonus included). One warm-up prompt per method is "
        "excluded.",
        "",
    ]
    if untrained:
        lines += [
            "> **The drafter is untrained**: τ ≈ 1 and DFlash only adds cost. Development run only.",
            "",
        ]
    for group, by_method in results["summary"].items():
        lines += [f"## {group}", "", *_method_table(by_method), ""]
        for method, summary in by_method.items():
            if summary.get("slot_acceptance"):
                lines += _acceptance_tables(f"{group}, {method}", summary)
    if results.get("stalls"):
        lines += [
            "## Stalled steps",
            "",
            f"{len(results['stalls'])} turn(s) had a decode step at least {STALL_RATIO:g}x their median step and "
            f"{STALL_MIN_S:g} s or longer: a compile (or a CUDA graph recorded) inside the answer. Their tok/s "
            "above include it.",
            "",
            "| dataset | prompt | turn | method | step | took s | median step ms | turn's decode s |",
            "|---|---|---|---|---|---|---|---|",
            *(
                f"| {x['dataset']} | {x['conversation_id']} | {x['turn']} | {x['method']} | {x['slowest_step']} | "
                f"{x['slowest_step_s']:.2f} | {1000 * x['median_step_s']:.1f} | {x['decode_s']:.2f} |"
                for x in results["stalls"]
            ),
            "",
        ]
    lines += ["## Output equality", ""]
    if not eq["checked"]:
        lines += ["Not checked: temperature > 0 and no seed-exact method (outputs are samples).", ""]
    elif eq["mismatches"] == 0:
        lines += [
            f"All {eq['compared']} outputs are token-for-token identical to `{eq['reference']}`{_seed_note(eq)}.",
            "",
        ]
    else:
        lines += [
            f"**{eq['mismatches']} of {eq['compared']} outputs differ from `{eq['reference']}`** "
            "(transformers assisted generation in fp32 can legitimately differ on near-ties; listed, never hidden).",
            "",
            *_verdict_lines(eq),
            "| dataset | prompt | turn | method | first differing token | ar text there | method text there | "
            "plain margin | step vs batched | verdict |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for m in eq["details"]:
            ref_text = json.dumps(m["reference_text"], ensure_ascii=False)[1:-1].replace("|", "\\|")
            out_text = json.dumps(m["method_text"], ensure_ascii=False)[1:-1].replace("|", "\\|")
            margins = (
                f"{m['plain_margin']:.4g} | {m['path_difference']:.4g} | {m['verdict']}"
                if "verdict" in m
                else "— | — | —"
            )
            lines.append(
                f"| {m['dataset']} | {m['conversation_id']} | {m['turn']} | {m['method']} | "
                f"{m['first_mismatch']} | `{ref_text}` | `{out_text}` | {margins} |"
            )
        lines.append("")
    if results.get("skipped"):
        lines += ["## Skipped", ""]
        lines += [
            f"- {x['dataset']} {x['conversation_id']} turn {x['turn']}: {x['reason']}"
            for x in results["skipped"]
        ]
        lines.append("")
    return "\n".join(lines)


def write_results(
    results: dict[str, Any], out_dir: Path, records: Sequence[SampleRecord] | None = None, plots: bool = True
) -> list[Path]:
    """results.json, report.md and the PNG plots; returns the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if records is not None:  # --save-outputs: texts and ids next to the numbers
        results = {**results, "samples": [r.to_dict(with_outputs=True) for r in records]}
    _write_json(out_dir / "results.json", results)
    (out_dir / "report.md").write_text(render_report(results), encoding="utf-8")
    written = [out_dir / "results.json", out_dir / "report.md"]
    if plots:
        written += plot_local(results, out_dir)
    return written


def render_server_report(results: dict[str, Any]) -> str:
    s = results["settings"]
    lines = ["# flashdraft bench (OpenAI-compatible server)", ""]
    if results.get("command"):
        lines.append(f"- command: `{results['command']}`")
    lines += [
        f"- server: {s['base_url']} model `{s['model']}`, endpoint {s['endpoint']} "
        f"({'streaming' if s['stream'] else 'not streaming'})",
        f"- max_new_tokens {s['max_new_tokens']}, temperature {s['temperature']:g}, concurrency "
        f"{', '.join(map(str, s['concurrency']))}",
        *[x.replace("- machine:", "- client machine:") for x in _machine_lines(results["client_machine"])],
        "- datasets: "
        + "; ".join(
            f"{d['name']} ({d['conversations']} conversations, {d['turns']} requests)"
            for d in results["datasets"]
        ),
        f"- run: {results['started']} → {results['finished']}",
        "",
        "Throughput = output tokens of successful requests / wall time of the level. Latency is per request "
        "(end to end); TTFT and TPOT need streaming. Acceptance: SGLang `meta_info` per request, vLLM "
        "`spec_decode` counters scraped from /metrics before and after each level.",
        "",
        "| dataset | concurrency | ok / requests | output tok/s | req/s | latency p50 / p90 / p99 s | "
        "TTFT p50 ms | TPOT mean ms | τ (server) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for lv in results["levels"]:
        lat = lv["latency_s"] or {}
        tau = None
        if lv.get("vllm"):
            tau = lv["vllm"]["tau"]
        elif lv.get("sglang"):
            tau = lv["sglang"]["mean_spec_accept_length"] or lv["sglang"]["tau_from_verify_ct"]
        lines.append(
            f"| {lv['dataset']} | {lv['concurrency']} | {lv['ok']} / {lv['requests']} | "
            f"{_fmt(lv['output_tokens_per_s'], '.1f')}{'*' if lv['tokens_estimated'] else ''} | "
            f"{_fmt(lv['requests_per_s'], '.2f')} | {_fmt(lat.get('p50'))} / {_fmt(lat.get('p90'))} / "
            f"{_fmt(lat.get('p99'))} | {_fmt((lv['ttft_s'] or {}).get('p50'), '.0f', 1000)} | "
            f"{_fmt((lv['tpot_s'] or {}).get('mean'), '.1f', 1000)} | {_fmt(tau)} |"
        )
    lines.append("")
    if any(lv["tokens_estimated"] for lv in results["levels"]):
        lines += ["\\* output tokens counted from streamed chunks (the server sent no usage).", ""]
    vllm_levels = [lv for lv in results["levels"] if lv.get("vllm")]
    if vllm_levels:
        lines += ["## vLLM spec_decode counters", ""]
        for lv in vllm_levels:
            v = lv["vllm"]
            lines.append(
                f"- {lv['dataset']} @ {lv['concurrency']}: {v['num_drafts']:.0f} drafts, {v['num_draft_tokens']:.0f} "
                f"draft tokens, {v['num_accepted_tokens']:.0f} accepted; τ {v['tau']:.2f}, acceptance rate "
                f"{_fmt(v['draft_acceptance_rate'], '.1%')}; per position "
                + ", ".join(_fmt(r, ".0%") for r in v["per_position_rate"])
            )
        lines.append("")
    grammar_levels = [lv for lv in results["levels"] if lv.get("grammar_share") is not None]
    # a flashdraft server: its decode and grammar seconds, scraped before and after each level
    if grammar_levels:
        lines += ["## The grammar's share of the server's decode steps", ""]
        lines += [
            f"- {lv['dataset']} @ {lv['concurrency']}: {_fmt(lv['grammar_share'], '.1%')}"
            for lv in grammar_levels
        ]
        lines.append("")
    errors = [(lv, msg) for lv in results["levels"] for msg in lv["error_messages"]]
    if errors or results.get("warmup_error"):
        lines += ["## Errors", ""]
        if results.get("warmup_error"):
            lines.append(f"- warm-up request: {results['warmup_error']}")
        lines += [
            f"- {lv['dataset']} @ {lv['concurrency']} ({lv['errors']} failed): {msg}" for lv, msg in errors
        ]
        lines.append("")
    return "\n".join(lines)


def write_server_results(results: dict[str, Any], out_dir: Path, plots: bool = True) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_json(out_dir / "results.json", results)
    (out_dir / "report.md").write_text(render_server_report(results), encoding="utf-8")
    written = [out_dir / "results.json", out_dir / "report.md"]
    if plots:
        written += plot_server(results, out_dir)
    return written


README_START = "<!-- flashdraft-bench:start -->"


README_END = "<!-- flashdraft-bench:end -->"


def render_readme_section(results: dict[str, Any], readme_dir: Path) -> str:
    """The block `--readme` writes between the markers: one table over datasets and methods, from results."""
    s = results["settings"]
    eq = results["equality"]
    out_dir = Path(results["out_dir"])
    try:
        rel = out_dir.resolve().relative_to(readme_dir.resolve()).as_posix()
    except ValueError:
        rel = out_dir.as_posix()
    lines = [
        README_START,
        "<!-- written by `flashdraft bench --readme`; do not edit by hand: rerun the command below -->",
        "",
        f"Command: `{results['command']}`" if results.get("command") else "",
        "",
        f"Target `{s['target']}`"
        + (f", drafter `{s['draft']}` (block size {s['block_size']})" if s.get("draft") else "")
        + (f", assistant `{s['assistant']}`" if s.get("assistant") else "")
        + f"; max_new_tokens {s['max_new_tokens']}, temperature {s['temperature']:g}; run {results['finished']}.",
        "",
        *_machine_lines(results["machine"]),
        *_cost_model_lines(s),
        "",
        "| dataset | method | prompts | tok/s | TPOT ms | TTFT ms | speedup vs ar | speedup vs hf | τ | equal to ar |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for group, by_method in results["summary"].items():
        for row in _method_table(by_method)[2:]:
            cells = row.strip("|").split("|")
            # method table columns: method, prompts, new tokens, tok/s, decode tok/s, TPOT, TTFT, vs ar, vs hf, τ, equal
            keep = [cells[0], cells[1], cells[3], cells[5], cells[6], cells[7], cells[8], cells[9], cells[10]]
            lines.append(f"| {group} |" + "|".join(keep) + "|")
    verify_lines = []
    for group, by_method in results["summary"].items():
        hist = (by_method.get("dflash") or {}).get("verify_length_histogram")
        if hist and s.get("cost_model"):
            total = sum(hist.values())
            shares = ", ".join(
                f"{n}: {c / total * 100:.0f}%" for n, c in sorted(hist.items(), key=lambda x: int(x[0]))
            )
            verify_lines.append(f"- {group}: {shares}")
    if verify_lines:
        lines += [
            "",
            "Verify lengths chosen by dflash (share of steps verifying n proposals; 0 = a plain step):",
            "",
        ]
        lines += verify_lines
    lines += [
        "",
        (
            f"Output equality: {eq['compared'] - eq['mismatches']} of {eq['compared']} outputs identical to ar"
            f"{_seed_note(eq)}."
            if eq["checked"]
            else "Output equality not checked (temperature > 0)."
        ),
        "",
        f"Full report: [{rel}/report.md]({rel}/report.md) (τ histograms, per-slot acceptance, mismatches), raw "
        f"numbers: [{rel}/results.json]({rel}/results.json).",
        "",
    ]
    for png in ("speedup.png", "tau_histogram.png", "slot_acceptance.png"):
        if (out_dir / png).exists():
            lines.append(f"![{png[:-4]}]({rel}/{png})")
    lines += ["", README_END]
    return "\n".join(lines)


def check_readme(readme: Path) -> None:
    try:
        text = readme.read_text(encoding="utf-8")
    except OSError as e:
        raise BenchError(f"cannot read {readme}: {e}") from None
    if README_START not in text or README_END not in text:
        raise BenchError(f"{readme} has no {README_START} ... {README_END} block to write the table into")


def update_readme(readme: Path, results: dict[str, Any]) -> None:
    """Replace the marked block of `readme` with the tables of `results`."""
    check_readme(readme)
    text = readme.read_text(encoding="utf-8")
    head, rest = text.split(README_START, 1)
    _, tail = rest.split(README_END, 1)
    readme.write_text(head + render_readme_section(results, readme.parent) + tail, encoding="utf-8")


def print_summary(results: dict[str, Any]) -> None:
    out = Console()
    if results.get("kind") == "flashdraft-bench-server":
        table = Table(title=f"server {results['settings']['model']}")
        for col in ("dataset", "conc.", "ok", "tok/s", "p50 s", "p99 s", "TTFT p50 ms", "τ"):
            table.add_column(col)
        for lv in results["levels"]:
            tau = (lv.get("vllm") or {}).get("tau") or (lv.get("sglang") or {}).get("mean_spec_accept_length")
            table.add_row(
                lv["dataset"], str(lv["concurrency"]), f"{lv['ok']}/{lv['requests']}",
                _fmt(lv["output_tokens_per_s"], ".1f"), _fmt((lv["latency_s"] or {}).get("p50")),
                _fmt((lv["latency_s"] or {}).get("p99")), _fmt((lv["ttft_s"] or {}).get("p50"), ".0f", 1000),
                _fmt(tau),
            )  # fmt: skip
        out.print(table)
        errors = sum(lv["errors"] for lv in results["levels"])
        if errors:
            out.print(f"[yellow]{errors} request(s) failed; see report.md[/]")
    else:
        for group, by_method in results["summary"].items():
            table = Table(title=group)
            for col in ("method", "tok/s", "TPOT ms", "TTFT ms", "vs ar", "vs hf", "τ", "= ar"):
                table.add_column(col)
            for method, s in by_method.items():
                equal = _equal_cell(method, s, "ref", "—")
                table.add_row(
                    method, _fmt(s["tokens_per_s"], ".1f"), _fmt(s["tpot_s"], ".1f", 1000),
                    _fmt(s["ttft_s"], ".1f", 1000), _fmt(s["speedup_vs_ar"], suffix="×"),
                    _fmt(s["speedup_vs_hf"], suffix="×"), _fmt(s["tau"]),
                    equal if not s["mismatches"] else f"[bold red]{equal}[/]",
                )  # fmt: skip
            out.print(table)
        eq = results["equality"]
        if eq["checked"] and eq["mismatches"]:
            near, tested = _verdicts(eq)
            why = f" ({near} of {tested} near-ties, {tested - near} unexplained)" if tested else ""
            out.print(f"[bold red]{eq['mismatches']} output(s) differ from ar[/]{why}; see report.md")
        elif eq["checked"]:
            out.print(f"all {eq['compared']} outputs identical to ar{_seed_note(eq)}")
        for x in results.get("stalls", [])[:3]:
            out.print(
                f"[yellow]stalled step[/] {x['dataset']} {x['conversation_id']}/{x['turn']} {x['method']}: step "
                f"{x['slowest_step']} took {x['slowest_step_s']:.2f} s (median {1000 * x['median_step_s']:.1f} ms): a "
                "compile inside the answer?"
            )
    out.print(f"results in {results['out_dir']}")

"""PNG plots of benchmark results (matplotlib, when installed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .config import HF_BASELINE, REFERENCE, console


def pyplot() -> Any | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        console.print("[yellow]matplotlib is not installed: no plots (pip install 'flashdraft[bench]')[/]")
        return None
    return plt


def save_figure(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return path


def plot_local(results: dict[str, Any], out_dir: Path) -> list[Path]:
    plt = pyplot()
    if plt is None:
        return []
    from matplotlib.ticker import MaxNLocator

    written = []
    datasets = [d["name"] for d in results["datasets"]]
    summary = results["summary"]
    spec_methods = [m for m in results["settings"]["methods"] if m not in (REFERENCE, HF_BASELINE)]

    # τ histogram of every speculative method, one panel per method, one bar group per dataset.
    hist_methods = [
        m for m in spec_methods if any(summary[d].get(m, {}).get("acceptance_histogram") for d in datasets)
    ]
    if hist_methods:
        fig, axes = plt.subplots(1, len(hist_methods), figsize=(5.5 * len(hist_methods), 3.8), squeeze=False)
        for ax, method in zip(axes[0], hist_methods, strict=True):
            width = 0.8 / len(datasets)
            for i, d in enumerate(datasets):
                hist = summary[d].get(method, {}).get("acceptance_histogram") or []
                total = sum(hist)
                if not total:
                    continue
                xs = list(range(1, len(hist)))
                ax.bar([x + (i - (len(datasets) - 1) / 2) * width for x in xs],
                       [hist[x] / total for x in xs], width=width, label=d)  # fmt: skip
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_title(f"{method}: tokens per decode step (τ)")
            ax.set_xlabel("tokens emitted per target forward")
            ax.set_ylabel("share of steps")
            ax.legend(fontsize=8)
        written.append(save_figure(fig, out_dir / "tau_histogram.png"))

    # Per-slot acceptance of the DFlash drafter: conditional (solid) and vLLM-style unconditional (dashed). A fixed
    # verify length shows the drafter itself; the cost-aware policy's verified slots are a selection.
    slot_method = next(
        (
            m
            for m in ("dflash-fixed", "dflash")
            if any(summary[d].get(m, {}).get("slot_acceptance") for d in datasets)
        ),
        None,
    )
    if slot_method:
        fig, ax = plt.subplots(figsize=(6.5, 3.8))
        num_slots = 1
        for d in datasets:
            slots = summary[d].get(slot_method, {}).get("slot_acceptance") or []
            if not slots:
                continue
            num_slots = max(num_slots, len(slots))
            ks = [x["slot"] for x in slots]
            conditional = [x["rate"] if x["rate"] is not None else float("nan") for x in slots]
            (line,) = ax.plot(ks, conditional, marker="o", label=f"{d}: given slots < k accepted")
            unconditional = [x["unconditional_rate"] or 0.0 for x in slots]
            ax.plot(ks, unconditional, linestyle="--", color=line.get_color(), label=f"{d}: unconditional")
        ax.set_xticks(range(1, num_slots + 1))
        ax.set_xlim(0.5, num_slots + 0.5)
        ax.set_title(f"{slot_method}: per-slot acceptance rate")
        ax.set_xlabel("draft slot k")
        ax.set_ylabel("acceptance rate")
        ax.set_ylim(0, 1.05)
        ax.legend(fontsize=8)
        written.append(save_figure(fig, out_dir / "slot_acceptance.png"))

    # Speedup bars per dataset and method, vs ar and vs hf.
    groups = list(summary)
    methods = [m for m in results["settings"]["methods"] if m != REFERENCE]
    baselines = [b for b in (REFERENCE, HF_BASELINE) if any(b in summary[g] for g in groups)]
    if methods and groups:
        fig, axes = plt.subplots(1, len(baselines), figsize=(6.5 * len(baselines), 4), squeeze=False)
        for ax, baseline in zip(axes[0], baselines, strict=True):
            width = 0.8 / len(methods)
            for i, m in enumerate(methods):
                values = [summary[g].get(m, {}).get(f"speedup_vs_{baseline}") or 0.0 for g in groups]
                ax.bar([g + (i - (len(methods) - 1) / 2) * width for g in range(len(groups))], values,
                       width=width, label=m)  # fmt: skip
            ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
            ax.set_xticks(range(len(groups)))
            ax.set_xticklabels(groups)
            ax.set_ylabel(f"decode speedup vs {baseline} (TPOT ratio)")
            ax.set_title(f"speedup over {baseline}")
            ax.legend(fontsize=8)
        written.append(save_figure(fig, out_dir / "speedup.png"))
    return written


def plot_server(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """Output tokens/s against concurrency, one line per dataset."""
    plt = pyplot()
    if plt is None or not results["levels"]:
        return []
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for name in dict.fromkeys(lv["dataset"] for lv in results["levels"]):
        pts = [
            (lv["concurrency"], lv["output_tokens_per_s"] or 0.0)
            for lv in results["levels"]
            if lv["dataset"] == name
        ]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_xlabel("concurrency")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"{results['settings']['model']}: throughput")
    ax.legend(fontsize=8)
    return [save_figure(fig, out_dir / "server_throughput.png")]

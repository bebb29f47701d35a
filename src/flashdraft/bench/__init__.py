"""`flashdraft bench`: acceptance length τ and speedup, measured side by side on the same machine.

    config.py      methods, settings and their checks, the machine record
    metrics.py     τ, histograms, per-slot acceptance, TPOT, speedups
    local.py       the local backend (every method in this process)
    llamacpp.py    llama.cpp's llama-server on the same weights (a GGUF), a baseline beside the local methods
    server.py      the OpenAI backend (any OpenAI-compatible server) and prometheus.py, its metrics reader
    report.py      results.json, report.md, the README block, the terminal summary; plots.py, the PNGs

Local backend (`--backend local`, the default): every method runs in this process on the same prompts, interleaved
prompt by prompt (and in a rotating order) so that machine drift hits all of them alike.

    ar      our plain decode loop (generate_ar): the reference every other output is compared with at T=0
    hf      transformers `generate`: what users run without speculation
    dflash  our DFlash engine (generate with the drafter)
    sd      transformers assisted generation with a small draft model sharing the target's tokenizer
    pld     transformers prompt-lookup decoding (`prompt_lookup_num_tokens`)
    llamacpp, llamacpp-lookup, llamacpp-dflash
            llama.cpp's plain decoding, prompt lookup and DFlash, one llama-server each (llamacpp.py); timed with the
            server's own clocks, outputs not compared (another engine on another weight format)

Timing. Every method reports the time to its first emitted token(s) (TTFT) and the time after it (the decode
phase). For our engine TTFT is prefill + first token (`GenerationResult.prefill_s`). For transformers methods a
streamer timestamps the first chunk `generate` emits after the prompt (one token for `hf`; for `sd`/`pld` the first
verify step, which transformers fuses with prefill). TPOT = decode time / tokens emitted after the first chunk,
averaged over prompts; the headline speedup is z-lab's: mean TPOT of the baseline / mean TPOT of the method
(decode only). tokens/s counts every new token over TTFT + decode (end to end). One warm-up prompt per method runs
before measuring and is excluded.

τ (mean acceptance length) = tokens emitted per target forward in the decode phase, bonus token included (1.0 for
plain decoding). For sd/pld it is the mean size of the chunks transformers streams (one per target forward). The
per-slot acceptance rate of slot k is P(draft k accepted | drafts 1..k-1 accepted), from the per-step logs
`draft_lengths` / `accepted_drafts` of the engine.

OpenAI backend (`--backend openai`): the same prompts sent to any OpenAI-compatible server (vLLM, SGLang, ...) at
each `--concurrency` level; throughput, latency percentiles, TTFT when streaming, and the server's own acceptance
figures when it exposes them (SGLang `meta_info`, vLLM Prometheus `spec_decode` counters before/after each level).
"""

from .config import (
    DFLASH_METHODS,
    HF_BASELINE,
    METHODS,
    REFERENCE,
    BenchConfig,
    BenchError,
    ServerBenchConfig,
    machine_info,
    parse_concurrency,
    parse_methods,
    split_datasets,
    validate_config,
)
from .local import LocalMethods, RunOutput, run_bench
from .metrics import (
    SampleRecord,
    acceptance_histogram,
    add_speedups,
    first_difference,
    mean_acceptance_length,
    per_slot_acceptance,
    percentile,
    speedup,
    summarize_records,
    time_per_output_token,
)
from .prometheus import parse_prometheus, vllm_spec_stats
from .report import (
    README_END,
    README_START,
    check_readme,
    print_summary,
    render_readme_section,
    render_report,
    render_server_report,
    update_readme,
    write_results,
    write_server_results,
)
from .server import ServerRequest, run_server_bench, summarize_server_level

__all__ = [
    "DFLASH_METHODS",
    "HF_BASELINE",
    "METHODS",
    "README_END",
    "README_START",
    "REFERENCE",
    "BenchConfig",
    "BenchError",
    "LocalMethods",
    "RunOutput",
    "SampleRecord",
    "ServerBenchConfig",
    "ServerRequest",
    "acceptance_histogram",
    "add_speedups",
    "check_readme",
    "first_difference",
    "machine_info",
    "mean_acceptance_length",
    "parse_concurrency",
    "parse_methods",
    "parse_prometheus",
    "per_slot_acceptance",
    "percentile",
    "print_summary",
    "render_readme_section",
    "render_report",
    "render_server_report",
    "run_bench",
    "run_server_bench",
    "speedup",
    "split_datasets",
    "summarize_records",
    "summarize_server_level",
    "time_per_output_token",
    "update_readme",
    "validate_config",
    "vllm_spec_stats",
    "write_results",
    "write_server_results",
]

"""The local backend: every method in this process on the same prompts, interleaved prompt by prompt."""

from __future__ import annotations

import os
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from ..engine.tool_calls import (
    ToolChoice,
    ToolError,
    encode_tool_prompt,
    parse_tool_choice,
    parse_tools,
    tool_constraint,
)
from ..progress import busy_machine_warning
from ..prompts.benchmarks import BenchDataset
from ..targets.multimodal import ImagePrompt, encode_image_prompt
from .config import (
    DFLASH_METHODS,
    LLAMACPP_METHODS,
    REFERENCE,
    SEED_EXACT_METHODS,
    BenchConfig,
    BenchError,
    console,
    dataset_info,
    default_out_dir,
    drafter_record,
    load_datasets,
    machine_info,
    progress_display,
    validate_config,
)
from .metrics import RunOutput, SampleRecord, add_speedups, first_difference, stalls, summarize_records
from .mismatches import mismatch_entry, verdict_counts, weigh_flips
from .report import write_results


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _ChunkTimer:
    """A transformers streamer (duck-typed: put/end) that timestamps the first emitted chunk and records every
    chunk's size. generate() first puts the prompt, then one chunk per target forward (1 token for greedy, the accepted
    tokens + 1 for assisted / prompt-lookup decoding).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.prompt_seen = False
        self.first_at: float | None = None
        self.chunks: list[int] = []

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        if self.first_at is None:
            _sync(self.device)
            self.first_at = time.perf_counter()
        self.chunks.append(int(value.numel()))

    def end(self) -> None:
        pass


class LocalMethods:
    """Loads the models once and runs any method on a prompt."""

    def __init__(self, cfg: BenchConfig, out_dir: Path | None = None, images: bool = False) -> None:
        """`images`: a dataset has image records (an image-text target is loaded whole, multimodal.py)."""
        from ..pipeline import load_pipeline
        from ..targets.target import load_target

        self.cfg = cfg
        wants_draft = any(m in DFLASH_METHODS for m in cfg.methods)
        pipeline = load_pipeline(
            cfg.target,
            cfg.draft if wants_draft else None,
            dtype=cfg.dtype,
            device=cfg.device,
            quantize=cfg.quantize,
            images=images or None,
            compile=cfg.compile_verify,
            draft_vocab=cfg.draft_vocab,
        )
        self.target = pipeline.target
        self.compile_note = pipeline.compile_note
        self.device = self.target.device
        self.stop_ids = self.target.eos_token_ids
        tok = self.target.tokenizer
        pad = getattr(tok, "pad_token_id", None) if tok is not None else None
        self.pad_id = pad if pad is not None else (self.stop_ids[0] if self.stop_ids else 0)
        self.draft = pipeline.drafter
        self.block_size: int | None = (
            None  # the drafter's trained block (histogram bins, fixed verify length)
        )
        self.verify: int | str = "auto"  # what method dflash verifies: "auto" or a fixed block size
        self.cost_model = None
        if self.draft is not None:
            self.block_size = self.draft.config.block_size
            self.verify = cfg.block_size or "auto"
            if cfg.block_size and cfg.block_size > self.block_size:
                raise BenchError(
                    f"--block-size {cfg.block_size} exceeds the drafter's block size {self.block_size}"
                )
            if self.verify == "auto" and {"dflash", "dflash-pq", "dflash-tree"} & set(cfg.methods):
                self.cost_model = pipeline.measure_costs(log=lambda m: console.print(m, soft_wrap=True))
                console.print(self.cost_model.summary(), soft_wrap=True)
        self.assistant = None
        if "sd" in cfg.methods:
            self.assistant = load_target(cfg.assistant, dtype=self.target.dtype, device=self.device)
            other = self.assistant.tokenizer
            if tok is not None and other is not None and tok.get_vocab() != other.get_vocab():
                raise BenchError(
                    f"assistant {cfg.assistant!r} does not share the tokenizer of {cfg.target!r}: sd needs a "
                    "draft model of the same family"
                )
        self.llamacpp = None
        llama = [m for m in cfg.methods if m in LLAMACPP_METHODS]
        if llama:
            from .llamacpp import LlamaCppMethods

            logs = (out_dir or Path(".")) / "llamacpp"
            console.print(f"starting llama.cpp for {', '.join(llama)} (logs in {logs})")
            self.llamacpp = LlamaCppMethods(cfg, llama, logs)

    def close(self) -> None:
        """Stop what runs beside this process (llama.cpp's servers)."""
        if self.llamacpp is not None:
            self.llamacpp.close()

    @property
    def drafter_info(self) -> dict[str, Any] | None:
        if self.draft is None:
            return None
        from ..drafter.vocab import drafter_vocabulary

        vocab = drafter_vocabulary(self.draft, self.target, self.target.vocab_size)
        count = None if vocab is None else vocab.numel()
        return drafter_record(self.cfg.draft, self.draft.config, self.draft.num_parameters(), count)

    def hf_generation_settings(self) -> dict[str, Any]:
        """The transformers settings that decide what sd/pld do (recorded in results.json)."""
        settings: dict[str, Any] = {"prompt_lookup_num_tokens": self.cfg.pld_tokens}
        if self.assistant is not None:
            gen = self.assistant.model.generation_config
            defaults = (
                gen._get_default_generation_params() if hasattr(gen, "_get_default_generation_params") else {}
            )
            for key in (
                "num_assistant_tokens",
                "num_assistant_tokens_schedule",
                "assistant_confidence_threshold",
            ):
                value = getattr(gen, key, None)
                settings[key] = value if value is not None else defaults.get(key)
        return settings

    def run(
        self,
        method: str,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        seed: int,
        response_format: Any = None,
    ) -> RunOutput:
        if method in ("ar", *DFLASH_METHODS):
            return self._run_engine(method, input_ids, max_new_tokens, seed, response_format)
        if isinstance(
            input_ids, ImagePrompt
        ):  # image prompts: the engine's methods and transformers' generate
            if method != "hf":
                raise BenchError(f"method {method} cannot take image prompts")
            return self._run_transformers(input_ids.input_ids, max_new_tokens, seed, dict(input_ids.inputs))
        if method in LLAMACPP_METHODS:
            got = self.llamacpp.servers[method].complete(
                input_ids[0].tolist(), max_new_tokens, self.cfg.temperature, seed, self.stop_ids
            )
            return RunOutput(new_ids=got["new_ids"], ttft_s=got["ttft_s"], decode_s=got["decode_s"], first_chunk=1,
                             step_tokens=[], stop_reason=got["stop_reason"])  # fmt: skip
        extra: dict[str, Any] = {}
        if method == "sd":
            extra["assistant_model"] = self.assistant.model
        elif method == "pld":
            extra["prompt_lookup_num_tokens"] = self.cfg.pld_tokens
        return self._run_transformers(input_ids, max_new_tokens, seed, extra)

    def _run_engine(
        self, method: str, input_ids: torch.Tensor, max_new_tokens: int, seed: int, response_format: Any
    ) -> RunOutput:
        from ..generate import generate, generate_ar

        common = dict(
            max_new_tokens=max_new_tokens,
            temperature=self.cfg.temperature,
            seed=seed,
            response_format=response_format,
        )
        # each step's tokens reach the host (a synchronisation) before on_tokens: the times between calls are the
        # decode steps' (the first call ends the prefill)
        seen: list[float] = []
        common["on_tokens"] = lambda _ids: seen.append(time.perf_counter())
        if method in DFLASH_METHODS:
            verify = self.block_size if method == "dflash-fixed" else self.verify
            sampling = "pq" if method == "dflash-pq" else "match"
            tree = (self.cfg.tree or "auto") if method == "dflash-tree" else None
            res = generate(
                self.target, self.draft, input_ids, block_size=verify, costs=self.cost_model,
                draft_sampling=sampling, tree=tree, **common,
            )  # fmt: skip
        else:
            res = generate_ar(self.target, input_ids, **common)
        return RunOutput.of(res, method in DFLASH_METHODS, seen)

    def _run_transformers(
        self, input_ids: torch.Tensor, max_new_tokens: int, seed: int, extra: dict[str, Any]
    ) -> RunOutput:
        kwargs: dict[str, Any] = {
            "attention_mask": torch.ones_like(input_ids),
            "max_new_tokens": max_new_tokens,
            "eos_token_id": self.stop_ids or None,
            "pad_token_id": self.pad_id,
        }
        if self.cfg.temperature == 0:
            # None stops the model's generation_config from injecting sampling parameters.
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        else:
            kwargs.update(do_sample=True, temperature=self.cfg.temperature, top_p=1.0, top_k=0)
            torch.manual_seed(seed)
        timer = _ChunkTimer(self.device)
        _sync(self.device)
        t0 = time.perf_counter()
        out = self.target.model.generate(input_ids, streamer=timer, **kwargs, **extra)
        _sync(self.device)
        t_end = time.perf_counter()
        new_ids = out[0, input_ids.shape[1] :].tolist()
        stop_reason = "max_new_tokens"
        for i, tok in enumerate(new_ids):  # generate pads after a stop token in some modes; cut there
            if tok in self.stop_ids:
                new_ids = new_ids[: i + 1]
                stop_reason = "stop_token"
                break
        first_at = timer.first_at if timer.first_at is not None else t_end
        first_chunk = timer.chunks[0] if timer.chunks else len(new_ids)
        return RunOutput(
            new_ids=new_ids,
            ttft_s=first_at - t0,
            decode_s=t_end - first_at,
            first_chunk=min(first_chunk, len(new_ids)),
            step_tokens=timer.chunks[1:],  # decode-phase forwards, like the engine's acceptance lengths
            stop_reason=stop_reason,
        )


def conv_tools(conv: Any) -> tuple[list[dict[str, Any]], ToolChoice] | None:
    """A tool-call record's checked tools and tool choice (None for other records)."""
    if not conv.meta.get("tools"):
        return None
    tools = parse_tools(conv.meta["tools"])
    return tools, parse_tool_choice(conv.meta.get("tool_choice"), tools)


def run_bench(cfg: BenchConfig) -> dict[str, Any]:
    """Run the local benchmark and write results.json, report.md and plots to `cfg.out_dir`; return the results."""
    validate_config(cfg)
    from .llamacpp import check_config

    check_config(cfg)  # llama.cpp's GGUF files and server, where its methods run
    datasets = load_datasets(cfg.datasets, cfg.max_samples, cfg.seed)
    for ds in datasets:
        for conv in ds.conversations:
            try:
                conv_tools(conv)
            except ToolError as e:
                raise BenchError(f"{ds.name}, record {conv.id}: {e}") from None
    structured = [
        ds.name
        for ds in datasets
        if any(c.meta.get("response_format") or c.meta.get("tools") for c in ds.conversations)
    ]
    unconstrained = [m for m in cfg.methods if m not in ("ar", *DFLASH_METHODS)]
    if structured and unconstrained:
        raise BenchError(
            f"{', '.join(unconstrained)} cannot decode under a response_format ({', '.join(structured)} has "
            "structured-output records): run ar and the dflash methods on it"
        )
    with_images = [ds.name for ds in datasets if any(c.meta.get("images") for c in ds.conversations)]
    other = [m for m in cfg.methods if m not in ("ar", "hf", *DFLASH_METHODS)]
    if with_images and other:
        raise BenchError(
            f"{', '.join(other)} cannot take image prompts ({', '.join(with_images)} has image records): run ar, hf "
            "and the dflash methods on it"
        )
    previous_threads = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        return _run_local(cfg, datasets)
    finally:
        torch.set_num_threads(previous_threads)  # callers in the same process keep their setting


def _run_local(cfg: BenchConfig, datasets: list[BenchDataset]) -> dict[str, Any]:
    torch.manual_seed(cfg.seed)
    out_dir = Path(cfg.out_dir) if cfg.out_dir else default_out_dir(cfg.datasets)

    console.print(f"loading {cfg.target}" + (f" + drafter {cfg.draft}" if cfg.draft else ""))
    images = any(c.meta.get("images") for ds in datasets for c in ds.conversations)
    if cfg.engine == "mlx":
        from .mlx_methods import MlxMethods

        runner: Any = MlxMethods(cfg)
    else:
        runner = LocalMethods(cfg, out_dir, images)
    try:
        return _measure(cfg, datasets, runner, out_dir)
    finally:
        runner.close()


def _measure(
    cfg: BenchConfig, datasets: list[BenchDataset], runner: LocalMethods, out_dir: Path
) -> dict[str, Any]:
    target, tokenizer = runner.target, runner.target.tokenizer
    greedy = cfg.temperature == 0
    records: list[SampleRecord] = []
    mismatches: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    interrupted = False
    started = datetime.now(timezone.utc)
    load_at_start = [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None
    busy = busy_machine_warning(target.device.type, torch.get_num_threads())
    if busy:
        console.print(f"[yellow]warning:[/] {busy}")
    if runner.compile_note:
        console.print(f"[yellow]note:[/] {runner.compile_note}")

    def encode(messages: list[dict[str, str]], system: str | None, images: list[str] | None = None) -> Any:
        if images:  # an image set (image-text targets): the images go with the first user turn
            first = {"role": "user", "content": [*({"type": "image"} for _ in images),
                                                 {"type": "text", "text": messages[0]["content"]}]}  # fmt: skip
            kwargs = {} if cfg.thinking is None else {"enable_thinking": cfg.thinking}
            return encode_image_prompt(target, [first, *messages[1:]], images, system, kwargs)
        return target.encode_prompt(messages, chat=cfg.chat, enable_thinking=cfg.thinking, system=system)

    # no_grad as the engine and the cost measurement run: graphs made under one are no graphs for tensors made in
    # inference mode (dynamo guards on it), so inference mode here compiled every graph a second time
    with torch.no_grad():
        if cfg.warmup:
            # First-call overheads (allocator, kernels, lazy init) are paid here by every method, not measured;
            # a compiled verify takes a whole answer, so most of its graphs (one per verify shape) exist before.
            first = datasets[0].conversations[0]
            ids = encode(
                [{"role": "user", "content": first.user_turns[0]}], first.system, first.meta.get("images")
            )
            warm_tokens = cfg.max_new_tokens if target.plan.compiled else min(cfg.max_new_tokens, 16)
            for method in cfg.methods:
                runner.run(method, ids, warm_tokens, cfg.seed)

        total_turns = sum(ds.num_turns for ds in datasets)
        prompt_index = 0
        with progress_display(cfg.show_progress) as progress:
            task = progress.add_task("bench", total=total_turns)
            try:
                for ds in datasets:
                    progress.update(task, description=ds.name)
                    for conv in ds.conversations:
                        messages: list[dict[str, str]] = []
                        tools = conv_tools(conv)
                        for turn, user_text in enumerate(conv.user_turns):
                            messages.append({"role": "user", "content": user_text})
                            if tools is None:
                                ids = encode(messages, conv.system, conv.meta.get("images"))
                                fmt = conv.meta.get("response_format")
                            else:  # a tool-call record: the tools shown, `required` / named enforced
                                system = [{"role": "system", "content": conv.system}] if conv.system else []
                                ids = encode_tool_prompt(
                                    target, system + messages, tools[0], enable_thinking=cfg.thinking
                                )
                                fmt = tool_constraint(*tools)
                            if ids.shape[1] + cfg.max_new_tokens > target.max_context:
                                skipped.append(
                                    {"dataset": ds.name, "conversation_id": conv.id, "turn": turn,
                                     "reason": f"prompt of {ids.shape[1]} tokens + max_new_tokens exceeds the "
                                               f"context of {target.max_context}"}
                                )  # fmt: skip
                                progress.advance(task, len(conv.user_turns) - turn)
                                break
                            # Rotate the order so no method always runs first (cache warmth, thermal drift).
                            shift = prompt_index % len(cfg.methods)
                            order = cfg.methods[shift:] + cfg.methods[:shift]
                            seed = cfg.seed + prompt_index
                            outputs = {m: runner.run(m, ids, cfg.max_new_tokens, seed, fmt) for m in order}
                            ref = outputs[REFERENCE]
                            differing: list[tuple[SampleRecord, list[int]]] = []
                            for method in cfg.methods:
                                out = outputs[method]
                                rec = SampleRecord(
                                    dataset=ds.name,
                                    conversation_id=conv.id,
                                    turn=turn,
                                    method=method,
                                    prompt_tokens=int(ids.shape[1]),
                                    new_tokens=len(out.new_ids),
                                    ttft_s=out.ttft_s,
                                    decode_s=out.decode_s,
                                    decode_tokens=max(len(out.new_ids) - out.first_chunk, 0),
                                    step_tokens=out.step_tokens,
                                    draft_lengths=out.draft_lengths,
                                    accepted_drafts=out.accepted_drafts,
                                    stop_reason=out.stop_reason,
                                    grammar_s=out.grammar_s,
                                    step_s=out.step_s,
                                    output_ids=out.new_ids,
                                )
                                compared = method not in LLAMACPP_METHODS  # another engine, other weights
                                if (
                                    method != REFERENCE
                                    and compared
                                    and (greedy or method in SEED_EXACT_METHODS)
                                ):
                                    rec.first_mismatch = first_difference(ref.new_ids, out.new_ids)
                                    rec.matches_reference = rec.first_mismatch is None
                                    if not rec.matches_reference:
                                        differing.append((rec, out.new_ids))
                                if cfg.save_outputs and tokenizer is not None:
                                    rec.output_text = tokenizer.decode(out.new_ids, skip_special_tokens=True)
                                records.append(rec)
                            flips = (
                                weigh_flips(target, ids, ref.new_ids, differing, runner.block_size or 16)
                                if greedy and getattr(runner, "weighs_flips", True)
                                else [None] * len(differing)
                            )
                            mismatches += [
                                mismatch_entry(rec, ref.new_ids, method_ids, tokenizer, flip)
                                for (rec, method_ids), flip in zip(differing, flips, strict=True)
                            ]
                            # The next turn is conditioned on the target's own answer (z-lab's mt-bench protocol).
                            answer = (
                                tokenizer.decode(ref.new_ids, skip_special_tokens=True) if tokenizer else ""
                            )
                            messages.append({"role": "assistant", "content": answer})
                            prompt_index += 1
                            progress.advance(task)
            except KeyboardInterrupt:
                interrupted = True
                console.print("[yellow]interrupted: writing the results measured so far[/]")

    results = _local_results(cfg, runner, datasets, records, mismatches, skipped, started, interrupted)
    results["machine"]["load_average_start"] = load_at_start
    write_results(results, out_dir, records if cfg.save_outputs else None, plots=cfg.plots)
    results["out_dir"] = str(out_dir)
    return results


def _local_results(
    cfg: BenchConfig,
    runner: LocalMethods,
    datasets: list[BenchDataset],
    records: list[SampleRecord],
    mismatches: list[dict[str, Any]],
    skipped: list[dict[str, Any]],
    started: datetime,
    interrupted: bool,
) -> dict[str, Any]:
    summary: dict[str, dict[str, Any]] = {}
    groups = [ds.name for ds in datasets] + (["all"] if len(datasets) > 1 else [])
    for group in groups:
        by_method = {}
        for method in cfg.methods:
            recs = [r for r in records if r.method == method and (group == "all" or r.dataset == group)]
            if recs:
                by_method[method] = summarize_records(recs, runner.block_size)
        add_speedups(by_method)
        summary[group] = by_method
    settings = {
        "backend": "mlx" if cfg.engine == "mlx" else "local",
        "target": cfg.target,
        "draft": cfg.draft,
        "assistant": cfg.assistant,
        "methods": cfg.methods,
        "datasets": cfg.datasets,
        "max_samples": cfg.max_samples,
        "max_new_tokens": cfg.max_new_tokens,
        "temperature": cfg.temperature,
        "block_size": runner.block_size,
        "verify": runner.verify,
        "cost_model": runner.cost_model.to_dict() if runner.cost_model is not None else None,
        "seed": cfg.seed,
        "chat_template": cfg.chat,
        "enable_thinking": cfg.thinking,
        "stop_token_ids": runner.stop_ids,
        "warmup": cfg.warmup,
        "compile_verify": runner.target.plan.compiled,
        "static_cache": runner.target.plan.static_cache,
        "kernels": runner.target.plan.describe(),
        "transformers_generation": runner.hf_generation_settings(),
        "llamacpp": runner.llamacpp.info() if runner.llamacpp is not None else None,
    }
    return {
        "kind": "flashdraft-bench",
        "version": 1,
        "command": cfg.command,
        "started": started.isoformat(timespec="seconds"),
        "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "interrupted": interrupted,
        "settings": settings,
        "machine": {**machine_info(runner.device, runner.target.dtype), "quantize": runner.target.quantize},
        "drafter": runner.drafter_info,
        "datasets": [dataset_info(ds) for ds in datasets],
        "definitions": {
            "ttft_s": "time to the first emitted chunk (prefill + first token; for sd/pld the first verify step)",
            "tpot_s": "mean over prompts of decode time / tokens emitted after the first chunk",
            "speedup_vs_X": "mean TPOT of X / mean TPOT of the method (decode phase only, z-lab convention)",
            "throughput_speedup_vs_X": "tokens/s of the method / tokens/s of X, end to end (TTFT included)",
            "tau": "tokens emitted per target forward in the decode phase, bonus token included (pooled)",
            "acceptance_histogram": "counts[n] = decode steps that emitted n tokens",
            "slot_acceptance.rate": "P(draft slot k accepted | slots < k accepted)",
        },
        "summary": summary,
        "equality": {
            "checked": any(r.matches_reference is not None for r in records),
            "temperature": cfg.temperature,
            "reference": REFERENCE,
            "mismatches": len(mismatches),
            "compared": sum(1 for r in records if r.matches_reference is not None),
            "verdicts": verdict_counts(mismatches),  # of the greedy flips weighed: near-ties, unexplained
            "details": mismatches,
        },
        "skipped": skipped,
        "stalls": stalls(records),
        "samples": [r.to_dict() for r in records],
    }

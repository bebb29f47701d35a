"""`flashdraft generate`: one prompt through the speculative decoder (and plain decoding to compare)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from ..errors import one_line_errors
from .common import (
    CompileOption,
    DraftVocabOption,
    QuantizeOption,
    TreeOption,
    console,
    load_noting,
    out,
    parse_block_size,
    parse_draft_vocab,
    parse_tree,
    tree_note,
)
from .mlx_backend import BackendOption, mlx_dtype, parse_backend, refuse_torch_only


# ---------------------------------------------------------------------------------------------- generate
class _Streamer:
    """Prints text as tokens arrive (decoding the whole answer each time keeps multi-byte characters intact)."""

    def __init__(self, tokenizer: Any, enabled: bool) -> None:
        self.tokenizer, self.enabled = tokenizer, enabled
        self.tokens: list[int] = []
        self.printed = ""

    def __call__(self, new_tokens: list[int]) -> None:
        self.tokens.extend(new_tokens)
        if not self.enabled:
            return
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.startswith(self.printed):
            sys.stdout.write(text[len(self.printed) :])
            sys.stdout.flush()
            self.printed = text


def constraint_from_options(
    json_schema: Path | None,
    json_object: bool,
    regex: str | None,
    choice: list[str] | None,
    grammar: Path | None,
) -> Any:
    """The structured-output constraint the options ask for (at most one), read before any weights load."""
    from ..engine.grammar import Constraint, GrammarError

    given = [
        name
        for name, value in (("--json-schema", json_schema), ("--json-object", json_object), ("--regex", regex),
                            ("--choice", choice), ("--grammar", grammar))
        if value
    ]  # fmt: skip
    if len(given) > 1:
        raise GrammarError(f"{' and '.join(given)} both constrain the output: give one")
    if json_schema:
        return Constraint.json_schema(json_schema.read_text())
    if json_object:
        return Constraint("json_object")
    if regex:
        return Constraint("regex", regex)
    if choice:
        return Constraint.choice(list(choice))
    if grammar:
        return Constraint.grammar(grammar.read_text())
    return None


@one_line_errors
def generate_command(
    prompt: Annotated[str, typer.Argument(help="user prompt (the chat template is applied)")],
    target: Annotated[str, typer.Option(help="target: pack name, local path or hub id")],
    draft: Annotated[Path, typer.Option(help="DFlash drafter directory")],
    max_new_tokens: Annotated[int, typer.Option()] = 256,
    temperature: Annotated[float, typer.Option(help="0 = greedy")] = 0.0,
    top_p: Annotated[float, typer.Option()] = 1.0,
    top_k: Annotated[int, typer.Option(help="0 = off")] = 0,
    block_size: Annotated[
        str,
        typer.Option(
            help="auto: per step, prompt lookup, the drafter or a plain step and how many tokens to verify, by "
            "the measured cost of this machine; N: always verify N tokens (<= the drafter's block size)"
        ),
    ] = "auto",
    seed: Annotated[int | None, typer.Option()] = None,
    draft_sampling: Annotated[
        str,
        typer.Option(
            help="at T > 0: match (greedy drafts, output = plain sampling with the same seed) | pq (drafts sampled "
            "from the drafter, speculative rejection sampling: an exact sample, not seed-exact)"
        ),
    ] = "match",
    compare_ar: Annotated[bool, typer.Option(help="also run plain decoding and report the speedup")] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="print one JSON object instead of streaming")
    ] = False,
    chat: Annotated[bool, typer.Option(help="apply the chat template")] = True,
    system: Annotated[str | None, typer.Option(help="system prompt")] = None,
    thinking: Annotated[
        bool | None, typer.Option("--thinking/--no-thinking", help="template thinking mode")
    ] = None,
    dtype: Annotated[str | None, typer.Option(help="float32 | bfloat16 | float16")] = None,
    device: Annotated[str | None, typer.Option(help="cpu | cuda")] = None,
    threads: Annotated[
        int | None,
        typer.Option(help="torch CPU threads (default: torch's; 1 is often faster on a busy machine)"),
    ] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="library load bars and details")] = False,
    compile_verify: CompileOption = False,
    quantize: QuantizeOption = None,
    tree: TreeOption = "off",
    draft_vocab: DraftVocabOption = "auto",
    json_schema: Annotated[
        Path | None, typer.Option(help="structured output: the answer is JSON valid for this schema file")
    ] = None,
    json_object: Annotated[bool, typer.Option(help="structured output: the answer is a JSON object")] = False,
    regex: Annotated[
        str | None, typer.Option(help="structured output: the answer matches this regex")
    ] = None,
    choice: Annotated[
        list[str] | None, typer.Option(help="structured output: the answer is one of these (repeatable)")
    ] = None,
    grammar: Annotated[
        Path | None, typer.Option(help="structured output: a grammar file (EBNF with ::=, else Lark)")
    ] = None,
    image: Annotated[
        list[Path] | None,
        typer.Option(help="an image for an image-text target (repeatable; they go before the prompt's text)"),
    ] = None,
    backend: BackendOption = "torch",
) -> None:
    """Generate an answer with DFlash speculative decoding (lossless), streaming the text."""
    import torch

    from ..drafter.checkpoint import load_drafter_config
    from ..generate import GenerationError, generate, generate_ar
    from ..kernels.plan import make_plan
    from ..pipeline import check_pair
    from ..progress import busy_machine_warning, quiet_libraries
    from ..sampling import SamplingParams
    from ..targets.model_parts import image_text_class
    from ..targets.multimodal import ImageError, encode_image_prompt, load_image
    from ..targets.target import (
        parse_device,
        parse_dtype,
    )

    quiet_libraries(verbose)
    # Every check that needs no weights runs first: a typo costs a second, not a model load.
    if not prompt.strip():
        raise GenerationError("the prompt is empty")
    if max_new_tokens < 1:
        raise GenerationError(f"--max-new-tokens must be a positive integer, got {max_new_tokens}")
    SamplingParams(temperature, top_p, top_k)
    constraint = constraint_from_options(json_schema, json_object, regex, choice, grammar)
    if parse_backend(backend) == "mlx":
        refuse_torch_only(
            {"--compile": compile_verify, "--quantize": quantize, "--tree": tree, "--draft-vocab": draft_vocab,
             "--device": device, "--threads": threads, "--image": image, "--draft-sampling": draft_sampling}
        )  # fmt: skip
        from ..drafter.checkpoint import load_drafter_config

        return generate_mlx(
            prompt=prompt, target=target, draft=draft, max_new_tokens=max_new_tokens, temperature=temperature,
            top_p=top_p, top_k=top_k, block_size=parse_block_size(block_size, load_drafter_config(draft).block_size),
            seed=seed, compare_ar=compare_ar, as_json=as_json, chat=chat, system=system, thinking=thinking,
            dtype=dtype, verbose=verbose, constraint=constraint,
        )  # fmt: skip
    if threads is not None and threads < 1:
        raise GenerationError(f"--threads must be >= 1, got {threads}")
    dev = parse_device(device)
    torch_dtype = parse_dtype(dtype)
    make_plan(
        dev, torch_dtype, quantize, compile_verify
    )  # a scheme or $FLASHDRAFT_COMPILE it cannot run, named
    draft_config = load_drafter_config(draft)
    verify = parse_block_size(block_size, draft_config.block_size)
    nodes = parse_tree(tree)
    vocab_size = parse_draft_vocab(draft_vocab)
    _, target_config = check_pair(target, draft)  # a pack is fetched here, once
    images = [load_image(p, name=str(p)) for p in image or []]  # an unreadable image is named before any load
    if images and image_text_class(target_config) is None:
        raise ImageError(f"target {target} is a text-only model: it cannot take images")
    if threads:
        torch.set_num_threads(threads)

    t0 = time.perf_counter()
    pipeline = load_noting(
        target,
        draft,
        dtype=torch_dtype,
        device=dev,
        quantize=quantize,
        images=bool(images) or None,
        compile=compile_verify,
        draft_vocab=vocab_size,
    )
    tgt, drafter = pipeline.target, pipeline.drafter
    load_s = time.perf_counter() - t0
    busy = busy_machine_warning(tgt.device.type, torch.get_num_threads())
    if busy:
        console.print(f"[yellow]warning:[/] {busy}")
    if verbose:
        console.print(
            f"loaded {target} ({tgt.dtype}, {tgt.device}, {torch.get_num_threads()} threads) and drafter {draft} "
            f"in {load_s:.1f} s"
        )
        console.print(f"kernels: {tgt.plan.describe()}")
        if note := tree_note(tgt, nodes):
            console.print(f"[yellow]note:[/] {note}")
    if images:
        kwargs = {} if thinking is None else {"enable_thinking": thinking}
        ids = encode_image_prompt(tgt, prompt, images, system=system, template_kwargs=kwargs)
        text_ids = ids.input_ids
    else:
        ids = text_ids = tgt.encode_prompt(prompt, chat=chat, enable_thinking=thinking, system=system)
    if constraint is not None:
        from ..generate import check_constraints

        check_constraints(tgt, constraint, 1)  # an invalid regex or grammar is named before any decoding
    if seed is None and compare_ar:  # sampling is seed-exact: one seed for both runs makes them comparable
        seed = int(torch.randint(0, 2**31, ()).item())
    if draft_sampling not in ("match", "pq"):
        raise typer.BadParameter(f"--draft-sampling must be match or pq, not {draft_sampling!r}")
    kwargs = dict(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, response_format=constraint)
    spec = dict(block_size=verify, tree=nodes)
    costs = None
    if verify == "auto":
        costs = pipeline.measure_costs(log=lambda m: console.print(m, soft_wrap=True))
        if verbose:
            console.print(costs.summary(), soft_wrap=True)
    if tgt.dtype != torch.float32 and temperature == 0:
        console.print(
            f"[yellow]note:[/] {str(tgt.dtype).removeprefix('torch.')} target: verifying a block and decoding one "
            "token round differently, so near-ties can flip and the output may differ from plain decoding in the "
            "same dtype (still a valid greedy decoding up to rounding). float32 is token-for-token identical."
        )
    # Warm both paths up so first-call overheads do not count against either of them.
    generate(tgt, drafter, text_ids[:, -8:], max_new_tokens=4, stop_token_ids=[], costs=costs, **spec)
    if compare_ar:
        generate_ar(tgt, text_ids[:, -8:], max_new_tokens=4, stop_token_ids=[])

    res, ar, text = decode_and_compare(
        lambda streamer: generate(
            tgt, drafter, ids, max_new_tokens, costs=costs, on_tokens=streamer, draft_sampling=draft_sampling,
            **spec, **kwargs,
        ),
        (lambda: generate_ar(tgt, ids, max_new_tokens, **kwargs)) if compare_ar else None,
        tgt.tokenizer, as_json, max_new_tokens,
    )  # fmt: skip
    report = _report(text, target, draft, drafter, res, ar, load_s, verify, nodes)
    show_report(report, res, ar, as_json, temperature, seed, draft_sampling)


def decode_and_compare(
    run: Any, run_plain: Any, tokenizer: Any, as_json: bool, max_new_tokens: int
) -> tuple[Any, Any, str]:
    """The answer, streamed unless --json (`run(on_tokens)`), then plain decoding of the same prompt when
    --compare-ar asks (`run_plain()`): (result, plain result or None, the answer's text). Every backend's generate."""
    res = run(_Streamer(tokenizer, enabled=not as_json))
    if not as_json:
        sys.stdout.write("\n")
    ar = None
    if run_plain is not None:
        console.print(
            f"running plain decoding on the same prompt for comparison ({max_new_tokens} tokens at most)…"
        )
        ar = run_plain()
    return res, ar, tokenizer.decode(res.new_tokens, skip_special_tokens=True)


def show_report(
    report: dict[str, Any],
    res: Any,
    ar: Any,
    as_json: bool,
    temperature: float,
    seed: int | None,
    sampling: str,
) -> None:
    """--json: the report as one JSON object; else the table and the verdict."""
    if as_json:
        out.print_json(json.dumps(report))
        return
    _print_summary(report, res, ar, temperature, seed, sampling)


def generate_mlx(
    *,
    prompt: str,
    target: str,
    draft: Any,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    block_size: Any,
    seed: int | None,
    compare_ar: bool,
    as_json: bool,
    chat: bool,
    system: str | None,
    thinking: bool | None,
    dtype: str | None,
    verbose: bool,
    constraint: Any,
) -> None:
    """`flashdraft generate --backend mlx`: the same run and report as on torch, decoded by flashdraft.mlx."""
    import random

    from ..mlx import generate, generate_ar, load_pipeline
    from ..pipeline import check_pair
    from ..targets.target import encode_chat

    check_pair(target, draft)  # the configs checked (and a pack fetched) before any weight
    t0 = time.perf_counter()
    pipeline = load_pipeline(target, draft, dtype=mlx_dtype(dtype))
    load_s = time.perf_counter() - t0
    tgt = pipeline.target
    if verbose:
        console.print(f"loaded {target} and drafter {draft} on MLX in {load_s:.1f} s")
    ids = encode_chat(tgt.tokenizer, prompt, chat, thinking, system)
    if constraint is not None:  # an invalid regex or grammar is named before any decoding
        from ..engine.grammar import compile_constraint

        compile_constraint(tgt, constraint)
    if seed is None and compare_ar:  # sampling is seed-exact: one seed for both runs makes them comparable
        seed = random.randrange(2**31)
    kwargs = dict(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, response_format=constraint)
    if block_size == "auto" and pipeline.drafter.prices is None:
        console.print("measuring this MLX device's prices for the verify policy…")
    # Warm both paths up so first-call overheads do not count against either of them.
    generate(pipeline, None, ids[-8:], 4, block_size=block_size, stop_token_ids=[])
    if compare_ar:
        generate_ar(pipeline, ids[-8:], 4, stop_token_ids=[])
    if verbose and pipeline.drafter.prices is not None:
        console.print(pipeline.drafter.prices.summary(), soft_wrap=True)
    res, ar, text = decode_and_compare(
        lambda streamer: generate(
            pipeline, None, ids, max_new_tokens, block_size=block_size, on_tokens=streamer, **kwargs
        ),
        (lambda: generate_ar(pipeline, ids, max_new_tokens, **kwargs)) if compare_ar else None,
        tgt.tokenizer,
        as_json,
        max_new_tokens,
    )
    report = _report(text, target, draft, pipeline.drafter, res, ar, load_s, block_size, None)
    show_report({**report, "backend": "mlx"}, res, ar, as_json, temperature, seed, "match")


def _report(
    text: str,
    target: str,
    draft: Path,
    drafter: Any,
    res: Any,
    ar: Any,
    load_s: float,
    verify: Any,
    nodes: Any,
) -> dict[str, Any]:
    """What `--json` prints: the text, both runs' figures, the speedup and whether the outputs are identical."""
    meta = drafter.config.flashdraft or {}
    untrained = meta.get("trained") is False
    report: dict[str, Any] = {
        "text": text,
        "target": target,
        "draft": str(draft),
        "prompt_tokens": res.prompt_length,
        "load_s": load_s,
        "dflash": res.to_dict(),
        "block_size": verify,
        "tree": nodes,
        "untrained_drafter": untrained,
    }
    if ar is not None:
        report["ar"] = ar.to_dict()
        report["speedup"] = ar.total_s / res.total_s if res.total_s else None
        report["decode_speedup"] = ar.decode_s / res.decode_s if res.decode_s else None
        report["identical_to_ar"] = ar.new_tokens == res.new_tokens
    return report


def _print_summary(
    report: dict[str, Any], res: Any, ar: Any, temperature: float, seed: int | None, draft_sampling: str
) -> None:
    """The table of both runs, the speedup, and whether the output is plain decoding's."""
    untrained = report["untrained_drafter"]
    table = Table(show_header=True, title="generation")
    for col in ("", "tokens", "τ", "tokens/s", "decode tok/s", "prefill s", "total s"):
        table.add_column(col)
    table.add_row(
        "dflash",
        str(res.num_new_tokens),
        f"{res.mean_acceptance_length:.2f}",
        f"{res.tokens_per_s:.1f}",
        f"{res.decode_tokens_per_s:.1f}",
        f"{res.prefill_s:.2f}",
        f"{res.total_s:.2f}",
    )
    if ar is not None:
        table.add_row(
            "plain (AR)",
            str(ar.num_new_tokens),
            "1.00",
            f"{ar.tokens_per_s:.1f}",
            f"{ar.decode_tokens_per_s:.1f}",
            f"{ar.prefill_s:.2f}",
            f"{ar.total_s:.2f}",
        )
    console.print(table)
    console.print("τ = tokens per target forward (accepted drafts + 1); plain decoding is 1.")
    if ar is not None:
        line = f"speedup over plain decoding (same run): {report['speedup']:.2f}x"
        mode = "plain greedy decoding" if temperature == 0 else f"plain sampling with the same seed ({seed})"
        if draft_sampling == "pq" and temperature > 0:
            line += (
                " — sampled drafts: an exact sample of the target, not plain sampling's tokens for this seed"
            )
        else:
            line += (
                f" — output identical to {mode}" if report["identical_to_ar"] else " — OUTPUT DIFFERS FROM AR"
            )
        console.print(line)
    if untrained:
        console.print(
            "[yellow]note:[/] this drafter is untrained (made by `flashdraft init-draft`): its guesses are random, "
            "so τ≈1 and speculation only adds cost. That is expected; train it with `flashdraft train`."
        )

"""`flashdraft data`: regenerate answers with the target (locally or through a server), cache offline features,
build code prompts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from ..files import atomic_write_text
from ..targets.target import DTYPES
from ..training.data_layout import MANIFEST
from ..training.dataset import compute_features
from ..training.regenerate import DataError, load_prompts, regenerate


def _make_app():

    app = typer.Typer(
        help="Build drafter training data: regenerate answers with the target, cache offline features.",
        no_args_is_help=True,
        add_completion=False,
    )

    def fail(message: str) -> None:
        from rich.console import Console

        Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/bold red] {message}", highlight=False)
        raise typer.Exit(1)

    def load(name: str, dtype: str | None = None, images: bool = False):
        from ..models.packs import PackError
        from ..targets.target import TargetError, load_target

        try:  # images: an image-text checkpoint whole (a Qwen3.5 composite would load its language model alone)
            return load_target(name, dtype=dtype, images=images or None)
        except (TargetError, PackError, OSError, ValueError) as e:
            fail(f"cannot load target {name!r}: {e}")

    @app.command("regenerate")
    def regenerate_cmd(
        target: str = typer.Option(..., "--target", help="Target model: pack name, local path or hub id."),
        prompts: list[Path] = typer.Option(..., "--prompts", help="Prompt file (.jsonl[.gz]); repeatable."),
        out: Path = typer.Option(..., "--out", help="Output directory (resumable)."),
        max_new_tokens: int = typer.Option(256, "--max-new-tokens", min=1),
        temperature: float = typer.Option(0.0, "--temperature", min=0.0, help="0 = greedy."),
        top_p: float = typer.Option(1.0, "--top-p", min=0.0, max=1.0),
        batch_size: int = typer.Option(16, "--batch-size", min=1),
        thinking: bool | None = typer.Option(
            None,
            "--thinking/--no-thinking",
            help="enable_thinking for templates that have it (default: template's).",
        ),
        system: str | None = typer.Option(None, "--system", help="System prompt for every conversation."),
        max_turns: int = typer.Option(1, "--max-turns", min=1, help="User turns per conversation."),
        limit: int | None = typer.Option(
            None, "--limit", min=0, help="Use the first N prompts (after shuffle)."
        ),
        shuffle_seed: int | None = typer.Option(
            None, "--shuffle-seed", help="Shuffle prompts with this seed."
        ),
        no_regenerate: bool = typer.Option(
            False, "--no-regenerate", help="Use the answers already in the file."
        ),
        max_length: int = typer.Option(
            2048, "--max-length", min=2, help="Skip longer prompts; cut sequences."
        ),
        chunk_size: int | None = typer.Option(None, "--chunk-size", min=1, help="Prompts per shard."),
        target_dtype: str | None = typer.Option(
            None,
            "--target-dtype",
            help="float32|bfloat16|float16 for the target (default: fp32 on CPU, bf16 on GPU).",
        ),
        prompt_suffix: str | None = typer.Option(
            None,
            "--prompt-suffix",
            help="Text appended to each first user turn, to match how prompts are served; 'boxed' = the "
            "GSM8K/MATH benchmark's step-by-step \\boxed{} instruction.",
        ),
        backend: str = typer.Option(
            "local", "--backend", help="local (this process) | openai (any OpenAI-compatible server)."
        ),
        base_url: str | None = typer.Option(
            None, "--base-url", help="openai backend: the server, e.g. http://127.0.0.1:8000"
        ),
        model: str | None = typer.Option(
            None, "--model", help="openai backend: the model name the server knows (default: --target)."
        ),
        concurrency: int = typer.Option(
            8, "--concurrency", min=1, help="openai backend: requests in flight."
        ),
        retries: int = typer.Option(
            3, "--retries", min=0, help="openai backend: tries again after a failed request (with back-off)."
        ),
        api_key: str | None = typer.Option(
            None,
            "--api-key",
            envvar="OPENAI_API_KEY",
            help="openai backend: bearer token, if the server needs one.",
        ),
    ) -> None:
        """Regenerate answers with the target and store token ids + answer loss masks.

        With --backend openai the answers come from a server (vLLM, SGLang, flashdraft serve) serving the same
        target; --target then only provides the tokenizer and config (no weights are loaded here)."""
        for p in prompts:
            if not p.is_file():
                raise typer.BadParameter(f"prompt file not found: {p}", param_hint="--prompts")
        if top_p <= 0:
            raise typer.BadParameter("must be > 0", param_hint="--top-p")
        if target_dtype is not None and target_dtype not in DTYPES:
            raise typer.BadParameter(f"must be one of {', '.join(DTYPES)}", param_hint="--target-dtype")
        from ..training.remote import RemoteError

        if backend not in ("local", "openai"):
            raise typer.BadParameter("must be local or openai", param_hint="--backend")
        if backend == "openai" and not base_url:
            fail("--backend openai needs --base-url URL (e.g. http://127.0.0.1:8000)")
        try:  # bad prompt files fail fast, before the model loads
            items = load_prompts(prompts, shuffle_seed=shuffle_seed, limit=limit)
        except DataError as e:
            fail(str(e))
        answerer = None
        if backend == "openai":
            from ..models.packs import PackError
            from ..training.remote import OpenAIAnswerer, RemoteTarget

            try:
                tgt = RemoteTarget(target)
            except (RemoteError, PackError) as e:
                fail(str(e))
            answerer = OpenAIAnswerer(
                base_url,
                model or target,
                tgt.tokenizer,
                tgt.max_context,
                concurrency=concurrency,
                api_key=api_key,
                retries=retries,
            )
            batch_size = max(batch_size, concurrency)
        else:
            tgt = load(target, target_dtype, any(item.conversation.meta.get("images") for item in items))
        try:
            manifest = regenerate(
                tgt,
                prompts,
                out,
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                top_p=top_p,
                batch_size=batch_size,
                thinking=thinking,
                system=system,
                max_turns=max_turns,
                limit=limit,
                shuffle_seed=shuffle_seed,
                no_regenerate=no_regenerate,
                max_length=max_length,
                chunk_size=chunk_size,
                prompt_suffix=prompt_suffix,
                answerer=answerer,
            )
        except DataError as e:
            fail(str(e))
        except RemoteError as e:  # the server went away: the finished chunks stay
            fail(f"{e}; finished chunks are kept in {out}: run the same command again to resume")
        except KeyboardInterrupt:
            fail(f"interrupted: finished chunks are kept in {out}; run the same command again to resume")
        c = manifest["counts"]
        typer.echo(
            f"{out}: {c['prompts']} prompts, {c['sequences']} sequences, {c['answer_tokens']} answer tokens, "
            f"{c['skipped']} skipped, {manifest['wall_time_s']:.0f}s"
        )

    @app.command("features")
    def features_cmd(
        target: str = typer.Option(..., "--target", help="Target model: pack name, local path or hub id."),
        data: Path = typer.Option(..., "--data", help="Data directory made by `regenerate`."),
        out: Path = typer.Option(..., "--out", help="Output directory for the features (may equal --data)."),
        layers: str | None = typer.Option(None, "--layers", help="Target layer ids to tap, e.g. 1,8,14."),
        draft: Path | None = typer.Option(
            None, "--draft", help="Read the layer ids from this drafter's config."
        ),
        dtype: str = typer.Option("float16", "--dtype", help="float16 or bfloat16."),
    ) -> None:
        """Cache the target's tapped-layer outputs for offline training."""
        if (layers is None) == (draft is None):
            raise typer.BadParameter("give exactly one of --layers or --draft", param_hint="--layers/--draft")
        if dtype not in ("float16", "bfloat16"):
            raise typer.BadParameter(f"must be float16 or bfloat16, got {dtype!r}", param_hint="--dtype")
        if layers is not None:
            try:
                layer_ids = [int(x) for x in layers.replace(" ", "").split(",") if x]
            except ValueError:
                raise typer.BadParameter(
                    f"expected comma-separated integers, got {layers!r}", param_hint="--layers"
                ) from None
            if not layer_ids:
                raise typer.BadParameter("no layer ids given", param_hint="--layers")
        else:
            from ..drafter.config import DFlashConfig, DFlashConfigError

            try:
                layer_ids = list(DFlashConfig.from_pretrained(draft).target_layer_ids)
            except DFlashConfigError as e:
                raise typer.BadParameter(str(e), param_hint="--draft") from None
        if not (data / MANIFEST).exists():
            raise typer.BadParameter(f"{data} is not a data directory (no {MANIFEST})", param_hint="--data")
        from ..training.dataset import TrainingData

        try:
            images = TrainingData(data, features=False).has_images
        except DataError as e:
            fail(str(e))
        tgt = load(target, images=images)
        try:
            manifest = compute_features(tgt, data, out, layer_ids, DTYPES[dtype])
        except DataError as e:
            fail(str(e))
        except KeyboardInterrupt:
            fail(f"interrupted: finished shards are kept in {out}; run the same command again to resume")
        c = manifest["counts"]
        typer.echo(
            f"{out}: features of {c['sequences']} sequences ({c['tokens']} tokens), layers {layer_ids}"
        )

    @app.command("pack")
    def pack_cmd(
        data_dir: Path = typer.Argument(
            ..., help="A regenerated data directory (`flashdraft data regenerate`)."
        ),
        out: Path = typer.Option(..., "--out", help="The packed file to write (.npz)."),
    ) -> None:
        """Pack a data directory into one compressed .npz file (token ids, loss masks and the manifest) that
        `flashdraft train --data` reads on any machine."""
        from ..training.dataset import pack_data

        try:
            info = pack_data(data_dir, out)
        except (DataError, OSError) as e:
            fail(str(e))
        typer.echo(
            f"{out}: {info['sequences']} sequences, {info['tokens']} tokens, {info['bytes'] / 1e6:.2f} MB"
        )

    @app.command("code-prompts")
    def code_prompts_cmd(
        out: Path = typer.Option(..., "--out", help="Prompt file to write (.jsonl, z-lab `turns` format)."),
        limit: int | None = typer.Option(None, "--limit", min=1, help="Keep the first N after shuffling."),
        seed: int = typer.Option(0, "--seed", help="Shuffle seed."),
    ) -> None:
        """Code-writing prompts from the Python standard library's documented functions (PSF licence): input
        for `regenerate` that shares nothing with HumanEval or MBPP."""
        from ..prompts.code import stdlib_code_prompts

        records = stdlib_code_prompts(limit=limit, seed=seed)
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
        typer.echo(
            f"{out}: {len(records)} code prompts from the Python {sys.version.split()[0]} standard library"
        )

    @app.command("token-counts")
    def token_counts_cmd(
        draft: Path = typer.Option(..., "--draft", help="Drafter directory: token_counts.json goes there."),
        data: list[Path] = typer.Option(
            [], "--data", help="Regenerated data (directory or packed .npz): its answer tokens; repeatable."
        ),
        text: list[Path] = typer.Option(
            [], "--text", help="Text (.jsonl[.gz]: every string in each record): its tokens; repeatable."
        ),
        target: str | None = typer.Option(
            None, "--target", help="Tokenizer for --text: the target (pack name, local path or hub id)."
        ),
    ) -> None:
        """Count the tokens a drafter's vocabulary is drawn from (`--draft-vocab`: its LM head over the most
        frequent tokens only): the target's answers it was trained on (`flashdraft train` writes these itself), or
        text of the same kind."""
        import torch

        from ..drafter.checkpoint import DFlashCheckpointError, load_drafter_config
        from ..drafter.vocab import count_tokens, save_token_counts
        from ..training.dataset import TrainingData

        if not data and not text:
            fail("give --data (regenerated answers) or --text (text files) to count")
        if text and target is None:
            fail("--text needs --target (its tokenizer)")
        try:
            vocab = load_drafter_config(draft).vocab_size
        except (DFlashCheckpointError, OSError, ValueError) as e:
            fail(str(e))
        counts, sources = torch.zeros(vocab, dtype=torch.int64), []
        try:
            for d in data:
                counts += TrainingData(d, features=False).answer_token_counts(vocab)
                sources.append(f"answer tokens of {d}")
            if text:
                tokenizer = _tokenizer(target)
                for f in text:
                    counts += count_tokens(
                        (tokenizer.encode(t, add_special_tokens=False) for t in _strings(f)), vocab
                    )
                    sources.append(f"text of {f.name}")
        except (DataError, OSError, ValueError) as e:
            fail(str(e))
        save_token_counts(draft, counts, "; ".join(sources))
        covered = int((counts > 0).sum())
        typer.echo(f"{draft}: {int(counts.sum())} tokens counted, {covered} of {vocab} token ids seen")

    return app


def _tokenizer(target: str):
    from transformers import AutoTokenizer

    from ..models.packs import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(target))


def _strings(path: Path):
    """Every string value of every record of a .jsonl[.gz] file (lists and nested objects included)."""
    from ..prompts.files import read_jsonl

    for record in read_jsonl(path):
        stack = [record]
        while stack:
            item = stack.pop()
            if isinstance(item, str):
                yield item
            elif isinstance(item, dict):
                stack.extend(item.values())
            elif isinstance(item, list):
                stack.extend(item)


data_app = _make_app()

"""First-run behaviour: bad input is one clear line, found before any model is loaded; output is readable."""

from __future__ import annotations

import io
import os
import stat

import pytest
import torch
from typer.testing import CliRunner

from conftest import VOCAB, tiny_config
from flashdraft import DFlashDraftModel, GenerationError, Target, generate
from flashdraft.cli import app
from flashdraft.models.packs import PACKS, PackError, resolve_model
from flashdraft.targets.target import TargetError, load_target, parse_device, parse_dtype


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """A target directory holding only a config (enough for every pre-load check) and a drafter for it."""
    root = tmp_path_factory.mktemp("cli")
    config = tiny_config("llama")
    target = root / "target"
    config.save_pretrained(target)
    draft = root / "draft"
    DFlashDraftModel.for_target(config, num_layers=1, block_size=8, mask_token_id=VOCAB - 1).save_pretrained(
        draft
    )
    wrong = root / "wrong-draft"
    other = tiny_config("llama", hidden_size=128)
    DFlashDraftModel.for_target(other, num_layers=1, block_size=8, mask_token_id=VOCAB - 1).save_pretrained(
        wrong
    )
    bad_schema = root / "schema.json"
    bad_schema.write_text("{not json")
    return {"target": target, "draft": draft, "wrong": wrong, "bad_schema": bad_schema}


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail loudly if a command gets as far as loading weights."""

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr("flashdraft.targets.target.load_target", refuse)
    monkeypatch.setattr(DFlashDraftModel, "from_pretrained", refuse)


def _generate_args(dirs, **change):
    args = {"--target": str(dirs["target"]), "--draft": str(dirs["draft"])}
    args.update(change)
    return [x for kv in args.items() for x in kv]


CASES = [
    ({"--dtype": "foo"}, "unknown dtype 'foo'"),
    ({"--temperature": "-1"}, "temperature"),
    ({"--top-p": "0"}, "top_p"),
    ({"--top-k": "-2"}, "top_k"),
    ({"--block-size": "9"}, "drafter's block size 8"),
    ({"--block-size": "0"}, "--block-size must be 'auto' or a positive integer"),
    ({"--block-size": "big"}, "--block-size must be 'auto' or an integer"),
    ({"--max-new-tokens": "0"}, "max-new-tokens"),
    ({"--threads": "0"}, "--threads"),
    ({"--target": "nosuchmodel"}, "Known packs"),
    ({"--target": "smolm2-135m-instruct"}, "did you mean 'smollm2-135m-instruct'"),
    ({"--target": "./no/such/dir"}, "does not exist"),
    ({"--draft": "DRAFT_FILE"}, "is a file"),
    ({"--draft": "/no/such/drafter"}, "does not exist"),
    ({"--draft": "WRONG"}, "hidden size 128"),
    ({"--quantize": "int4"}, "--quantize must be one of int8, w8a8, w8a16, fp16, got 'int4'"),
    # the device given: on a machine with a GPU the default device is the GPU, where int8 is refused first
    (
        {"--quantize": "int8", "--dtype": "float16", "--device": "cpu"},
        "--quantize int8 runs bf16 activations (or fp32 ones), not float16",
    ),
    (
        {"--quantize": "fp16", "--dtype": "bfloat16", "--device": "cpu"},
        "--quantize fp16 runs fp32 activations",
    ),
    ({"--regex": "[0-9]+", "--choice": "yes"}, "--regex and --choice both constrain the output: give one"),
    ({"--json-schema": "BAD_SCHEMA"}, "the JSON schema is not valid JSON"),
    ({"--json-schema": "/no/such/schema.json"}, "No such file"),
]
if not torch.cuda.is_available():
    CASES.append(({"--device": "cuda"}, "sees no CUDA GPU"))


@pytest.mark.parametrize(("change", "message"), CASES, ids=[c[1][:20] for c in CASES])
def test_generate_bad_input_is_one_line_before_any_load(dirs, no_model_load, change, message):
    change = {
        k: {
            "DRAFT_FILE": str(dirs["draft"] / "model.safetensors"),
            "WRONG": str(dirs["wrong"]),
            "BAD_SCHEMA": str(dirs["bad_schema"]),
        }.get(v, v)  # fmt: skip
        for k, v in change.items()
    }
    result = CliRunner().invoke(app, ["generate", *_generate_args(dirs, **change), "What is 2+2?"])
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit), result.exception
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.output


def test_a_bad_compile_setting_is_one_line_before_any_load(dirs, no_model_load):
    env = {"FLASHDRAFT_COMPILE": "reduce-overhead"}
    result = CliRunner().invoke(app, ["generate", *_generate_args(dirs), "--compile", "Hi"], env=env)
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == [
        "error: FLASHDRAFT_COMPILE must be a JSON object of torch.compile options, got 'reduce-overhead'"
    ]


def test_serve_on_a_taken_port_is_one_line_before_any_load(dirs, no_model_load):
    pytest.importorskip("uvicorn")
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = CliRunner().invoke(app, ["serve", *_generate_args(dirs), "--port", str(port)])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: cannot serve on 127.0.0.1:{port}: "), (
        result.output
    )


def test_generate_empty_prompt(dirs, no_model_load):
    result = CliRunner().invoke(app, ["generate", *_generate_args(dirs), "  "])
    assert result.exit_code == 2 and result.output.strip() == "error: the prompt is empty"


def test_api_rejects_text_float_and_bool_ids(models):
    model = models["llama"]
    draft = DFlashDraftModel.for_target(model.config, num_layers=1, block_size=4, mask_token_id=VOCAB - 1)
    target = Target(model)
    for bad, message in [
        ("What is 2+2?", "not text"),
        (torch.tensor([[1.0, 2.0]]), "dtype torch.float32"),
        (torch.tensor([[True, False]]), "dtype torch.bool"),
        ([1, 2.5], "found 2.5"),
        ([[1, 2], [3]], "list of token ids"),
    ]:
        with pytest.raises(GenerationError, match=message):
            generate(target, draft, bad, 4)


def test_load_target_dtype_device_and_names_fail_fast():
    with pytest.raises(TargetError, match="unknown dtype 'fp33'"):
        parse_dtype("fp33")
    assert parse_dtype("bf16") == torch.bfloat16 and parse_dtype(None) is None
    with pytest.raises(TargetError, match="unknown device"):
        parse_device("tpu:x")
    if not torch.cuda.is_available():
        with pytest.raises(TargetError, match="no CUDA GPU"):
            load_target("smollm2-135m-instruct", device="cuda")  # before the pack is even looked at
    with pytest.raises(PackError, match="Known packs"):
        resolve_model("llama-tiny")


def test_models_list_never_truncates_pack_names():
    result = CliRunner().invoke(app, ["models", "list"], env={"COLUMNS": "80"}, terminal_width=80)
    assert result.exit_code == 0, result.output
    for name in PACKS:
        assert name in result.output


def test_exported_files_get_the_normal_file_mode(tmp_path):
    draft = DFlashDraftModel.for_target(
        tiny_config("llama"), num_layers=1, block_size=4, mask_token_id=VOCAB - 1
    )
    draft.save_pretrained(tmp_path / "d")
    umask = os.umask(0)
    os.umask(umask)
    for name in ("model.safetensors", "config.json"):
        assert stat.S_IMODE((tmp_path / "d" / name).stat().st_mode) == 0o666 & ~umask, name


def test_progress_prints_plain_lines_when_not_a_terminal():
    from rich.console import Console

    from flashdraft.progress import progress_bar

    buf = io.StringIO()
    with progress_bar(unit="prompts", console=Console(file=buf, force_terminal=False), interval_s=0) as bar:
        task = bar.add_task("bench", total=4)
        for _ in range(4):
            bar.advance(task)
    lines = buf.getvalue().strip().splitlines()
    assert lines[0].startswith("bench: 0/4 prompts (0 %)")
    assert any(line.startswith("bench: 2/4 prompts (50 %)") for line in lines)
    assert lines[-1].startswith("bench: 4/4 prompts (100 %)") and "left" not in lines[-1]
    assert sum(line.startswith("bench: 4/4") for line in lines) == 1  # the final line once


def test_progress_is_rate_limited_when_not_a_terminal():
    from rich.console import Console

    from flashdraft.progress import progress_bar

    buf = io.StringIO()
    with progress_bar(console=Console(file=buf, force_terminal=False), interval_s=3600) as bar:
        task = bar.add_task("train", total=1000)
        for _ in range(999):
            bar.advance(task)
    lines = buf.getvalue().strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("train: 0/1000") and lines[1].startswith("train: 999/1000")


@pytest.mark.parametrize(
    ("command", "module", "extra"),
    [
        (["serve", "--target", "x"], "uvicorn", "serve"),
        (["models", "fetch", "smollm2-135m-instruct", "--force"], "gguf", "packs"),
    ],
)
def test_a_missing_extra_is_one_line_naming_the_install(monkeypatch, tmp_path, command, module, extra):
    """The core install has no serving, pack or plotting packages: using them says what to install."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == module else real(name, *a)
    )
    monkeypatch.setenv("FLASHDRAFT_HOME", str(tmp_path))
    result = CliRunner().invoke(app, command)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2, result.output
    assert (
        lines[-1] == f"error: this needs {module}, which is not installed: pip install 'flashdraft[{extra}]'"
    )
    assert "Traceback" not in result.output

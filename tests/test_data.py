"""Training data: regeneration with the target, answer loss masks, resume, manifests, offline features, CLI."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from conftest import hf_greedy, running_server, tiny_model
from flashdraft import Target
from flashdraft.cli.data import data_app
from flashdraft.training import regenerate as data_mod
from flashdraft.training.dataset import TrainingData, compute_features
from flashdraft.training.regenerate import DataError, load_prompts, regenerate

SPECIALS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<unk>"]
ROLES = ["user", "assistant", "system"]
VOCAB = 96
WORDS = [f"w{i}" for i in range(VOCAB - len(SPECIALS) - len(ROLES))]
IM_END = SPECIALS.index("<|im_end|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}w0 w0\n{% endif %}{% endif %}"
)
MAX_NEW = 10


def make_tokenizer():
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + ROLES + WORDS)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        bos_token="<s>",
        eos_token="<|im_end|>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>"],
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS[1:]) for _ in range(n))


@pytest.fixture(scope="module")
def target() -> Target:
    tok = make_tokenizer()
    model = tiny_model("llama", seed=3, layers=3)
    tgt = Target(model, tok, name="tiny-llama")
    # A stop token the model actually emits (a random model rarely says <|im_end|>): some answers end on it,
    # others run into max_new_tokens.
    probe = tgt.encode_prompt("w5 w6 w7")
    first = hf_greedy(model, probe, 8, None)
    model.generation_config.eos_token_id = [IM_END, first[3]]
    return tgt


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("prompts")
    rng = random.Random(0)
    gsm = [
        {"question": words(rng, rng.randint(2, 12)), "answer": words(rng, rng.randint(1, 6))}
        for _ in range(7)
    ]
    zlab = [{"id": f"z{i}", "turns": [words(rng, rng.randint(2, 8)), words(rng, 3)]} for i in range(3)]
    share = [
        {
            "id": f"s{i}",
            "conversations": [
                {"from": "human", "value": words(rng, rng.randint(2, 9))},
                {"from": "gpt", "value": words(rng, 4)},
            ],
        }
        for i in range(3)
    ]
    share.append({"id": "s_noanswer", "messages": [{"role": "user", "content": words(rng, 3)}]})
    out = {}
    for name, recs in (("gsm", gsm), ("zlab", zlab), ("share", share)):
        out[name] = d / f"{name}.jsonl"
        out[name].write_text("".join(json.dumps(r) + "\n" for r in recs))
    return out


def records(out: Path) -> dict[str, tuple[list[int], list[int]]]:
    recs = {}
    for shard in sorted(out.glob("shard-*.jsonl")):
        for line in shard.read_text().splitlines()[1:]:
            r = json.loads(line)
            assert r["id"] not in recs, "duplicated sequence"
            recs[r["id"]] = (r["input_ids"], r["loss_mask"])
    return recs


def run(target, files, out, **kw):
    kw.setdefault("max_new_tokens", MAX_NEW)
    kw.setdefault("batch_size", 3)
    kw.setdefault("progress", False)
    return regenerate(target, files, out, **kw)


# ------------------------------------------------------------------------------------------------ prompts


def test_prompt_formats_parse(files):
    items = load_prompts([files["gsm"], files["zlab"], files["share"]])
    by_key = {it.key: it.conversation for it in items}
    assert len(items) == 7 + 3 + 4
    assert len(by_key["gsm:0"].user_turns) == 1 and len(by_key["gsm:0"].answers) == 1  # GSM8K question/answer
    assert len(by_key["zlab:z1"].user_turns) == 2 and by_key["zlab:z1"].answers == []  # z-lab turns
    assert len(by_key["share:s0"].user_turns) == 1 and len(by_key["share:s0"].answers) == 1  # ShareGPT
    assert by_key["share:s_noanswer"].answers == []
    shuffled = load_prompts([files["gsm"], files["zlab"]], shuffle_seed=7, limit=5)
    again = load_prompts([files["gsm"], files["zlab"]], shuffle_seed=7, limit=5)
    assert [i.key for i in shuffled] == [i.key for i in again] and len(shuffled) == 5
    assert [i.key for i in shuffled] != [i.key for i in items[:5]]
    with pytest.raises(DataError, match="not found"):
        load_prompts([files["gsm"].parent / "missing.jsonl"])


# ------------------------------------------------------------------------------------------------ regeneration


def test_loss_mask_marks_exactly_the_greedy_answer(target, files, tmp_path):
    m = run(target, [files["gsm"], files["share"]], tmp_path)
    recs = records(tmp_path)
    items = load_prompts([files["gsm"], files["share"]])
    assert set(recs) == {it.key for it in items}
    eos = target.eos_token_ids
    stopped = 0
    for it in items:
        ids, mask = recs[it.key]
        prompt = target.encode_prompt(it.conversation.user_turns[0])
        answer = hf_greedy(target.model, prompt, MAX_NEW, eos)  # independent, unbatched
        n = prompt.shape[1]
        assert ids == prompt[0].tolist() + answer  # prompt ids + generated ids, nothing re-tokenised
        assert mask == [0] * n + [1] * len(answer)
        stopped += answer[-1] in eos
    assert 0 < stopped < len(items)  # both EOS-terminated and length-capped answers were checked
    c = m["counts"]
    assert c["prompts"] == c["sequences"] == len(items) and c["skipped"] == 0 and m["complete"]
    assert c["answer_tokens"] == sum(sum(mask) for _, mask in recs.values()) == c["generated_tokens"]
    assert m["settings"]["target"] == "tiny-llama" and m["sampling"]["greedy"]
    assert m["flashdraft_version"] and m["wall_time_s"] >= 0

    ds = TrainingData(tmp_path)
    assert len(ds) == len(items) and not ds.has_features and ds.manifest["counts"] == c
    item = ds[0]
    assert item["input_ids"].dtype == torch.long and item["loss_mask"].dtype == torch.bool
    assert item["input_ids"].shape == item["loss_mask"].shape and "features" not in item


def test_packed_data_equals_the_directory(target, files, tmp_path):
    """`flashdraft data pack` writes one compressed file that reads back as the same sequences, masks and manifest
    (what `train --data` sees); a wrong name or a damaged file is one line."""
    from typer.testing import CliRunner

    run(target, [files["gsm"], files["share"]], tmp_path / "d")
    runner = CliRunner()
    r = runner.invoke(data_app, ["pack", str(tmp_path / "d"), "--out", str(tmp_path / "p" / "set.npz")])
    assert r.exit_code == 0 and "sequences" in r.output, r.output
    plain, packed = TrainingData(tmp_path / "d"), TrainingData(tmp_path / "p" / "set.npz")
    assert packed.ids == plain.ids and packed.manifest == plain.manifest and len(packed) == len(plain) > 1
    assert packed.lengths == plain.lengths
    for a, b in zip(plain, packed, strict=True):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        assert b["input_ids"].dtype == torch.long and b["loss_mask"].dtype == torch.bool
    r = runner.invoke(data_app, ["pack", str(tmp_path / "d"), "--out", str(tmp_path / "set.zip")])
    assert r.exit_code == 1 and ".npz" in r.output and "Traceback" not in r.output
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    with pytest.raises(DataError, match="cannot read packed data"):
        TrainingData(tmp_path / "bad.npz")


def test_multi_turn_conditions_on_own_answers(target, files, tmp_path):
    run(target, [files["zlab"]], tmp_path, max_turns=2)
    recs = records(tmp_path)
    eos = target.eos_token_ids
    for it in load_prompts([files["zlab"]]):
        messages, expected = [], []
        for turn in it.conversation.user_turns:
            messages.append({"role": "user", "content": turn})
            answer = hf_greedy(target.model, target.encode_prompt(messages), MAX_NEW, eos)
            expected += answer
            text = target.tokenizer.decode([t for t in answer if t not in eos], skip_special_tokens=True)
            messages.append({"role": "assistant", "content": text})
        mine = [r for k, r in recs.items() if k == it.key or k.startswith(it.key + "/")]
        got = [t for ids, mask in mine for t, m in zip(ids, mask, strict=True) if m]
        assert got == expected
        # the last sequence ends with exactly the template of the whole conversation + the last answer
        ids, _ = mine[-1]
        assert ids == target.encode_prompt(messages[:-1])[0].tolist() + answer


def test_thinking_flag_and_system_reach_the_template(target, files, tmp_path):
    run(target, [files["gsm"]], tmp_path / "a", limit=1, thinking=False, system="w9 w9")
    ids, mask = records(tmp_path / "a")["gsm:0"]
    q = load_prompts([files["gsm"]])[0].conversation.user_turns[0]
    prompt = target.encode_prompt(q, enable_thinking=False, system="w9 w9")[0].tolist()
    assert ids[: len(prompt)] == prompt and "w0 w0" in target.tokenizer.decode(prompt)
    assert sum(mask) == len(ids) - len(prompt)


def test_resume_after_kill_equals_uninterrupted_run(target, files, tmp_path, monkeypatch):
    srcs = [files["gsm"], files["share"]]
    whole = run(target, srcs, tmp_path / "whole", chunk_size=4)

    real = data_mod._generate_batch
    calls = {"n": 0, "prompts": 0}

    def dying(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 4:  # inside the second chunk (2 batches per chunk of 4)
            raise KeyboardInterrupt
        calls["prompts"] += len(a[1])
        return real(*a, **kw)

    monkeypatch.setattr(data_mod, "_generate_batch", dying)
    with pytest.raises(KeyboardInterrupt):
        run(target, srcs, tmp_path / "resumed", chunk_size=4)
    first = records(tmp_path / "resumed")
    assert len(first) == 4  # only the finished chunk was kept
    assert not list((tmp_path / "resumed").glob(".*.tmp"))
    assert not json.loads((tmp_path / "resumed" / "manifest.json").read_text())["complete"]

    calls.update(n=-100, prompts=0)
    resumed = run(target, srcs, tmp_path / "resumed", chunk_size=4)
    assert calls["prompts"] == whole["counts"]["prompts"] - 4  # finished prompts were not regenerated
    assert records(tmp_path / "resumed") == records(tmp_path / "whole")
    for k in ("prompts", "sequences", "answer_tokens", "tokens", "skipped"):
        assert resumed["counts"][k] == whole["counts"][k]
    assert resumed["complete"]

    calls.update(prompts=0)  # a finished directory: nothing to do
    run(target, srcs, tmp_path / "resumed", chunk_size=4)
    assert calls["prompts"] == 0


def test_growing_the_limit_extends_the_data(target, files, tmp_path):
    run(target, [files["gsm"]], tmp_path, limit=3)
    m = run(target, [files["gsm"]], tmp_path, limit=6)
    assert m["counts"]["prompts"] == 6 and set(records(tmp_path)) == {f"gsm:{i}" for i in range(6)}


def test_manifest_mismatch_is_refused(target, files, tmp_path):
    run(target, [files["gsm"]], tmp_path, limit=2)
    with pytest.raises(DataError, match=r"different settings \(max_new_tokens: existing 10, requested 11\)"):
        run(target, [files["gsm"]], tmp_path, limit=2, max_new_tokens=11)
    with pytest.raises(DataError, match="sources"):
        run(target, [files["share"]], tmp_path, limit=2)
    with pytest.raises(DataError, match="temperature"):
        run(target, [files["gsm"]], tmp_path, limit=2, temperature=0.7)


def test_no_regenerate_uses_existing_answers(target, files, tmp_path):
    m = run(target, [files["gsm"], files["share"]], tmp_path, no_regenerate=True)
    assert m["settings"]["no_regenerate"] and not m["sampling"]["regenerated"]
    recs = records(tmp_path)
    eos = target.eos_token_ids[0]
    for it in load_prompts([files["gsm"], files["share"]]):
        if not it.conversation.answers:
            assert it.key not in recs
            continue
        ids, mask = recs[it.key]
        answer = target.tokenizer(it.conversation.answers[0], add_special_tokens=False)["input_ids"] + [eos]
        prompt = target.encode_prompt(it.conversation.user_turns[0])[0].tolist()
        assert ids == prompt + answer and mask == [0] * len(prompt) + [1] * len(answer)
    assert m["counts"]["skipped_by_reason"] == {"no_answer": 1} and m["counts"]["generated_tokens"] == 0


def test_prompt_suffix_is_appended_to_first_turn_and_recorded(target, files, tmp_path):
    from flashdraft.prompts.benchmarks import BOXED_SUFFIX
    from flashdraft.training.regenerate import resolve_prompt_suffix

    assert resolve_prompt_suffix("boxed") == BOXED_SUFFIX and resolve_prompt_suffix(" w5") == " w5"
    m = run(target, [files["gsm"]], tmp_path, no_regenerate=True, prompt_suffix=" w5 w6")
    assert m["settings"]["prompt_suffix"] == " w5 w6"
    recs = records(tmp_path)
    checked = 0
    for it in load_prompts([files["gsm"]]):
        if it.key in recs:
            ids, mask = recs[it.key]
            prompt = target.encode_prompt(it.conversation.user_turns[0] + " w5 w6")[0].tolist()
            assert ids[: len(prompt)] == prompt and mask[: len(prompt)] == [0] * len(prompt)
            checked += 1
    assert checked > 0
    with pytest.raises(DataError, match="prompt_suffix"):  # resuming with another suffix would mix formats
        run(target, [files["gsm"]], tmp_path, no_regenerate=True)


def test_long_prompts_are_skipped_and_sequences_capped(target, files, tmp_path):
    items = load_prompts([files["gsm"]])
    lens = [target.encode_prompt(it.conversation.user_turns[0]).shape[1] for it in items]
    max_length = sorted(lens)[len(lens) // 2]
    m = run(target, [files["gsm"]], tmp_path, max_length=max_length)
    too_long = sum(n >= max_length for n in lens)
    assert m["counts"]["skipped_by_reason"] == {"too_long": too_long} and too_long > 0
    recs = records(tmp_path)
    assert len(recs) == len(items) - too_long
    assert all(len(ids) <= max_length and sum(mask) >= 1 for ids, mask in recs.values())


def test_sampling_runs(target, files, tmp_path):
    m = run(target, [files["gsm"]], tmp_path, temperature=0.9, top_p=0.8)
    assert m["settings"]["temperature"] == 0.9 and m["settings"]["top_p"] == 0.8
    assert all(0 < sum(mask) <= MAX_NEW for _, mask in records(tmp_path).values())


# ------------------------------------------------------------------------------------------------ features


@pytest.mark.parametrize("same_dir", [True, False])
def test_features_equal_target_taps(target, files, tmp_path, same_dir):
    data_dir = tmp_path / "data"
    run(target, [files["gsm"]], data_dir)
    feat_dir = data_dir if same_dir else tmp_path / "feats"
    layers = [0, 2]
    tiny_mb = 5 * 2 * 64 * 2 / 2**20  # about 5 tokens per shard: several shards
    m = compute_features(target, data_dir, feat_dir, layers, torch.float16, progress=False, shard_mb=tiny_mb)
    assert m["layer_ids"] == layers and m["dtype"] == "float16" and m["complete"]
    assert m["counts"]["shards"] > 1

    ds = TrainingData(feat_dir)
    plain = TrainingData(data_dir, features=False)
    assert ds.has_features and len(ds) == len(plain) == 7
    for i in range(len(ds)):
        item = ds[i]
        ref = target.forward(item["input_ids"][None], target.new_cache(), tap_layer_ids=layers).features[0]
        assert item["features"].dtype == torch.float16 and item["features"].shape == (
            len(item["input_ids"]),
            128,
        )
        assert torch.equal(item["features"], ref.to(torch.float16))

    # resumable: drop the last shard, rerun, same tensors
    before = [ds[i]["features"].clone() for i in range(len(ds))]
    sorted(feat_dir.glob("features-*.safetensors"))[-1].unlink()
    with pytest.warns(UserWarning, match="cover"):
        assert len(TrainingData(feat_dir)) < 7
    compute_features(target, data_dir, feat_dir, layers, torch.float16, progress=False, shard_mb=tiny_mb)
    ds2 = TrainingData(feat_dir)
    assert all(torch.equal(ds2[i]["features"], before[i]) for i in range(len(ds2)))
    with pytest.raises(DataError, match="layer_ids"):
        compute_features(target, data_dir, feat_dir, [1], progress=False)
    with pytest.raises(DataError, match="out of range"):
        compute_features(target, data_dir, tmp_path / "bad", [7], progress=False)


# ------------------------------------------------------------------------------------------------ CLI


def test_cli(target, files, tmp_path):
    from typer.testing import CliRunner

    model_dir = tmp_path / "tiny"
    target.model.save_pretrained(model_dir)
    target.tokenizer.save_pretrained(model_dir)
    runner = CliRunner()
    out = tmp_path / "out"
    base = ["regenerate", "--target", str(model_dir), "--out", str(out), "--max-new-tokens", "6"]
    r = runner.invoke(data_app, [*base, "--prompts", str(files["gsm"]), "--limit", "2", "--no-thinking"])
    assert r.exit_code == 0, r.output
    assert json.loads((out / "manifest.json").read_text())["counts"]["prompts"] == 2

    r = runner.invoke(
        data_app, [*base, "--prompts", str(files["gsm"]), "--limit", "2", "--temperature", "0.5"]
    )
    assert r.exit_code == 1 and "different settings" in r.output and "Traceback" not in r.output
    r = runner.invoke(data_app, [*base, "--prompts", str(tmp_path / "nope.jsonl")])
    assert r.exit_code == 2 and "prompt file not found" in r.output
    r = runner.invoke(data_app, [*base, "--prompts", str(files["gsm"]), "--backend", "openai"])
    assert r.exit_code == 1 and "--base-url" in r.output and "Traceback" not in r.output
    # A server that is not there: one line, nothing written for the missing answers (resumable).
    r = runner.invoke(data_app, [*base[:-4], "--out", str(tmp_path / "remote"), "--prompts", str(files["gsm"]),
                                 "--backend", "openai", "--base-url", "http://127.0.0.1:9", "--retries", "0"])  # fmt: skip
    assert r.exit_code == 1 and "did not answer" in r.output and "resume" in r.output, r.output
    assert not list((tmp_path / "remote").glob("shard-*.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"foo": 1}\n')
    r = runner.invoke(
        data_app,
        ["regenerate", "--target", str(model_dir), "--out", str(tmp_path / "o2"), "--prompts", str(bad)],
    )
    assert r.exit_code == 1 and "no prompt found" in r.output and "Traceback" not in r.output
    r = runner.invoke(
        data_app, [*base, "--prompts", str(files["gsm"]), "--target", str(tmp_path / "no-model")]
    )
    assert r.exit_code == 1 and "cannot load target" in r.output

    feats = ["features", "--target", str(model_dir), "--data", str(out), "--out", str(tmp_path / "f")]
    r = runner.invoke(data_app, [*feats, "--layers", "1,x"])
    assert r.exit_code == 2 and "comma-separated" in r.output
    r = runner.invoke(data_app, [*feats, "--layers", "0,9"])
    assert r.exit_code == 1 and "out of range" in r.output
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text("{}")
    r = runner.invoke(data_app, [*feats, "--draft", str(draft)])
    assert r.exit_code == 2 and "Traceback" not in r.output
    r = runner.invoke(data_app, [*feats, "--layers", "0,2", "--dtype", "bfloat16"])
    assert r.exit_code == 0, r.output
    ds = TrainingData(tmp_path / "f")
    assert ds[0]["features"].dtype == torch.bfloat16 and ds.manifest["counts"]["prompts"] == 2


def test_stdlib_code_prompts_are_many_distinct_and_not_benchmarks(tmp_path):
    import gzip

    from typer.testing import CliRunner

    from flashdraft.cli.data import data_app
    from flashdraft.prompts.code import stdlib_code_prompts
    from flashdraft.prompts.files import load_conversations

    prompts = stdlib_code_prompts(seed=0)
    assert len(prompts) > 1000
    assert len({p["id"] for p in prompts}) == len({p["turns"][0] for p in prompts}) == len(prompts)
    assert all(p["turns"][0].startswith("Write a Python ") for p in prompts)
    assert stdlib_code_prompts(limit=20, seed=0) == prompts[:20]
    assert stdlib_code_prompts(limit=20, seed=1) != prompts[:20]
    # nothing of HumanEval (evaluation only) leaks in: none of its entry points is a prompted function name
    humaneval = (
        Path(__file__).resolve().parents[1] / "src" / "flashdraft" / "benchdata" / "humaneval.jsonl.gz"
    )
    with gzip.open(humaneval, "rt") as f:
        entry_points = {json.loads(line)["entry_point"] for line in f}
    prompted = {p["id"].rsplit(".", 1)[-1] for p in prompts}
    assert not entry_points & prompted
    out = tmp_path / "code.jsonl"
    result = CliRunner().invoke(data_app, ["code-prompts", "--out", str(out), "--limit", "50"])
    assert result.exit_code == 0, result.output
    conversations = list(load_conversations(out))
    assert len(conversations) == 50 and conversations[0].user_turns[0] == prompts[0]["turns"][0]


def test_openai_backend_regenerates_the_same_data_through_a_server(target, files, tmp_path):
    """`--backend openai` against `flashdraft serve` (same target): the same token ids and loss masks as the local
    path, with the server's own token ids; a server without them gets its text re-encoded, and the manifest says
    which way each answer came."""
    pytest.importorskip("fastapi")
    from flashdraft.serve import Engine, build_app
    from flashdraft.training.remote import OpenAIAnswerer

    prompt_files = [files["gsm"], files["zlab"]]
    run(target, prompt_files, tmp_path / "local", max_turns=2)
    local = records(tmp_path / "local")
    engine = Engine(target, None)
    try:
        with running_server(build_app(engine, "tiny-llama")) as base:
            answerer = OpenAIAnswerer(base, "tiny-llama", target.tokenizer, target.max_context, concurrency=3)
            m = run(target, prompt_files, tmp_path / "remote", max_turns=2, answerer=answerer)
            assert records(tmp_path / "remote") == local
            assert m["settings"]["backend"] == "openai" and m["backend"]["model"] == "tiny-llama"
            answers = sum(
                sum(1 for a, b in zip([0, *mask], mask, strict=False) if b and not a)
                for _, mask in local.values()
            )
            assert m["backend"]["answer_ids"] == {"server": answers}  # one per answered turn

            plain = OpenAIAnswerer(base, "tiny-llama", target.tokenizer, target.max_context, concurrency=2)
            plain.ask_token_ids = False  # as a server that only answers text
            run(target, [files["gsm"]], tmp_path / "text", answerer=plain)
            # Text loses what the server's detokeniser drops (special tokens inside an answer), and the stop is
            # known only as finish_reason "stop" (the first EOS id is appended): exactly that, and nothing else.
            specials, eos = set(target.tokenizer.all_special_ids), target.eos_token_ids
            for key, (ids, mask) in records(tmp_path / "text").items():
                local_ids, local_mask = local[key]
                n = local_mask.index(1)
                answer = local_ids[n:]
                want = [t for t in answer if t not in specials] + ([eos[0]] if answer[-1] in eos else [])
                assert ids == local_ids[:n] + want and mask == [0] * n + [1] * len(want)
            assert plain.answer_ids == {"re-encoded": len(load_prompts([files["gsm"]]))}

            with pytest.raises(Exception, match="refused a request"):  # a model the server does not serve
                OpenAIAnswerer(base, "gpt-9", target.tokenizer, 256)([[5, 6]], max_new_tokens=2, temperature=0,
                                                                      top_p=1.0, eos=[2])  # fmt: skip
    finally:
        engine.close()

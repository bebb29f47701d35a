"""`flashdraft bench`: metrics from hand-made step logs, a tiny end-to-end run of every method, the OpenAI backend
against a local fake server (with an error response and a slow one), and one-line errors for bad input."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path

import pytest
import torch

from conftest import running_server
from flashdraft import DFlashDraftModel
from flashdraft.bench import (
    README_END,
    README_START,
    BenchConfig,
    BenchError,
    LocalMethods,
    SampleRecord,
    ServerBenchConfig,
    acceptance_histogram,
    add_speedups,
    first_difference,
    mean_acceptance_length,
    parse_prometheus,
    per_slot_acceptance,
    percentile,
    run_bench,
    run_server_bench,
    speedup,
    summarize_records,
    update_readme,
    vllm_spec_stats,
)

SPECIALS = ["<unk>", "<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|end|>", "<mask>"]
WORDS = [f"w{i}" for i in range(84)]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


# ============================================================================================ metrics


def test_a_step_far_slower_than_its_turn_s_others_is_reported_as_a_stall():
    from flashdraft.bench.metrics import stalls

    def record(turn: int, steps: list[float]) -> SampleRecord:
        return SampleRecord(dataset="d", conversation_id="c", turn=turn, method="dflash", prompt_tokens=5,
                            new_tokens=len(steps) + 1, ttft_s=0.01, decode_s=sum(steps), decode_tokens=len(steps),
                            step_tokens=[1] * len(steps), step_s=steps)  # fmt: skip

    compiled_mid_answer = record(0, [0.003] * 40 + [9.2] + [0.003] * 20)
    slow_but_steady = record(1, [0.4, 0.5, 0.45])  # a slow machine, no step stands out
    short_spike = record(2, [0.003] * 10 + [0.1])  # 33x the median, but a tenth of a second: noise
    found = stalls([slow_but_steady, compiled_mid_answer, short_spike, record(3, [])])
    assert [(x["turn"], x["slowest_step"]) for x in found] == [(0, 40)]
    assert found[0]["slowest_step_s"] == 9.2 and found[0]["median_step_s"] == 0.003
    assert (
        compiled_mid_answer.to_dict()["slowest_step"] == 40 and "step_s" not in compiled_mid_answer.to_dict()
    )
    assert (
        compiled_mid_answer.to_dict(with_outputs=True)["step_s"][40] == 9.2
    )  # --save-outputs keeps each step


def test_tau_histogram_and_slot_acceptance_from_hand_made_logs():
    # Five verify steps of a block-4 drafter (3 drafts each, 2 in the last one, cut by max_new_tokens).
    draft_lengths = [3, 3, 3, 3, 2]
    accepted_drafts = [3, 0, 1, 2, 2]
    emitted = [4, 1, 2, 3, 2]  # accepted + bonus; the last step was cut to 2 tokens

    assert mean_acceptance_length(emitted) == pytest.approx(12 / 5)
    assert mean_acceptance_length([]) is None
    assert acceptance_histogram(emitted, max_length=4) == [0, 1, 2, 1, 1]
    assert acceptance_histogram([1, 1, 6], max_length=4) == [0, 2, 0, 0, 0, 0, 1]  # grows past max_length

    slots = per_slot_acceptance(draft_lengths, accepted_drafts)
    assert [s["slot"] for s in slots] == [1, 2, 3]
    # slot 1: every step reached it, 4 of 5 accepted it.
    assert (slots[0]["reached"], slots[0]["accepted"], slots[0]["rate"]) == (5, 4, pytest.approx(0.8))
    # slot 2: reached by the 4 steps that accepted slot 1, accepted by 3 of them; vLLM-style 3 of 5 proposals.
    assert (slots[1]["reached"], slots[1]["accepted"]) == (4, 3)
    assert slots[1]["rate"] == pytest.approx(0.75)
    assert slots[1]["unconditional_rate"] == pytest.approx(0.6)
    # slot 3: proposed by 4 steps, reached by the 2 that accepted slots 1-2, accepted by 1.
    assert (slots[2]["proposed"], slots[2]["reached"], slots[2]["accepted"]) == (4, 2, 1)
    assert slots[2]["rate"] == pytest.approx(0.5)
    assert slots[2]["unconditional_rate"] == pytest.approx(0.25)
    assert per_slot_acceptance([], []) == []
    with pytest.raises(ValueError):
        per_slot_acceptance([3], [])


def _record(method: str, ttft: float, decode_s: float, decode_tokens: int, steps=(), **kw) -> SampleRecord:
    return SampleRecord(
        dataset="d",
        conversation_id="c",
        turn=0,
        method=method,
        prompt_tokens=5,
        new_tokens=decode_tokens + 1,
        ttft_s=ttft,
        decode_s=decode_s,
        decode_tokens=decode_tokens,
        step_tokens=list(steps),
        **kw,
    )


def test_speedup_tpot_ttft_from_hand_made_records():
    by_method = {
        "ar": summarize_records(
            [_record("ar", 0.1, 1.0, 10, [1] * 10), _record("ar", 0.1, 2.0, 10, [1] * 10)]
        ),
        "hf": summarize_records([_record("hf", 0.2, 0.5, 10), _record("hf", 0.2, 1.5, 10)]),
        "dflash": summarize_records(
            [
                _record(
                    "dflash", 0.3, 0.25, 10, [4, 4, 2], draft_lengths=[3, 3, 3], accepted_drafts=[3, 3, 1]
                ),
                _record(
                    "dflash", 0.3, 0.5, 10, [3, 3, 4], draft_lengths=[3, 3, 3], accepted_drafts=[2, 2, 3]
                ),
            ],
            block_size=4,
        ),
    }
    add_speedups(by_method)
    ar, hf, df = by_method["ar"], by_method["hf"], by_method["dflash"]
    assert ar["tpot_s"] == pytest.approx(0.15)  # mean of 0.1 and 0.2 s/token
    assert df["tpot_s"] == pytest.approx(0.0375)
    assert hf["tpot_s"] == pytest.approx(0.1)
    assert df["speedup_vs_ar"] == pytest.approx(4.0)
    assert df["speedup_vs_hf"] == pytest.approx(0.1 / 0.0375)
    assert hf["speedup_vs_ar"] == pytest.approx(1.5)
    assert ar["speedup_vs_ar"] == pytest.approx(1.0)
    assert ar["ttft_s"] == pytest.approx(0.1) and df["ttft_s"] == pytest.approx(0.3)
    assert ar["tokens_per_s"] == pytest.approx(22 / 3.2)  # every new token over TTFT + decode
    assert df["throughput_speedup_vs_ar"] == pytest.approx((22 / 1.35) / (22 / 3.2))
    assert ar["tau"] == pytest.approx(1.0)
    assert df["tau"] == pytest.approx(20 / 6)
    assert df["acceptance_histogram"] == [0, 0, 1, 2, 3]
    assert [s["rate"] for s in df["slot_acceptance"]] == pytest.approx(
        [1.0, 5 / 6, 3 / 5]
    )  # accepted 3,3,1,2,2,3
    assert "slot_acceptance" not in ar
    assert speedup(None, 0.1) is None and speedup(0.2, 0.1) == pytest.approx(2.0)
    assert percentile([4, 1, 3, 2], 50) == pytest.approx(2.5)
    assert percentile([1, 2, 3, 4], 90) == pytest.approx(3.7)
    assert percentile([], 50) is None
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_vllm_counters_before_after():
    def exposition(drafts, draft_tokens, accepted, per_pos):
        lines = [
            "# TYPE vllm:spec_decode_num_drafts counter",
            f'vllm:spec_decode_num_drafts_total{{engine="0",model_name="m"}} {drafts}',
            f'vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="m"}} {draft_tokens}',
            f'vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="m"}} {accepted}',
        ]
        lines += [
            f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="{i}"}} {v}'
            for i, v in enumerate(per_pos)
        ]
        return "\n".join(lines) + "\n"

    before = parse_prometheus(exposition(10, 30, 12, [6, 4, 2]))
    after = parse_prometheus(exposition(20, 60, 27, [14, 9, 4]))
    stats = vllm_spec_stats(before, after)
    assert (
        stats["num_drafts"] == 10 and stats["num_draft_tokens"] == 30 and stats["num_accepted_tokens"] == 15
    )
    assert stats["tau"] == pytest.approx(2.5)
    assert stats["draft_acceptance_rate"] == pytest.approx(0.5)
    assert stats["per_position_rate"] == pytest.approx([0.8, 0.5, 0.2])
    assert stats["per_position_conditional_rate"] == pytest.approx([0.8, 5 / 8, 2 / 5])
    assert vllm_spec_stats(after, after) is None  # nothing drafted in between
    assert vllm_spec_stats(None, None) is None


# ============================================================================================ tiny models


def _save_tiny_model(path: Path, tokenizer, seed: int, layers: int) -> None:
    import transformers as tf

    config = tf.LlamaConfig(
        vocab_size=len(SPECIALS) + len(WORDS),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.1,  # well-separated logits: no argmax near-ties between code paths
        tie_word_embeddings=False,
        pad_token_id=1,
        bos_token_id=2,
        eos_token_id=3,
    )
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 4-layer target, a 2-layer assistant sharing its tokenizer, and an untrained block-4 drafter, on disk."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("tiny")
    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(SPECIALS + WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=SPECIALS[4:],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    _save_tiny_model(root / "target", tokenizer, seed=0, layers=4)
    _save_tiny_model(root / "assistant", tokenizer, seed=1, layers=2)
    draft = DFlashDraftModel.for_target(
        AutoConfig.from_pretrained(root / "target"), num_layers=1, block_size=4, mask_token_id=7, seed=0
    )
    draft.save_pretrained(root / "draft")
    rows = [
        {"id": "two-turns", "turns": ["w1 w2 w3 w4 w5 w6", "w7 w8 w9"]},
        {"id": "one-turn", "turns": ["w10 w11 w12 w13 w10 w11 w12 w13"]},
    ]
    (root / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def test_bench_end_to_end_every_method(tiny, tmp_path):
    out = tmp_path / "run"
    cfg = BenchConfig(
        target=str(tiny / "target"),
        draft=str(tiny / "draft"),
        assistant=str(tiny / "assistant"),
        # The shipped gsm8k too: the tiny tokenizer maps its words to <unk>, which is fine for timing plumbing.
        datasets=[str(tiny / "chat.jsonl"), "gsm8k"],
        methods=["hf", "dflash", "dflash-fixed", "sd", "pld"],  # ar is added as the reference
        max_samples=2,
        max_new_tokens=10,
        out_dir=out,
        threads=1,  # tiny matrices: one thread is fastest, and the machine may be shared
        show_progress=False,
    )
    results = run_bench(cfg)

    methods = ["ar", "hf", "dflash", "dflash-fixed", "sd", "pld"]
    assert results["settings"]["methods"] == methods
    turns = 3 + 2  # chat: 2 + 1 turns; gsm8k: 2 problems
    assert len(results["samples"]) == turns * len(methods)
    assert list(results["summary"]) == ["chat", "gsm8k", "all"]
    eq = results["equality"]
    assert eq["checked"] and eq["compared"] == turns * (len(methods) - 1)
    assert eq["mismatches"] == 0, eq["details"]
    assert all(s["matches_reference"] for s in results["samples"] if s["method"] != "ar")

    summary = results["summary"]["all"]
    assert set(summary) == set(methods)
    for method, s in summary.items():
        assert s["samples"] == turns and s["new_tokens"] == summary["ar"]["new_tokens"]
        assert s["ttft_s"] > 0 and s["tpot_s"] > 0 and s["tokens_per_s"] > 0
        assert s["speedup_vs_ar"] > 0 and s["speedup_vs_hf"] > 0, method
    assert summary["ar"]["tau"] == 1.0 and summary["hf"]["tau"] == 1.0
    # dflash-fixed verifies the drafter's whole block (4) every step: 3 slots, one histogram entry per step
    fixed = summary["dflash-fixed"]
    assert 1.0 <= fixed["tau"] <= 4.0
    assert len(fixed["slot_acceptance"]) == 3 and sum(fixed["acceptance_histogram"]) == fixed["steps"]
    assert set(fixed["verify_length_histogram"]) <= {"0", "1", "2", "3"}
    # dflash is cost-aware: what it verifies depends on the costs measured here; it ran from a recorded cost model
    assert 1.0 <= summary["dflash"]["tau"] <= 4.0
    assert results["settings"]["verify"] == "auto" and results["settings"]["cost_model"]["lengths"][0] == 1
    for sample in results["samples"]:  # each engine step timed: the slowest and the median kept per turn
        if sample["method"] in ("ar", "dflash", "dflash-fixed") and sample["decode_tokens"]:
            assert 0 < sample["median_step_s"] <= sample["slowest_step_s"] <= sample["decode_s"]
            assert 0 <= sample["slowest_step"] < len(sample["step_tokens"]), sample
        else:  # transformers' methods are not timed per step
            assert "slowest_step_s" not in sample
    ar_samples = [s for s in results["samples"] if s["method"] == "ar"]
    # The second turn is conditioned on the first answer: its prompt holds the first prompt and the answer.
    first, second = ar_samples[0], ar_samples[1]
    assert (first["turn"], second["turn"]) == (0, 1)
    assert second["prompt_tokens"] > first["prompt_tokens"] + 3

    for name in ("results.json", "report.md", "tau_histogram.png", "slot_acceptance.png", "speedup.png"):
        assert (out / name).stat().st_size > 0, name
    saved = json.loads((out / "results.json").read_text())
    assert saved["machine"]["torch"] == torch.__version__ and saved["machine"]["cpu"]
    assert saved["settings"]["transformers_generation"]["prompt_lookup_num_tokens"] == 10
    assert saved["settings"]["transformers_generation"]["num_assistant_tokens"] == 20
    report = (out / "report.md").read_text()
    assert "All 25 outputs are token-for-token identical to `ar`" in report
    assert "## gsm8k" in report and "| dflash |" in report and "Per-slot acceptance" in report

    # --readme writes the tables between the markers of a README, leaving the rest alone.
    readme = tmp_path / "README.md"
    readme.write_text(f"# Benchmarks\n\nintro\n\n{README_START}\nold table\n{README_END}\n\nfooter\n")
    update_readme(readme, results)
    text = readme.read_text()
    assert "old table" not in text and text.startswith("# Benchmarks\n\nintro") and text.endswith("footer\n")
    assert "| gsm8k | dflash |" in text and "| all | pld |" in text and "25 of 25 outputs identical" in text
    assert "(run/report.md)" in text and "![speedup](run/speedup.png)" in text


def test_sampled_bench_compares_the_seed_exact_methods(tiny, tmp_path):
    """At T>0 dflash draws ar's tokens for the same seed (seed-keyed sampling), so the bench compares it with ar and
    finds every output equal; dflash-pq (rejection sampling) and transformers' sampling are not compared."""
    cfg = BenchConfig(
        target=str(tiny / "target"),
        draft=str(tiny / "draft"),
        datasets=[str(tiny / "chat.jsonl")],
        methods=["ar", "hf", "dflash", "dflash-pq"],
        temperature=1.0,
        max_samples=2,
        max_new_tokens=12,
        out_dir=tmp_path,
        plots=False,
        threads=1,
        show_progress=False,
    )
    results = run_bench(cfg)
    eq, summary = results["equality"], results["summary"]["chat"]
    assert eq["checked"] and eq["temperature"] == 1.0 and eq["mismatches"] == 0, eq["details"]
    assert summary["dflash"]["compared"] == 3 and eq["compared"] == 3
    assert summary["dflash-pq"]["compared"] == 0 and summary["hf"]["compared"] == 0
    report = (tmp_path / "report.md").read_text()
    assert "All 3 outputs are token-for-token identical to `ar` (sampled at T=1" in report
    assert "| dflash-pq |" in report and "not compared (sampled)" in report


def test_mismatch_is_counted_and_shown(tiny, tmp_path, monkeypatch):
    original = LocalMethods.run

    def corrupt_pld(self, method, input_ids, max_new_tokens, seed, *rest):
        out = original(self, method, input_ids, max_new_tokens, seed, *rest)
        if method == "pld":
            out.new_ids = out.new_ids[:2] + [(out.new_ids[2] + 1) % 90] + out.new_ids[3:]
        return out

    monkeypatch.setattr(LocalMethods, "run", corrupt_pld)
    cfg = BenchConfig(
        target=str(tiny / "target"),
        datasets=[str(tiny / "chat.jsonl")],
        methods=["ar", "pld"],
        max_samples=1,
        max_new_tokens=6,
        out_dir=tmp_path,
        plots=False,
        threads=1,
        show_progress=False,
        seed=3,
    )
    results = run_bench(cfg)
    eq = results["equality"]
    assert eq["mismatches"] == eq["compared"] >= 1
    assert eq["details"][0]["method"] == "pld" and eq["details"][0]["first_mismatch"] == 2
    assert results["summary"]["chat"]["pld"]["mismatches"] == eq["mismatches"]
    # a token the target never chose there: the plain margin is far beyond the rounding, so it is no near-tie
    flip = eq["details"][0]
    assert flip["verdict"] == "unexplained" and flip["plain_margin"] > flip["path_difference"], flip
    assert flip["plain_argmax"] == flip["reference_ids"][2]
    report = (tmp_path / "report.md").read_text()
    assert "MISMATCH" in report and f"{eq['mismatches']} of {eq['compared']} outputs differ" in report
    n = eq["mismatches"]
    assert f"0 of {n} are **near-ties** and **{n} unexplained**" in report and "| unexplained |" in report


def test_a_flip_between_tied_tokens_is_a_near_tie():
    """The near-tie test itself: a method token whose logit equals the reference token's (two identical rows of the
    LM head) is a near-tie; the least likely token is not, in fp32 and in bf16 alike. The plain logits are those of
    a replay of plain decoding, so the reference token is their argmax."""
    from types import SimpleNamespace

    from conftest import tiny_model
    from flashdraft.bench.mismatches import NEAR_TIE, UNEXPLAINED, plain_logits_at, weigh_flips
    from flashdraft.targets.target import Target

    for dtype in (torch.float32, torch.bfloat16):
        model = tiny_model("llama", seed=1).to(dtype)
        target = Target(model)
        prompt, shared = torch.tensor([[5, 9, 13, 2, 7, 11]]), [4, 8, 30]
        step = plain_logits_at(target, prompt, shared + [0], [len(shared)])[len(shared)]
        top, low = int(step.argmax()), int(step.argmin())
        record = SimpleNamespace(first_mismatch=len(shared))
        short = SimpleNamespace(
            first_mismatch=len(shared) + 1
        )  # ends where the reference goes on: not weighed
        far, ended = weigh_flips(
            target, prompt, [*shared, top, 1], [(record, [*shared, low]), (short, [])], 4
        )
        assert far["verdict"] == UNEXPLAINED and far["plain_argmax"] == top and far["plain_margin"] > 0, far
        assert ended is None
        with torch.no_grad():
            model.lm_head.weight[low] = model.lm_head.weight[top]
        (tied,) = weigh_flips(target, prompt, [*shared, top], [(record, [*shared, low])], 4)
        assert tied["verdict"] == NEAR_TIE and tied["plain_margin"] == 0, tied


# ============================================================================================ bad input


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--target", "x", "--methods", "ar,eagle"], "unknown method(s) eagle"),
        (["--target", "x", "--methods", "ar,dflash"], "dflash needs a drafter"),
        (["--target", "x", "--methods", "ar,sd"], "--assistant"),
        (["--methods", "ar"], "--target is required"),
        (["--target", "x", "--methods", "ar", "--dataset", "no-such-set"], "no-such-set"),
        (["--backend", "openai", "--base-url", "http://127.0.0.1:1", "--dataset", "gsm8k"], "cannot reach"),
        (["--backend", "openai", "--dataset", "gsm8k"], "--base-url"),
        (["--backend", "openai", "--base-url", "http://x", "--concurrency", "1,zero"], "--concurrency"),
    ],
)
def test_bad_input_is_one_line_error(args, message, tmp_path):
    from typer.testing import CliRunner

    from flashdraft.cli import app

    result = CliRunner().invoke(app, ["bench", *args, "--max-samples", "1", "--out", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert message in " ".join(result.output.split()), result.output


# ============================================================================================ OpenAI backend

SLOW_S = 0.5


def _fake_openai_app():
    """Answers 5 words (fewer if max_tokens says so); 'FAIL' in the prompt -> HTTP 500, 'SLOW' -> SLOW_S late.

    Like SGLang it adds `meta_info`; like vLLM it counts spec_decode in /metrics (2 drafts of 4 tokens with 5
    accepted per request, so τ = 1 + 5/2 = 3.5 whatever the number of requests)."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.routing import Route

    # in_flight: requests being answered now; arrivals: how many others were in flight as each one arrived
    state = {"requests": 0, "bodies": [], "auth": set(), "in_flight": 0, "arrivals": []}

    def metrics_text() -> str:
        n = state["requests"]
        per_pos = [2 * n, 2 * n, n]
        lines = [
            f'vllm:spec_decode_num_drafts_total{{model_name="fake"}} {2 * n}',
            f'vllm:spec_decode_num_draft_tokens_total{{model_name="fake"}} {8 * n}',
            f'vllm:spec_decode_num_accepted_tokens_total{{model_name="fake"}} {5 * n}',
        ]
        lines += [
            f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="fake",position="{i}"}} {v}'
            for i, v in enumerate(per_pos)
        ]
        return "\n".join(lines) + "\n"

    async def list_models(request):
        return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def metrics(request):
        return PlainTextResponse(metrics_text())

    async def respond(body: dict, chat: bool):
        state["arrivals"].append(state["in_flight"])
        state["in_flight"] += 1
        response = await answer(body, chat)
        if not isinstance(response, StreamingResponse):
            state["in_flight"] -= 1
            return response
        events = response.body_iterator

        async def counted():  # a stream is in flight until its last event is sent
            try:
                async for event in events:
                    yield event
            finally:
                state["in_flight"] -= 1

        response.body_iterator = counted()
        return response

    async def answer(body: dict, chat: bool):
        state["bodies"].append(body)
        prompt = json.dumps(body.get("messages") or body.get("prompt"))
        if "FAIL" in prompt:
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        if "SLOW" in prompt:
            await asyncio.sleep(SLOW_S)
        state["requests"] += 1
        words = [f"ans{i}" for i in range(min(5, int(body.get("max_tokens", 5))))]
        meta = {"spec_accept_length": 2.5, "spec_verify_ct": 2, "completion_tokens": len(words)}
        usage = {"prompt_tokens": 7, "completion_tokens": len(words), "total_tokens": 7 + len(words)}
        if not body.get("stream"):
            choice = {"index": 0, "finish_reason": "length"}
            choice.update(
                {"message": {"role": "assistant", "content": " ".join(words)}}
                if chat
                else {"text": " ".join(words)}
            )
            return JSONResponse({"id": "x", "choices": [choice], "usage": usage, "meta_info": meta})

        async def events():
            for i, w in enumerate(words):
                await asyncio.sleep(0.002)
                text = w if i == 0 else " " + w
                choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
                yield f"data: {json.dumps({'choices': [choice]})}\n\n"
            yield f"data: {json.dumps({'choices': [], 'usage': usage, 'meta_info': meta})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def chat_completions(request):
        state["auth"].add(request.headers.get("authorization"))
        return await respond(await request.json(), chat=True)

    async def completions(request):
        return await respond(await request.json(), chat=False)

    app = Starlette(
        routes=[
            Route("/v1/models", list_models),
            Route("/metrics", metrics),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
        ]
    )
    app.state.fake = state
    return app


@pytest.fixture(scope="module")
def fake_server():
    app = _fake_openai_app()
    with running_server(app) as base:
        yield base, app.state.fake


@pytest.fixture
def server_dataset(tmp_path):
    rows = [
        {"id": "a", "turns": ["first question", "second question"]},
        {"id": "fail", "turns": ["please FAIL now"]},
        {"id": "slow", "turns": ["a SLOW one"]},
        {"id": "b", "turns": ["another question"]},
    ]
    path = tmp_path / "server.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_openai_backend_streaming_sweep(fake_server, server_dataset, tmp_path):
    url, state = fake_server
    cfg = ServerBenchConfig(
        base_url=url + "/v1",  # a /v1 suffix is accepted too
        datasets=[str(server_dataset)],
        concurrency=[1, 4],
        max_new_tokens=5,
        timeout_s=10,
        api_key="sk-test",
        out_dir=tmp_path,
        show_progress=False,
    )
    first = len(state["arrivals"])
    results = run_server_bench(cfg)
    assert results["settings"]["model"] == "fake-model"  # taken from /v1/models
    levels = results["levels"]
    assert [lv["concurrency"] for lv in levels] == [1, 4]
    for lv in levels:
        assert lv["requests"] == 5 and lv["ok"] == 4 and lv["errors"] == 1
        assert any("HTTP 500" in m for m in lv["error_messages"])
        assert lv["output_tokens"] == 4 * 5 and not lv["tokens_estimated"]
        assert lv["output_tokens_per_s"] > 0
        assert lv["latency_s"]["max"] >= SLOW_S  # the slow request is measured, not dropped
        # the first token is timed when it comes, not with the answer (4 more events follow it)
        assert lv["ttft_s"]["p50"] is not None and lv["ttft_s"]["p50"] < lv["latency_s"]["p50"]
        assert lv["sglang"]["mean_spec_accept_length"] == pytest.approx(2.5)
        assert lv["sglang"]["tau_from_verify_ct"] == pytest.approx(2.5)
        assert lv["vllm"]["tau"] == pytest.approx(3.5)
        assert lv["vllm"]["per_position_rate"] == pytest.approx([1.0, 1.0, 0.5])
    # Concurrency as the server saw it: after the warm-up, one request at a time at concurrency 1 (5 requests),
    # then the slow request overlapped by the others at concurrency 4.
    warmup, one, four = (
        state["arrivals"][first],
        state["arrivals"][first + 1 : first + 6],
        state["arrivals"][first + 6 :],
    )
    assert warmup == 0 and one == [0] * 5 and len(four) == 5 and max(four) >= 1
    # The second turn carries the server's own first answer.
    second_turns = [b for b in state["bodies"] if len(b.get("messages", [])) == 3]
    assert second_turns and second_turns[-1]["messages"][1] == {
        "role": "assistant",
        "content": "ans0 ans1 ans2 ans3 ans4",
    }
    assert second_turns[-1]["stream"] is True and second_turns[-1]["model"] == "fake-model"
    report = (tmp_path / "report.md").read_text()
    assert "HTTP 500" in report and "vLLM spec_decode counters" in report and "| 4 | 4 / 5 |" in report
    assert (tmp_path / "server_throughput.png").stat().st_size > 0
    saved = json.loads((tmp_path / "results.json").read_text())
    assert len(saved["requests"]) == 10
    assert state["auth"] == {"Bearer sk-test"} and "sk-test" not in (tmp_path / "results.json").read_text()


def test_openai_backend_completion_no_stream_and_timeout(fake_server, server_dataset, tmp_path):
    url, _ = fake_server
    cfg = ServerBenchConfig(
        base_url=url,
        model="fake-model",
        datasets=[str(server_dataset)],
        concurrency=[2],
        api="completion",
        stream=False,
        max_new_tokens=3,
        timeout_s=SLOW_S / 3,  # the slow request times out; the others do not
        out_dir=tmp_path,
        plots=False,
        show_progress=False,
    )
    results = run_server_bench(cfg)
    (lv,) = results["levels"]
    assert lv["ok"] == 3 and lv["errors"] == 2
    assert any("timeout" in m for m in lv["error_messages"]) and any(
        "HTTP 500" in m for m in lv["error_messages"]
    )
    assert lv["output_tokens"] == 3 * 3 and lv["ttft_s"] is None  # no TTFT without streaming
    assert "timeout" in (tmp_path / "report.md").read_text()


def test_openai_backend_unreachable(server_dataset, tmp_path):
    # bound and never listening: a connection to its port is refused, and no other process can take it meanwhile
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    cfg = ServerBenchConfig(
        base_url=f"http://127.0.0.1:{closed.getsockname()[1]}",
        datasets=[str(server_dataset)],
        timeout_s=5,
        out_dir=tmp_path,
        show_progress=False,
    )
    with closed, pytest.raises(BenchError, match="cannot reach the server"):
        run_server_bench(cfg)

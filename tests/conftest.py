"""Tiny random targets of several families, and a test-double proposer with controlled accuracy."""

from __future__ import annotations

import os
import random
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager

import pytest
import torch

from flashdraft import Proposer

# Cost models measured by tests (block_size="auto") stay out of the user's cache.
os.environ.setdefault("FLASHDRAFT_COST_CACHE", tempfile.mkdtemp(prefix="flashdraft-costs-"))

# Tiny models gain nothing from intra-op threads, and a shared 2-core machine punishes oversubscription.
torch.set_num_threads(1)

VOCAB = 96


def _common(vocab: int) -> dict:
    """The sizes every tiny model shares; initializer_range is large so logits are well separated (no argmax
    near-ties)."""
    return dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.1,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


# ------------------------------------------------------------------------------------ CPU kernels: skip or fail
REQUIRE_KERNELS = os.environ.get("FLASHDRAFT_REQUIRE_KERNELS") == "1"


def cpu_flags() -> set[str]:
    """The CPU's instruction-set flags as Linux lists them (those a kernel may use: `kernels.cpu_info`)."""
    from flashdraft.kernels.cpu_info import cpu_features

    return set(cpu_features().split()[1:])


def has_features(needs: str) -> bool:
    """`needs`: CPU flags, all of the space-separated ones, any of those joined by `|` ("avx512_vnni avx512_bf16",
    "avx512_bf16|amx_bf16")."""
    flags = cpu_flags()
    return all(any(alt in flags for alt in group.split("|")) for group in needs.split())


def skip_without_kernel(available: bool, needs: str, what: str) -> None:
    """Skip a test whose CPU kernel does not serve here, the reason naming the features it needs. With
    `FLASHDRAFT_REQUIRE_KERNELS=1` (CI sets it), a CPU that has those features fails the test instead: a kernel
    that should serve on this CPU and does not (a failed build, a wrong gate) is a defect, never a quiet skip."""
    if available:
        return
    if REQUIRE_KERNELS and has_features(needs):
        pytest.fail(
            f"{what}: this CPU has {needs}, yet the kernel does not serve (FLASHDRAFT_REQUIRE_KERNELS=1)"
        )
    pytest.skip(f"{what} needs {needs}")


def needs_kernel(available: Callable[[], bool], needs: str, what: str) -> pytest.MarkDecorator:
    """`skip_without_kernel` as a mark, `available` asked when the test starts (not at collection)."""
    return pytest.mark.kernel(available, needs, what)


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers", "kernel(available, needs, what): a CPU kernel test (conftest.needs_kernel)"
    )


def pytest_runtest_setup(item) -> None:
    for mark in item.iter_markers("kernel"):
        available, needs, what = mark.args
        skip_without_kernel(bool(available()), needs, what)


def tiny_config(arch: str, vocab: int = VOCAB, layers: int = 6, **overrides):
    """A small random config of an attention-only family."""
    import transformers as tf

    common = dict(_common(vocab), num_hidden_layers=layers, **overrides)
    if arch == "llama":
        return tf.LlamaConfig(**common)
    if arch == "qwen2":
        return tf.Qwen2Config(**common)
    if arch == "qwen3":
        return tf.Qwen3Config(head_dim=16, **common)
    if arch == "mistral":
        return tf.MistralConfig(sliding_window=None, **common)
    if arch == "gemma3":
        return tf.Gemma3TextConfig(
            **{"head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 16, **common}
        )
    raise ValueError(arch)


ARCHS = ["llama", "qwen2", "qwen3", "mistral", "gemma3"]


def hybrid_config(arch: str, vocab: int = VOCAB):
    """Tiny hybrid / recurrent configs: recurrent (GatedDeltaNet, Mamba, Mamba2) or conv layers beside attention."""
    import transformers as tf

    common = _common(vocab)
    gdn = dict(
        num_hidden_layers=4,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    )
    moe = dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32
    )
    if arch == "qwen3_5":
        return tf.Qwen3_5TextConfig(**gdn, **common)
    if arch == "qwen3_5_moe":
        return tf.Qwen3_5MoeTextConfig(**gdn, **moe, **common)
    if arch == "qwen3_next":
        return tf.Qwen3NextConfig(**gdn, **moe, **common)
    if arch == "jamba":
        common.pop("max_position_embeddings")
        return tf.JambaConfig(
            num_hidden_layers=4,
            attn_layer_period=2,
            attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=1,
            num_experts=2,
            mamba_d_state=8,
            mamba_dt_rank=8,
            **common,
        )
    if arch == "falcon_h1":
        return tf.FalconH1Config(
            num_hidden_layers=3,
            head_dim=16,
            mamba_d_ssm=64,
            mamba_n_heads=4,
            mamba_d_head=16,
            mamba_n_groups=1,
            mamba_d_state=8,
            mamba_chunk_size=8,
            **common,
        )
    if arch == "mamba2":
        for k in (
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
        ):
            common.pop(k)
        return tf.Mamba2Config(
            num_hidden_layers=3,
            state_size=8,
            expand=2,
            head_dim=16,
            num_heads=8,
            n_groups=1,
            chunk_size=8,
            **common,
        )
    if arch == "lfm2":
        return tf.Lfm2Config(
            num_hidden_layers=4, layer_types=["conv", "conv", "full_attention", "conv"], **common
        )
    if arch in SHRUNK_ARCHS:
        return _shrunk_config(arch, common)
    raise ValueError(arch)


# Other hybrid families: their default config with every width shrunk, first 4 layers.
SHRUNK_ARCHS = ["nemotron_h", "olmo_hybrid", "zaya", "lfm3"]


def _shrunk_config(model_type: str, common: dict):
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)
    small = dict(
        common,
        head_dim=16,
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_d_state=8,
        mamba_n_groups=1,
        mamba_chunk_size=8,
        mamba_expand=2,
        state_size=8,
        expand=2,
        num_heads=8,
        n_groups=1,
        chunk_size=8,
        ssm_state_size=8,
        mamba_num_heads=8,
        mamba_head_dim=16,
        moe_intermediate_size=32,
        num_experts=4,
        num_local_experts=4,
        num_experts_per_tok=2,
        n_routed_experts=4,
        shared_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_hidden_layers=4,
    )
    for key, value in small.items():
        if hasattr(config, key):
            setattr(config, key, value)
    for key in ("layer_types", "layers_block_type", "hybrid_override_pattern"):
        value = getattr(config, key, None)
        if isinstance(value, (list, str)) and len(value) > 4:
            setattr(config, key, value[:4])
    return config


HYBRID_ARCHS = ["qwen3_5", "qwen3_5_moe", "qwen3_next", "jamba", "falcon_h1", "mamba2", "lfm2", *SHRUNK_ARCHS]


def hybrid_model(arch: str, seed: int = 0):
    """A tiny random hybrid model (initializer_range 0.1, as the attention-only ones)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hybrid_config(arch))
    return model.eval()


def tiny_model(arch: str, seed: int = 0, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides), attn_implementation="sdpa")
    return model.eval()


@pytest.fixture(scope="session")
def models():
    """One tiny random model per architecture, shared by the session."""
    return {arch: tiny_model(arch, seed=i) for i, arch in enumerate(ARCHS)}


def hf_greedy(model, ids: torch.Tensor, max_new_tokens: int, eos: list[int] | None) -> list[int]:
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos or None,
        pad_token_id=0,
        top_k=None,
        top_p=None,
        temperature=None,
    )
    new = out[0, ids.shape[1] :].tolist()
    if eos:  # generate pads after EOS; cut at the first stop token
        for i, t in enumerate(new):
            if t in eos:
                return new[: i + 1]
    return new


class OracleProposer(Proposer):
    """Knows the true greedy continuation; is right for the first k drafts of each block, then wrong.

    k is drawn per block from `rng` (0..B-1, so whole blocks get accepted too). Records the k it chose.
    """

    def __init__(self, reference: list[int], vocab: int, block_size: int, rng: random.Random) -> None:
        self.reference = reference  # prompt + greedy continuation (long enough)
        self.vocab = vocab
        self.max_block_size = block_size
        self.rng = rng
        self.chosen_k: list[int] = []

    def propose(self, anchor_token: int, anchor_position: int, num_tokens: int) -> torch.Tensor:
        k = self.rng.randint(0, num_tokens)
        self.chosen_k.append(k)
        out = []
        for i in range(num_tokens):
            pos = anchor_position + 1 + i
            truth = self.reference[pos] if pos < len(self.reference) else 0
            out.append(truth if i < k else (truth + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab)
        return torch.tensor(out, dtype=torch.long)


def byte_tokenizer(corpus: list[str], vocab: int, chat_template: str | None = None):
    """A byte-level BPE tokenizer trained here on `corpus` (multi-byte tokens such as `": "` cross a grammar's
    boundaries, as real ones do); <pad> 0, <s> 1, </s> 2, like the tiny models. The chat template by default joins
    the messages' contents, a line each."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        chat_template=chat_template or "{% for m in messages %}{{ m['content'] }}\n{% endfor %}",
    )


def first_rows_symbolic(step, inputs: list[torch.Tensor], rows: int):
    """`step` on the first `rows` rows of each input, the row count marked symbolic as the engine compiles a verify
    (a compiled graph of any row count from the second call on)."""
    from flashdraft.kernels.static_buffers import symbolic_sizes

    cut = [t[:rows].clone() for t in inputs]
    for t in cut:
        symbolic_sizes(t, 0)
    return step(cut)


def assert_dflash_is_plain_decoding(target, draft, block_size: int = 6, dense=None) -> None:
    """Six prompts, greedy and seeded sampling in turn: `draft` (a random drafter: most drafts rejected, rollbacks)
    and, greedy, an oracle (long accepts) emit exactly what plain decoding of `target` emits; with `dense`, plain
    greedy decoding of that target gives the same tokens too."""
    from flashdraft import generate, generate_ar

    rng, long_accepts = random.Random(5), 0
    for trial in range(6):
        ids = torch.tensor([[rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 16))]])
        max_new = rng.randint(8, 30)
        temperature = 0.0 if trial % 2 == 0 else 0.9
        plain = generate_ar(target, ids, max_new, temperature=temperature, seed=trial)
        got = generate(
            target, draft, ids, max_new, temperature=temperature, seed=trial, block_size=block_size
        )
        assert got.new_tokens == plain.new_tokens, (trial, temperature)
        if temperature == 0:
            if dense is not None:
                assert plain.new_tokens == generate_ar(dense, ids, max_new).new_tokens, trial
            reference = ids[0].tolist() + plain.new_tokens
            oracle = OracleProposer(reference, VOCAB, block_size=block_size, rng=random.Random(trial))
            got = generate(target, oracle, ids, max_new)
            assert got.new_tokens == plain.new_tokens
            long_accepts += sum(a > 1 for a in got.acceptance_lengths)
    assert long_accepts > 0  # the oracle's drafts were accepted several at a time, not only rejected


def assert_verify_keeps_one_token_bits(target, lengths=(1, 2, 3, 4, 5, 8, 16), start: int = 32) -> None:
    """Row invariance, bit for bit: a verify of n tokens (through the graph that taps layers for a drafter, as
    DFlash's does) gives each token exactly the logits (`torch.equal`) that plain decoding's one-token steps (the
    graph without taps) give it, at every n in `lengths`, after a prompt of `start` tokens."""
    from flashdraft import DFlashDraftModel
    from flashdraft.engine.batched_dflash import BatchedDFlashProposer
    from flashdraft.engine.decoder import BatchDecoder
    from flashdraft.engine.proposers import NoProposer, PerRowProposers
    from flashdraft.sampling import SamplingParams

    ids = torch.randint(3, VOCAB - 1, (1, start + max(lengths)), generator=torch.Generator().manual_seed(0))
    draft = DFlashDraftModel.for_target(
        target.model.config, num_layers=1, block_size=max(lengths), mask_token_id=VOCAB - 1
    ).eval()
    with torch.no_grad():
        plain = BatchDecoder(target, PerRowProposers(NoProposer))
        drafting = BatchDecoder(target, BatchedDFlashProposer(draft, target, block_size=max(lengths)))
        for decoder in (plain, drafting):
            decoder.add(ids[0, :start].tolist(), 2, SamplingParams(), stop_token_ids=[], seed=0)
        if drafting.verify is not None:  # a static cache: two graphs, the drafter's with its taps
            assert drafting.verify.taps and not plain.verify.taps and plain.verify is not drafting.verify
        steps = []  # plain decoding's one-token steps over ids[start:], each after the last one's column
        for i in range(max(lengths)):
            out = plain.forward_block(ids[:, start + i : start + i + 1], torch.tensor([[start + i]]))
            steps.append(out.logits[0, 0].clone())
            plain.valid = torch.cat([plain.valid, torch.ones(1, 1, dtype=torch.bool)], 1)
        for n in lengths:
            out = drafting.forward_block(ids[:, start : start + n], torch.arange(start, start + n)[None])
            target.crop(drafting.cache, start)
            for i in range(n):
                got, want = out.logits[0, i], steps[i]
                assert torch.equal(got, want), (
                    f"token {i} of a verify of {n}: off by {(got.double() - want.double()).abs().max().item():.3g}"
                )


def assert_batched_dflash_is_plain_decoding(target, draft, seed: int = 7, max_batch_size: int = 2) -> None:
    """Five prompts of different lengths decoded as a batch with rows joining as others finish (continuous
    batching), greedy and seeded sampling: each row's tokens are plain decoding of that row alone on `target`."""
    from flashdraft import generate_ar, generate_batch

    rng = random.Random(seed)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 12))] for _ in range(5)]
    limits = [rng.randint(6, 20) for _ in prompts]
    for temperature in (0.0, 0.8):
        seeds = list(range(len(prompts)))
        got = generate_batch(
            target, draft, prompts, limits, temperature=temperature, seed=seeds, block_size=5,
            max_batch_size=max_batch_size,
        )  # fmt: skip
        for ids, limit, row_seed, out in zip(prompts, limits, seeds, got, strict=True):
            alone = generate_ar(target, torch.tensor([ids]), limit, temperature=temperature, seed=row_seed)
            assert out.new_tokens == alone.new_tokens, (ids, temperature)


def on_disk(target, root):
    """The target (with its tokenizer) and an untrained block-4 drafter for it, saved under root."""
    from flashdraft import DFlashDraftModel

    target.model.save_pretrained(root / "target")
    target.tokenizer.save_pretrained(root / "target")
    drafter = DFlashDraftModel.for_target(
        target.model.config, num_layers=1, block_size=4, mask_token_id=target.vocab_size - 1
    )
    drafter.save_pretrained(root / "draft")
    return {"target": str(root / "target"), "draft": str(root / "draft")}


@contextmanager
def running_server(app):
    """Serve a FastAPI app with uvicorn on a free local port in a thread; yields its base URL."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not server.started and thread.is_alive() and time.time() < deadline:
        time.sleep(0.05)
    assert server.started, "the test server did not start within 60 s"
    port = server.servers[0].sockets[0].getsockname()[1]  # port 0: the one it got, so no race for a free port
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@contextmanager
def dflash_and_plain_servers(target):
    """The target served twice, with an untrained block-4 DFlash drafter and plain; yields {"dflash", "plain"}
    official `openai` clients (served answers must be equal at T=0)."""
    import openai

    from flashdraft import DFlashDraftModel
    from flashdraft.serve import Engine, build_app

    drafter = DFlashDraftModel.for_target(
        target.model.config, num_layers=1, block_size=4, mask_token_id=target.vocab_size - 1
    )
    engines = {"dflash": Engine(target, drafter.eval(), block_size=4), "plain": Engine(target)}
    try:
        with (
            running_server(build_app(engines["dflash"], "tiny")) as a,
            running_server(build_app(engines["plain"], "tiny")) as b,
        ):
            yield {
                name: openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
                for name, base in (("dflash", a), ("plain", b))
            }
    finally:
        for engine in engines.values():
            engine.close()


def workers_stderr(stderr: str, keep: int = 3000) -> str:
    """What a torchrun job's workers printed last, without the launcher's own traceback and failure table that
    follow it (they name the signal, not the cause: 'terminate called ...' sits above them)."""
    launcher = stderr.find('Traceback (most recent call last):\n  File "<frozen runpy>"')
    return stderr[:launcher][-keep:] if launcher > 0 else stderr[-keep:]


# ----------------------------------------------------------------------------- precision paths (dtype, scheme, compiled)
PATH_NEEDS = {"w8a8": "avx512_vnni|avx_vnni|amx_int8", "w8a16": "avx2 fma"}  # beside bf16's


def path_name(path) -> str:
    dtype, scheme, compiled = path
    return f"{dtype}-{scheme or 'dense'}-{'compiled' if compiled else 'eager'}"


def path_needs(path) -> str:
    """The CPU features a precision path's kernels need (what its skip names)."""
    dtype, scheme, _ = path
    bf16 = "avx512_bf16|amx_bf16" if dtype == "bfloat16" else ""
    return " ".join(filter(None, [bf16, PATH_NEEDS.get(scheme)])) or "x86"


def path_target(path, seed: int = 0, prepare=None):
    """A target on a precision path's kernel plan (skipped, naming the features, where this CPU refuses the path):
    SmolLM2-135M's widths (576 / 1536: past the kernels' register blocks and splits, what the fused layer takes),
    two layers; `prepare(model)` runs on its weights before they are quantized."""
    from flashdraft.kernels.plan import KernelPlanError, make_plan
    from flashdraft.kernels.quantize import QuantizeError, quantize

    dtype, scheme, compiled = path
    try:
        plan = make_plan(torch.device("cpu"), getattr(torch, dtype), scheme, compiled)
    except (QuantizeError, KernelPlanError) as e:  # refused here: this CPU has no such path
        skip_without_kernel(False, path_needs(path), f"{path_name(path)} ({e})")
    shape = dict(
        layers=2, hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3
    )
    model = tiny_model("llama", seed=seed, max_position_embeddings=256, **shape).to(getattr(torch, dtype))
    if prepare is not None:
        prepare(model)
    if scheme:
        quantize(model, scheme)
    from flashdraft import Target

    return Target(model, plan=plan)


def replan(target, **changes):
    """`target` on its kernel plan with `changes` (`static_cache=True`: the static cache, eagerly on a CPU;
    `compile_options=...`: its verify compiled so), its modules prepared by it; returns the plan it keeps."""
    return target.use_plan(target.plan.replace(**changes))


def compiled_plan(options, dtype=torch.float32):
    """A CPU kernel plan compiled with `options` (a stand-in target's `plan`)."""
    from flashdraft.kernels.plan import KernelPlan

    return KernelPlan(torch.device("cpu"), dtype, compile_options=options, static_cache=True)

"""Image-text targets: image prompts decode exactly as plain decoding with the same image, for tiny random models of
four families built here: Qwen3-VL (multimodal RoPE), a Qwen3.5 composite (multimodal RoPE + GatedDeltaNet layers),
Gemma-3 (sliding window, bidirectional image attention) and LLaVA. Ground truth is transformers' own `generate`."""

from __future__ import annotations

import base64
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import _common, byte_tokenizer, hybrid_config, replan, running_server
from flashdraft import DFlashDraftModel, Target, generate, generate_ar, generate_batch
from flashdraft.targets.multimodal import ImageError, ImagePrompt, encode_image_prompt, load_image
from flashdraft.targets.target import TargetError, load_target

tf = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

VOCAB = 96
N = 16  # new tokens per answer
MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3], "mrope_interleaved": True}
QWEN_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=16,
                   spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64)  # fmt: skip


def picture(seed: int, width: int, height: int):
    return Image.fromarray((np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8"))


def _qwen_prompts(image_token: int, start: int, end: int):
    """Token ids around an image's placeholders, as a Qwen processor lays them out, with its pixels and grid."""
    processor = tf.Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2)

    def make(seed: int, size: tuple[int, int], before: tuple[int, ...]) -> ImagePrompt:
        out = processor(images=[picture(seed, *size)], return_tensors="pt")
        count = int(out["image_grid_thw"].prod()) // 4
        ids = torch.tensor([[1, *before, start] + [image_token] * count + [end, 7, 8, 9]])
        inputs = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"],
                  "mm_token_type_ids": (ids == image_token).int()}  # fmt: skip
        return ImagePrompt(ids, inputs)

    return [make(0, (64, 64), (5,)), make(1, (96, 64), (5, 6, 7)), make(2, (32, 32), (9, 9))]


def qwen3_vl():
    text = dict(_common(VOCAB), num_hidden_layers=4, head_dim=16, rope_parameters=MROPE)
    config = tf.Qwen3VLConfig(
        text_config=text, vision_config=dict(QWEN_VISION, deepstack_visual_indexes=[0]), image_token_id=90,
        video_token_id=91, vision_start_token_id=92, vision_end_token_id=93, tie_word_embeddings=False,
    )  # fmt: skip
    return config, _qwen_prompts(90, 92, 93)


def qwen3_5():
    text = dict(hybrid_config("qwen3_5").to_dict(), rope_parameters=MROPE)
    config = tf.Qwen3_5Config(text_config=text, vision_config=QWEN_VISION, image_token_id=90, video_token_id=91,
                              vision_start_token_id=92, vision_end_token_id=93)  # fmt: skip
    return config, _qwen_prompts(90, 92, 93)


def gemma3():
    text = tf.Gemma3TextConfig(num_hidden_layers=3, head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                               **{k: v for k, v in _common(VOCAB).items() if k != "tie_word_embeddings"})  # fmt: skip
    vision = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                   image_size=32, patch_size=8)  # fmt: skip
    config = tf.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=90,
                             boi_token_index=91, eoi_token_index=92)  # fmt: skip

    def make(seed: int, before: tuple[int, ...]) -> ImagePrompt:
        ids = torch.tensor([[1, *before, 91] + [90] * 4 + [92, 7, 8]])
        pixels = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(seed))
        return ImagePrompt(ids, {"pixel_values": pixels, "token_type_ids": (ids == 90).long()})

    return config, [make(0, (5,)), make(1, (5, 6, 7, 8, 9, 10))]  # the second reaches past the window


def llava(vocab: int = VOCAB, image_token: int = 90):
    common = {k: v for k, v in _common(vocab).items() if k != "tie_word_embeddings"}
    vision = tf.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                 image_size=32, patch_size=8, projection_dim=32)  # fmt: skip
    config = tf.LlavaConfig(text_config=tf.LlamaConfig(num_hidden_layers=3, **common), vision_config=vision,
                            image_token_index=image_token, vision_feature_layer=-1)  # fmt: skip

    def make(seed: int, before: tuple[int, ...]) -> ImagePrompt:
        ids = torch.tensor([[1, *before] + [image_token] * 16 + [7, 8]])
        pixels = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(seed))
        return ImagePrompt(ids, {"pixel_values": pixels})

    return config, [make(0, (5,)), make(1, (5, 6, 7))]


def idefics3():
    """Idefics3 / SmolVLM: the image as patches of a pixel grid with its pixel mask, pixel-shuffled to 4 tokens."""
    common = {k: v for k, v in _common(VOCAB).items() if k != "tie_word_embeddings"}
    vision = tf.Idefics3VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                     image_size=32, patch_size=8)  # fmt: skip
    config = tf.Idefics3Config(text_config=tf.LlamaConfig(num_hidden_layers=3, **common), vision_config=vision,
                               scale_factor=2, image_token_id=90)  # fmt: skip

    def make(seed: int, before: tuple[int, ...]) -> ImagePrompt:
        ids = torch.tensor([[1, *before] + [90] * 4 + [7, 8]])
        pixels = torch.randn(1, 1, 3, 32, 32, generator=torch.Generator().manual_seed(seed))
        return ImagePrompt(ids, {"pixel_values": pixels, "pixel_attention_mask": torch.ones(1, 1, 32, 32, dtype=torch.bool)})  # fmt: skip

    return config, [make(0, (5,)), make(1, (5, 6, 7))]


def gemma4():
    """Gemma-4: per-layer input embeddings, the last layers reusing earlier layers' K/V, sliding and full layers,
    bidirectional attention over the image, images as patches with their positions."""
    text = tf.Gemma4TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=16,
                               sliding_window=8, vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8,
                               num_kv_shared_layers=2, layer_types=["sliding_attention", "full_attention"] * 3,
                               max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                               use_bidirectional_attention="vision")  # fmt: skip
    vision = tf.Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=2, head_dim=16, patch_size=8, pooling_kernel_size=2,
                                   position_embedding_size=64)  # fmt: skip
    config = tf.Gemma4Config(text_config=text, vision_config=vision, audio_config=None, image_token_id=90,
                             boi_token_id=91, eoi_token_id=92, video_token_id=93, audio_token_id=94, boa_token_id=95,
                             eoa_token_index=89)  # fmt: skip
    processor = tf.Gemma4ImageProcessorPil(patch_size=8, max_soft_tokens=70, pooling_kernel_size=2)

    def make(seed: int, before: tuple[int, ...]) -> ImagePrompt:
        out = processor(images=[picture(seed, 48, 40)], return_tensors="pt")
        ids = torch.tensor([[1, *before, 91] + [90] * int(out["num_soft_tokens_per_image"][0]) + [92, 7, 8]])
        inputs = {"pixel_values": out["pixel_values"], "image_position_ids": out["image_position_ids"],
                  "mm_token_type_ids": (ids == 90).long()}  # fmt: skip
        return ImagePrompt(ids, inputs)

    return config, [make(0, (5,)), make(1, (5, 6, 7))]


FAMILIES = {"qwen3_vl": qwen3_vl, "qwen3_5": qwen3_5, "gemma3": gemma3, "gemma4": gemma4, "llava": llava,
            "idefics3": idefics3}  # fmt: skip


@pytest.fixture(scope="module")
def family(request):
    config, prompts = FAMILIES[request.param]()
    torch.manual_seed(0)
    model = tf.AutoModelForImageTextToText.from_config(config).eval()
    model.generation_config.eos_token_id = None  # transformers' answers run N tokens, as ours without stops
    drafter = DFlashDraftModel.for_target(model.config, num_layers=1, block_size=4, mask_token_id=VOCAB - 1)
    return model, drafter, prompts


def hf_generate(model, prompt: ImagePrompt, **sampling) -> list[int]:
    ids = prompt.input_ids
    out = model.generate(ids, attention_mask=torch.ones_like(ids), **prompt.inputs, max_new_tokens=N,
                         do_sample=False, pad_token_id=0, **sampling)  # fmt: skip
    return out[0, ids.shape[1] :].tolist()


@pytest.mark.parametrize("family", list(FAMILIES), indirect=True)
def test_image_prompts_decode_as_plain_greedy_single_and_batched(family):
    model, drafter, prompts = family
    target = Target(model)
    assert target.takes_images and target.layers is model.get_decoder().layers
    want = [hf_generate(model, p) for p in prompts]
    for prompt, expected in zip(prompts, want, strict=True):
        assert generate_ar(target, prompt, N, stop_token_ids=[]).new_tokens == expected
        assert generate(target, drafter, prompt, N, block_size=4, stop_token_ids=[]).new_tokens == expected
    # one batch: rows with different images, and a text-only row beside them
    text_only = torch.tensor([[1, 5, 6, 7, 8]])
    batch = generate_batch(target, drafter, [*prompts, text_only], N, block_size=4, stop_token_ids=[])
    assert [r.new_tokens for r in batch[:-1]] == want
    assert batch[-1].new_tokens == hf_generate(model, ImagePrompt(text_only))


@pytest.mark.parametrize("family", ["qwen3_vl", "gemma3"], indirect=True)
def test_image_prompts_sample_as_plain_sampling_with_the_same_seed(family):
    model, drafter, prompts = family
    target = Target(model)
    for seed, prompt in enumerate(prompts):
        plain = generate_ar(target, prompt, N, temperature=0.9, seed=seed, stop_token_ids=[]).new_tokens
        spec = generate(
            target, drafter, prompt, N, temperature=0.9, seed=seed, block_size=4, stop_token_ids=[]
        )
        assert spec.new_tokens == plain


@pytest.mark.parametrize("family", ["qwen3_vl"], indirect=True)
def test_multimodal_rope_shift_is_kept_per_row_and_through_the_static_cache(family):
    model, drafter, prompts = family
    want = [hf_generate(model, p) for p in prompts]
    target = Target(model)
    assert target.multimodal_rope
    shifts = []
    for p in prompts:
        generate_ar(target, p, 1, stop_token_ids=[])
        shifts.append(target.rope_offset(p.inputs))
    assert all(s < 0 for s in shifts) and len(set(shifts)) > 1  # images take fewer positions than tokens
    static = Target(model)
    replan(static, static_cache=True)  # the GPU default (and the compiled path's cache), here on the CPU
    batch = generate_batch(static, drafter, prompts, N, block_size=4, stop_token_ids=[])
    assert [r.new_tokens for r in batch] == want
    # Without the shift the text after an image sits at the wrong positions: the same prompts then decode otherwise
    # (what the assertions above would catch).
    unshifted = Target(model)
    unshifted.rope_offset = lambda inputs: 0
    assert [
        generate(unshifted, drafter, p, N, block_size=4, stop_token_ids=[]).new_tokens for p in prompts
    ] != want


@pytest.mark.parametrize("family", ["qwen3_vl"], indirect=True)
def test_multimodal_rope_whose_language_model_takes_no_text_positions_is_refused_before_decoding(family):
    """The engine gives a multimodal-RoPE model [4, b, n] positions on every step; a language model that does not
    split off the text row would read it as rotary sections and decode wrong, so such a target is refused."""
    from flashdraft.targets.target import TargetError

    model, drafter, prompts = family
    language_model = model.get_decoder()
    own = type(language_model)

    class RotaryRowsOnly(own):  # a family whose forward never looks at the first row apart
        def forward(self, *args, **kwargs):
            return own.forward(self, *args, **kwargs)

    language_model.__class__ = RotaryRowsOnly
    try:
        target = Target(model)
        for decode in (
            lambda: generate_ar(target, prompts[0], N, stop_token_ids=[]),
            lambda: generate(target, drafter, torch.tensor([[1, 5, 6]]), N, block_size=4),
        ):
            with pytest.raises(TargetError, match=r"multimodal RoPE \(qwen3_vl\).*\[4, batch, tokens\]"):
                decode()
    finally:
        language_model.__class__ = own
    Target(model).check_decodable()  # the real one splits it


# ---------------------------------------------------------------------------------------------------------- on disk
LLAVA_TEMPLATE = (
    "{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<image>{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}\n{% endfor %}"
)


@pytest.fixture(scope="module")
def llava_on_disk(tmp_path_factory):
    """A LLaVA target saved with its processor (a byte-level tokenizer with an <image> token, CLIP's image
    processor) and an untrained drafter: what `load_target` gets from a hub checkpoint."""
    root = tmp_path_factory.mktemp("llava")
    tok = byte_tokenizer(
        ["describe the picture please", "a cat on a mat", "what is this"], 80, LLAVA_TEMPLATE
    )
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    image_token = tok.convert_tokens_to_ids("<image>")
    crop = {"height": 32, "width": 32}
    image_processor = tf.CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size=crop)
    processor = tf.LlavaProcessor(image_processor=image_processor, tokenizer=tok, patch_size=8,
                                  vision_feature_select_strategy="default", chat_template=LLAVA_TEMPLATE,
                                  image_token="<image>", num_additional_image_tokens=1)  # fmt: skip
    config, _ = llava(vocab=len(tok) + 4, image_token=image_token)
    torch.manual_seed(1)
    model = tf.AutoModelForImageTextToText.from_config(config).eval()
    model.save_pretrained(root / "target")
    processor.save_pretrained(root / "target")
    DFlashDraftModel.for_target(
        model.config, num_layers=1, block_size=4, mask_token_id=len(tok) + 3
    ).save_pretrained(root / "draft")
    picture(3, 50, 40).save(root / "cat.png")
    (root / "broken.png").write_bytes(b"\x89PNG not really")
    return root


def test_image_text_target_loads_by_path_and_image_files_decode_exactly(llava_on_disk):
    root = llava_on_disk
    target = load_target(str(root / "target"), dtype="float32", device="cpu")
    assert target.takes_images and target.processor is not None
    target.model.generation_config.eos_token_id = None
    # text-only prompts go through the chat template, also where a checkpoint keeps it with its processor alone
    import copy

    bare = copy.deepcopy(target.tokenizer)
    bare.chat_template = None
    wrapped = Target(target.model, bare, processor=target.processor)
    assert wrapped.tokenizer.chat_template == target.processor.chat_template == LLAVA_TEMPLATE
    drafter = DFlashDraftModel.from_pretrained(root / "draft")
    prompt = encode_image_prompt(target, "what is this", [root / "cat.png"])
    assert int((prompt.input_ids == target.processor.image_token_id).sum()) == 16
    expected = hf_generate(target.model, prompt)
    assert generate(target, drafter, prompt, N, block_size=4, stop_token_ids=[]).new_tokens == expected
    # the same image as a data: URL, as the server gets it
    url = "data:image/png;base64," + base64.b64encode((root / "cat.png").read_bytes()).decode()
    again = encode_image_prompt(target, "what is this", [url])
    assert torch.equal(again.input_ids, prompt.input_ids)
    assert torch.equal(again.inputs["pixel_values"], prompt.inputs["pixel_values"])


def test_bad_images_are_refused_with_one_line_naming_them(llava_on_disk, tmp_path):
    root = llava_on_disk
    with pytest.raises(ImageError, match="not an image"):
        load_image(root / "broken.png")
    with pytest.raises(ImageError, match="no such file"):
        load_image(root / "missing.png")
    with pytest.raises(ImageError, match="remote URLs are not fetched"):
        load_image("https://example.com/cat.png")
    with pytest.raises(ImageError, match="not valid base64"):
        load_image("data:image/png;base64,@@@")
    with pytest.raises(ImageError, match="local files are not read"):
        load_image(str(root / "cat.png"), allow_files=False)
    with pytest.raises(ImageError, match="pixels, more than"):
        load_image(Image.new("RGB", (10_000, 10_000)))
    # images for a text-only target: refused before any decoding
    text_target = Target(
        tf.AutoModelForCausalLM.from_config(tf.LlamaConfig(**_common(VOCAB), num_hidden_layers=2))
    )
    with pytest.raises(ImageError, match="text-only"):
        generate_ar(
            text_target, ImagePrompt(torch.tensor([[1, 5, 6]]), {"pixel_values": torch.zeros(1, 3, 8, 8)}), 4
        )
    # the CLI: one line, no traceback, before the model loads
    cli = [sys.executable, "-m", "flashdraft", "generate", "what is this", "--target", str(root / "target"),
           "--draft", str(root / "draft"), "--device", "cpu", "--max-new-tokens", "4"]  # fmt: skip
    for image, message in ((root / "broken.png", "not an image"), (tmp_path / "none.png", "no such file")):
        done = subprocess.run([*cli, "--image", str(image)], capture_output=True, text=True, timeout=300)
        assert done.returncode != 0 and message in done.stderr + done.stdout
        assert "Traceback" not in done.stderr + done.stdout


def test_cli_generates_from_an_image_file_exactly(llava_on_disk):
    root = llava_on_disk
    cli = [sys.executable, "-m", "flashdraft", "generate", "what is this", "--target", str(root / "target"),
           "--draft", str(root / "draft"), "--device", "cpu", "--dtype", "float32", "--max-new-tokens", str(N),
           "--block-size", "4", "--image", str(root / "cat.png"), "--compare-ar", "--json"]  # fmt: skip
    done = subprocess.run(cli, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout[done.stdout.index("{") :])
    assert report["identical_to_ar"] and report["prompt_tokens"] > 16


def test_served_image_requests_decode_exactly_and_bad_ones_get_a_400(llava_on_disk):
    openai = pytest.importorskip("openai")
    from flashdraft.serve import Engine, build_app

    root = llava_on_disk
    target = load_target(str(root / "target"), dtype="float32", device="cpu")
    drafter = DFlashDraftModel.from_pretrained(root / "draft")
    prompt = encode_image_prompt(target, "what is this", [root / "cat.png"])
    # the server stops on the target's EOS, as plain decoding does (its equality with transformers is tested above)
    expected = target.tokenizer.decode(generate_ar(target, prompt, N).new_tokens, skip_special_tokens=True)
    url = "data:image/png;base64," + base64.b64encode((root / "cat.png").read_bytes()).decode()

    def message(image_url: str) -> list[dict]:
        return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url}},
                                             {"type": "text", "text": "what is this"}]}]  # fmt: skip

    engine = Engine(target, drafter, block_size=4, max_batch_size=4)
    with running_server(build_app(engine, "llava")) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
        answer = client.chat.completions.create(model="llava", messages=message(url), max_tokens=N, temperature=0)  # fmt: skip
        assert answer.choices[0].message.content == expected
        for bad, said in (("https://example.com/cat.png", "remote URLs"), (str(root / "cat.png"), "local files"),
                          ("data:image/png;base64,AAAA", "not an image")):  # fmt: skip
            with pytest.raises(openai.BadRequestError, match=said):
                client.chat.completions.create(model="llava", messages=message(bad), max_tokens=4)
        # still serving
        again = client.chat.completions.create(model="llava", messages=message(url), max_tokens=N, temperature=0)  # fmt: skip
        assert again.choices[0].message.content == expected
    engine.close()


def test_bench_runs_an_image_set_with_every_output_equal_and_time_to_first_token(llava_on_disk, tmp_path):
    """`flashdraft bench` on an image+question JSONL (image paths relative to the file): ar, transformers' generate
    and DFlash on the same image prompts, outputs compared, time to first token per method; methods that cannot take
    images are refused before anything loads."""
    from flashdraft.bench import BenchConfig, BenchError, run_bench

    root = llava_on_disk
    (tmp_path / "cat.png").write_bytes((root / "cat.png").read_bytes())
    picture(5, 64, 48).save(tmp_path / "dog.png")
    records = [{"id": "cat", "image": "cat.png", "question": "what is this"},
               {"id": "dog", "images": ["dog.png"], "turns": ["describe the picture please", "a cat on a mat"]}]  # fmt: skip
    (tmp_path / "images.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    settings = dict(target=str(root / "target"), draft=str(root / "draft"), datasets=[str(tmp_path / "images.jsonl")],
                    max_new_tokens=8, plots=False, threads=1, show_progress=False, dtype="float32")  # fmt: skip
    with pytest.raises(BenchError, match="cannot take image prompts"):
        run_bench(BenchConfig(methods=["ar", "pld"], out_dir=tmp_path / "no", **settings))
    results = run_bench(
        BenchConfig(methods=["ar", "hf", "dflash-fixed"], out_dir=tmp_path / "out", **settings)
    )
    assert results["equality"]["compared"] == 3 * 2 and results["equality"]["mismatches"] == 0
    samples = [s for s in results["samples"] if s["method"] == "ar"]
    assert [s["turn"] for s in samples] == [0, 0, 1] and all(s["prompt_tokens"] > 16 for s in samples)
    for s in results["summary"]["images"].values():
        assert s["ttft_s"] > 0


def test_training_rows_with_images_regenerate_pack_and_train_on_what_the_target_saw(llava_on_disk, tmp_path):
    """Issue 35, item 4: an image+question JSONL regenerates through the image-text target (its answers are plain
    greedy decoding of the image prompt), each sequence records its image files and hashes (no pixels), the
    trainer's features over a sequence see the image as the engine's prefill does, packs keep the records, and a
    drafter trains on them. A bad image skips its row; a changed one stops training with one line naming it."""
    import shutil

    from flashdraft.training.dataset import TrainingData, compute_features, pack_data
    from flashdraft.training.regenerate import DataError, regenerate
    from flashdraft.training.trainer import TrainConfig, Trainer

    root = llava_on_disk
    target = load_target(str(root / "target"), dtype="float32", device="cpu")
    shutil.copy(root / "cat.png", tmp_path / "cat.png")
    shutil.copy(root / "broken.png", tmp_path / "broken.png")
    rows = [
        {"id": "cat", "question": "what is this", "images": ["cat.png"]},
        {"id": "text", "question": "describe the picture please"},
        {"id": "bad", "question": "what is this", "images": "broken.png"},
    ]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    manifest = regenerate(target, prompts, tmp_path / "data", max_new_tokens=N, progress=False)
    assert manifest["counts"]["sequences"] == 2 and manifest["counts"]["skipped_by_reason"] == {
        "bad_image": 1
    }

    data = TrainingData(tmp_path / "data")
    row = data.ids.index("prompts:cat")
    item = data[row]
    prompt = encode_image_prompt(target, "what is this", [tmp_path / "cat.png"])
    n = prompt.input_ids.shape[1]
    assert item["input_ids"][:n].tolist() == prompt.input_ids[0].tolist()
    answer = item["input_ids"][n:].tolist()
    assert answer == hf_generate(target.model, prompt)[: len(answer)] and len(answer) >= 1
    assert item["loss_mask"].sum() == len(answer) and not item["loss_mask"][:n].any()
    ref = item["images"][0]
    assert ref["path"] == str(tmp_path / "cat.png") and len(ref["sha256"]) == 64
    assert "images" not in data[data.ids.index("prompts:text")]

    # the trainer's features: what the engine's prefill of the image prompt taps, then the answer after it
    taps = [0, 1]
    ids = item["input_ids"][None]
    from flashdraft.training.dataset import image_inputs

    trained = target.features(ids, taps, image_inputs(target, item, ids, "cat"))
    prefill = target.forward(prompt.input_ids, None, taps, inputs=prompt.inputs).features
    torch.testing.assert_close(trained[:, :n], prefill, rtol=1e-5, atol=1e-5)
    blind = target.features(ids, taps)  # the placeholders' embeddings instead of the image: not what it saw
    assert not torch.allclose(blind[:, :n], prefill, atol=1e-3)

    packed = TrainingData(pack_data(tmp_path / "data", tmp_path / "data.npz") and tmp_path / "data.npz")
    assert packed[row]["images"] == item["images"] and packed[row]["image_text"] == item["image_text"]
    features = compute_features(
        target, tmp_path / "data", tmp_path / "features", taps, "float32", progress=False
    )
    assert features["complete"]
    torch.testing.assert_close(TrainingData(tmp_path / "features")[row]["features"][None], trained)

    vocab = target.vocab_size
    config = TrainConfig(out_dir=str(tmp_path / "run"), num_layers=1, block_size=4, num_anchors=8, lr=3e-3,
                         epochs=6, batch_size=2, mask_token_id=vocab - 1, progress=False, save_every=10**9,
                         intermediate_size=64, target_layer_ids=taps)  # fmt: skip
    history = Trainer(target, packed, config).fit()
    assert history[-1]["loss"] < history[0]["loss"]

    picture(9, 50, 40).save(tmp_path / "cat.png")  # another image under the same name
    with pytest.raises(DataError, match=r"cat\.png: changed since the data was regenerated"):
        Trainer(target, packed, TrainConfig(**{**config.__dict__, "out_dir": str(tmp_path / "again")})).fit()


def test_cli_regenerates_and_trains_on_image_rows(llava_on_disk, tmp_path):
    """`data regenerate`, `data features` and `train` load an image-text target whole when their rows carry images."""
    import shutil

    root = llava_on_disk
    shutil.copy(root / "cat.png", tmp_path / "cat.png")
    (tmp_path / "p.jsonl").write_text(
        json.dumps({"id": "cat", "question": "what is this", "image": "cat.png"}) + "\n"
    )
    target = ["--target", str(root / "target")]
    steps = [
        ["data", "regenerate", *target, "--prompts", str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "data"),
         "--max-new-tokens", str(N)],
        ["data", "features", *target, "--data", str(tmp_path / "data"), "--out", str(tmp_path / "data"),
         "--layers", "0,1", "--dtype", "bfloat16"],
        ["train", *target, "--data", str(tmp_path / "data"), "--out", str(tmp_path / "run"), "--num-layers", "1",
         "--block-size", "4", "--num-anchors", "4", "--epochs", "1", "--batch-size", "1", "--intermediate-size", "64",
         "--target-layer-ids", "0,1", "--device", "cpu", "--eval-datasets", ""],
    ]  # fmt: skip
    for args in steps:
        done = subprocess.run(
            [sys.executable, "-m", "flashdraft", *args], capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, (args[:2], done.stderr[-2000:])
    sequence = json.loads((tmp_path / "data" / "shard-00000.jsonl").read_text().splitlines()[1])
    assert sequence["images"][0]["path"].endswith("cat.png") and "<image>" in sequence["image_text"]
    assert (tmp_path / "run" / "train_log.jsonl").read_text().strip()


@pytest.mark.parametrize("family", list(FAMILIES), indirect=True)
def test_training_features_of_image_sequences_are_what_decoding_taps_and_the_loss_falls(family, tmp_path):
    """For every family (Qwen3.5 hybrid, Qwen3-VL and its multimodal RoPE, Gemma-3's bidirectional image attention
    and sliding window, LLaVA): the trainer's one forward over an image prompt and the target's answer taps what
    decoding taps (the prefill with the image, then the answer after it at the positions the engine gives), and a
    drafter trains on such sequences (the Python API's form: the processor's outputs beside the ids)."""
    from flashdraft.training.dataset import image_inputs
    from flashdraft.training.trainer import TrainConfig, Trainer

    model, _, prompts = family
    target = Target(model)
    taps = [0, target.num_layers - 1]
    items = []
    for prompt in prompts:
        n = prompt.input_ids.shape[1]
        answer = torch.tensor([hf_generate(model, prompt)])
        ids = torch.cat([prompt.input_ids, answer], 1)
        mask = torch.arange(ids.shape[1]) >= n
        items.append(
            {"input_ids": ids[0], "loss_mask": mask, "prompt_inputs": prompt.inputs, "prompt_length": n}
        )
        trained = target.features(ids, taps, image_inputs(target, items[-1], ids, "test"))
        cache = target.new_cache()
        prefill = target.forward(
            prompt.input_ids, cache, taps, True, inputs=prompt.inputs
        ).features  # as the engine
        offsets = torch.tensor([target.rope_offset(prompt.inputs)])
        positions = target.model_positions(torch.arange(n, ids.shape[1])[None], offsets)
        answered = target.forward(answer, cache, taps, position_ids=positions).features
        torch.testing.assert_close(trained, torch.cat([prefill, answered], 1), rtol=1e-4, atol=1e-4)
        blind = target.features(ids, taps)  # the placeholders' embeddings, no image
        assert not torch.allclose(blind, trained, atol=1e-3)

    config = TrainConfig(out_dir=str(tmp_path), num_layers=1, block_size=4, num_anchors=8, lr=3e-3, epochs=8,
                         batch_size=2, mask_token_id=VOCAB - 1, progress=False, save_every=10**9,
                         intermediate_size=64, target_layer_ids=taps)  # fmt: skip
    history = Trainer(target, items * 2, config).fit()
    assert history[-1]["loss"] < history[0]["loss"]


@pytest.mark.parametrize("family", ["qwen3_vl", "gemma3", "llava"], indirect=True)
def test_the_bench_weighs_a_flip_after_an_image_prompt_with_its_image(family):
    """The near-tie test replays plain decoding and a verify with the prompt's image: the replay's argmax at each
    position is the token plain decoding chose, the two replays agree to fp32's rounding (a replay without the
    image would not), and a flip to the least likely token is unexplained."""
    from types import SimpleNamespace

    from flashdraft.bench.mismatches import UNEXPLAINED, plain_logits_at, weigh_flips

    model, _, prompts = family
    target = Target(model)
    prompt = prompts[-1]
    reference = hf_generate(model, prompt)
    steps = plain_logits_at(target, prompt, reference, range(len(reference)))
    assert [int(steps[i].argmax()) for i in range(len(reference))] == reference
    for i in (0, 5):
        low = int(steps[i].argmin())
        (flip,) = weigh_flips(
            target, prompt, reference, [(SimpleNamespace(first_mismatch=i), [*reference[:i], low])], 4
        )
        assert flip["verdict"] == UNEXPLAINED and flip["plain_argmax"] == reference[i], flip
        assert flip["path_difference"] < 1e-3, flip


def test_an_image_text_target_saved_without_its_processor_serves_text_and_refuses_images(
    llava_on_disk, tmp_path
):
    """A checkpoint of the model's files alone (no image processor saved): a text prompt needs only the tokenizer, so
    it loads and decodes; images are refused in one line, at load when asked for and at the prompt otherwise."""
    import shutil

    bare = tmp_path / "target"
    shutil.copytree(llava_on_disk / "target", bare)
    for name in ("preprocessor_config.json", "processor_config.json"):
        (bare / name).unlink(missing_ok=True)
    target = load_target(str(bare), dtype="float32", device="cpu")
    assert target.processor is None and target.takes_images and target.tokenizer is not None
    target.model.generation_config.eos_token_id = None
    drafter = DFlashDraftModel.from_pretrained(llava_on_disk / "draft")
    ids = target.encode_prompt("what is this")
    out = generate(target, drafter, ids, N, block_size=4, stop_token_ids=[])
    assert out.new_tokens == generate_ar(target, ids, N, stop_token_ids=[]).new_tokens
    with pytest.raises(ImageError, match="without an image processor") as refused:
        encode_image_prompt(target, "what is this", [llava_on_disk / "cat.png"])
    assert "\n" not in str(refused.value)
    with pytest.raises(TargetError, match="cannot load target"):
        load_target(str(bare), dtype="float32", device="cpu", images=True)

"""Time to first token with and without the drafter on image prompts (issue: first tokens not slower).

No real image-text model installs here, so the target is a random Qwen3-VL with SmolLM2-135M's language-model sizes
(576 hidden, 30 layers, 9 heads / 3 KV heads) and a small vision tower, and the drafter a random 5-layer one; time is
all this measures (random weights take the same time as trained ones). An image of SIZE x SIZE pixels becomes
(SIZE/32)^2 placeholder tokens. Both runs go through the one engine; the first token comes from the prefill, the
second from the first decode step (where the drafter's context over the prompt, image tokens included, is built).

    python benchmarks/vlm-ttft/ttft.py --sizes 224,448,672 --repeats 5 --json benchmarks/vlm-ttft/results.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import numpy as np
import torch
import transformers as tf
from PIL import Image

from flashdraft import DFlashDraftModel, Target, generate, generate_ar
from flashdraft.targets.multimodal import ImagePrompt


def build(layers: int):
    text = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                num_hidden_layers=layers, head_dim=64, max_position_embeddings=8192, tie_word_embeddings=True,
                rope_parameters={"rope_type": "default", "rope_theta": 100000.0, "mrope_section": [8, 12, 12],
                                 "mrope_interleaved": True})  # fmt: skip
    vision = dict(depth=4, hidden_size=256, intermediate_size=1024, num_heads=4, out_hidden_size=576, patch_size=16,
                  spatial_merge_size=2, temporal_patch_size=2, deepstack_visual_indexes=[1], num_position_embeddings=2304)  # fmt: skip
    config = tf.Qwen3VLConfig(text_config=text, vision_config=vision, image_token_id=49100, video_token_id=49101,
                              vision_start_token_id=49102, vision_end_token_id=49103)  # fmt: skip
    torch.manual_seed(0)
    model = tf.AutoModelForImageTextToText.from_config(config).eval()
    drafter = DFlashDraftModel.for_target(model.config, num_layers=5, block_size=16, mask_token_id=49151)
    return model, drafter


def prompt(size: int, text_tokens: int = 40) -> ImagePrompt:
    processor = tf.Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2,
                                            min_pixels=size * size, max_pixels=size * size)  # fmt: skip
    image = Image.fromarray((np.random.RandomState(size).rand(size, size, 3) * 255).astype("uint8"))
    out = processor(images=[image], return_tensors="pt")
    count = int(out["image_grid_thw"].prod()) // 4
    words = [int(t) for t in np.random.RandomState(1).randint(100, 40000, text_tokens)]
    ids = torch.tensor([[1, 49102] + [49100] * count + [49103, *words]])
    inputs = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"],
              "mm_token_type_ids": (ids == 49100).int()}  # fmt: skip
    return ImagePrompt(ids, inputs)


def first_two(run) -> tuple[float, float]:
    """Seconds to the first and to the second token, as a streaming client sees them."""
    times: list[float] = []
    t0 = time.perf_counter()
    run(lambda new: times.extend([time.perf_counter() - t0] * len(new)))
    return times[0], times[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="224,448,672")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, drafter = build(args.layers)
    target = Target(model)
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        p = prompt(size)
        runs = {
            "plain": lambda cb, p=p: generate_ar(target, p, 4, stop_token_ids=[], on_tokens=cb),
            "dflash": lambda cb, p=p: generate(
                target, drafter, p, 4, block_size=16, stop_token_ids=[], on_tokens=cb
            ),
        }
        for run in runs.values():
            first_two(run)  # warm-up
        got: dict[str, list[tuple[float, float]]] = {k: [] for k in runs}
        for _ in range(args.repeats):  # interleaved, so drift hits both alike
            for name, run in runs.items():
                got[name].append(first_two(run))
        row = {"image_px": size, "prompt_tokens": int(p.input_ids.shape[1]),
               "image_tokens": int((p.input_ids == 49100).sum())}  # fmt: skip
        for name, samples in got.items():
            row[f"{name}_ttft_s"] = statistics.median(s[0] for s in samples)
            row[f"{name}_second_token_s"] = statistics.median(s[1] for s in samples)
        row["ttft_ratio"] = row["dflash_ttft_s"] / row["plain_ttft_s"]
        row["second_token_ratio"] = row["dflash_second_token_s"] / row["plain_second_token_s"]
        rows.append(row)
        print(json.dumps(row))
    if args.json:
        meta = {"cpu": platform.processor() or platform.machine(), "threads": args.threads, "torch": torch.__version__,
                "target": f"random Qwen3-VL, {args.layers} layers of SmolLM2-135M's sizes", "drafter": "random, 5 layers, block 16"}  # fmt: skip
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

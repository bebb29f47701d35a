"""What the cost model's verify prices should read: SmolLM2-135M's compiled verify of 1-16 tokens at 64 and 512
tokens of context, both contexts in the same interleaved rounds (`measure.interleaved_medians`, 9 rounds), three
times in one process, median ms. The cost model times its two contexts one after the other; this shows whether a
length it priced above a longer one was the machine or the model (benchmarks/README.md, 2026-12-06, stop 79).
Run: python benchmarks/scripts/verify_prices.py [w8a16|int8|none]"""

import sys

import torch

from flashdraft.engine.compiled import compile_verify
from flashdraft.engine.measure import interleaved_medians, static_decoder
from flashdraft.drafter.model import DFlashDraftModel
from flashdraft.targets.target import load_target

torch.set_num_threads(2)
scheme = sys.argv[1] if len(sys.argv) > 1 else "w8a16"
target = load_target(
    "smollm2-135m-instruct",
    dtype="bfloat16",
    device="cpu",
    quantize=None if scheme == "none" else scheme,
    compiled=True,
)
compile_verify(target)
draft = DFlashDraftModel.from_pretrained("drafters/smollm2-135m-instruct").eval()
ids = torch.randint(10, 5000, (1, 600), generator=torch.Generator().manual_seed(0))
calls, names = [], []
for context in (64, 512):
    engine = static_decoder(target, draft, ids[:, :context], dtype="bfloat16")
    for n in (1, 2, 4, 8, 16):

        def verify(n=n, c=context, engine=engine) -> None:
            engine.forward_block(ids[:, c : c + n], torch.arange(c, c + n)[None])
            target.crop(engine.cache, c)

        calls.append(verify)
        names.append((context, n))
with torch.no_grad():
    for _ in range(3):
        medians = interleaved_medians(calls, 9)
        print(
            " ".join(f"c{c}n{n}:{1000 * m:.2f}" for (c, n), m in zip(names, medians, strict=True)), flush=True
        )

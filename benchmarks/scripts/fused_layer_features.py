"""How far the features the drafter reads lie from the fp32 model's, through the fused decoder layer
(decoder_layer_cpp.py) and through inductor's graph of the model's own layers: SmolLM2-135M w8a16 compiled, six
GSM8K prompts and the fp32 model's greedy answers to them, each answer token verified alone after the prompt and
the tokens before it, through the engine (`static_decoder`); against the same walk on the fp32 model (static cache,
eager). The tapped layers' outputs' relative error, and the logits' largest difference.
benchmarks/README.md, 2026-12-06 (stop 77). Run: python benchmarks/scripts/fused_layer_features.py"""

import torch
from fused_targets import fused_and_unfused  # beside this script

from flashdraft.prompts.benchmarks import load_bench_dataset
from flashdraft.generate import generate_ar
from flashdraft.engine.measure import static_decoder
from flashdraft.drafter.model import DFlashDraftModel
from flashdraft.targets.target import load_target

torch.set_num_threads(2)
draft = DFlashDraftModel.from_pretrained("drafters/smollm2-135m-instruct").eval()
reference = load_target("smollm2-135m-instruct", dtype="float32", device="cpu")
reference.static_cache = True
data = load_bench_dataset("gsm8k", max_samples=6, seed=0)
prompts = [reference.encode_prompt(c.user_turns[0])[0] for c in data.conversations]
targets = fused_and_unfused()


def walk(target, ids: torch.Tensor, start: int) -> list:
    """(features, logits) of each token after `start`, verified one at a time."""
    engine = static_decoder(target, draft, ids[:, :start], dtype="bfloat16")
    out = []
    for pos in range(start, ids.shape[1]):
        o = engine.forward_block(ids[:, pos : pos + 1], torch.tensor([[pos]]))
        out.append((o.features[0, 0].float(), o.logits[0, 0].float()))
    return out


errors = {name: ([], []) for name in targets}
with torch.no_grad():
    for prompt in prompts:
        answer = generate_ar(reference, prompt[None], 96).new_tokens
        ids = torch.cat([prompt, torch.tensor(answer)])[None]
        truth = walk(reference, ids, prompt.shape[0])
        for name, target in targets.items():
            for (f, logits), (f_ref, logits_ref) in zip(
                walk(target, ids, prompt.shape[0]), truth, strict=True
            ):
                errors[name][0].append(float((f - f_ref).norm() / f_ref.norm()))
                errors[name][1].append(float((logits - logits_ref).abs().max()))
for name, (features, logits) in errors.items():
    f, lg = torch.tensor(features), torch.tensor(logits)
    print(
        f"{name:8} features' relative error: median {f.median():.4f}, mean {f.mean():.4f}; logits' largest "
        f"difference: median {lg.median():.3f}, mean {lg.mean():.3f} ({f.numel()} tokens)"
    )

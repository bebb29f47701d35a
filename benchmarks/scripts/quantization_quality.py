"""What a quantization costs the model itself: SmolLM2-135M-Instruct's mean negative log-likelihood per token on
GSM8K test solutions (question and answer, the first N; evaluation only), and how often its greedy next token
agrees with the bf16 model's, for bf16, fp32, int8 weight-only, w8a8 (int8 weights and per-row int8 activations) and
w8a16 (int8 weights, per-row 16-bit integer activations), eager. benchmarks/README.md, 2026-12-02 and 2026-12-05.
Run: python benchmarks/scripts/quantization_quality.py [N]"""

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from flashdraft.targets.target import load_target

torch.set_num_threads(2)
n = int(sys.argv[1]) if len(sys.argv) > 1 else 40
data = Path(__file__).resolve().parents[3] / "shared" / "data" / "gsm8k_test.jsonl"
rows = [json.loads(line) for line in data.read_text().splitlines()[:n]]
configs = {
    "bf16": ("bfloat16", None),
    "fp32": ("float32", None),
    "int8 (weights)": ("bfloat16", "int8"),
    "w8a8": ("bfloat16", "w8a8"),
    "w8a16": ("bfloat16", "w8a16"),
}
reference_tokens: list[torch.Tensor] = []
print(f"{n} GSM8K test solutions")
for name, (dtype, quantize) in configs.items():
    target = load_target("smollm2-135m-instruct", dtype=dtype, device="cpu", quantize=quantize)
    tok = target.tokenizer
    nll, count, agree = 0.0, 0, 0
    with torch.no_grad():
        for i, row in enumerate(rows):
            ids = tok(row["question"] + "\n" + row["answer"], return_tensors="pt").input_ids[:, :256]
            logits = target.model(ids).logits[0, :-1].float()
            nll += F.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
            count += ids.shape[1] - 1
            greedy = logits.argmax(-1)
            if name == "bf16":
                reference_tokens.append(greedy)
            agree += (greedy == reference_tokens[i]).sum().item()
    print(
        f"{name:16s} nll/token {nll / count:.4f}  ppl {torch.tensor(nll / count).exp():.3f}  "
        f"greedy next token = bf16's {agree / count:.4f}",
        flush=True,
    )

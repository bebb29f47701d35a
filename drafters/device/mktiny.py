"""A tiny random Llama with SmolLM2's tokenizer: exercises every CUDA code path in seconds.

python3 drafters/device/mktiny.py OUT_DIR .gpu/small
"""

import gzip
import shutil
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
small = Path(sys.argv[2])  # .gpu/small: SmolLM2 tokenizer files (prepare.sh)
torch.manual_seed(0)
cfg = LlamaConfig(
    vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    tie_word_embeddings=True,
)  # fmt: skip
LlamaForCausalLM(cfg).save_pretrained(out)
with gzip.open(small / "tokenizer.json.gz") as f, open(out / "tokenizer.json", "wb") as g:
    shutil.copyfileobj(f, g)
for name in ("tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
    shutil.copy(small / name, out / name)
print("tiny model at", out)

# Device call 1 (carry .gpu/small and .gpu/whl.part00): does every CUDA path run? A tiny random Llama with
# SmolLM2's tokenizer goes through regenerate, train (padded batches, flex attention, evaluation) and generate.
set -x
export PYTHONPATH=$PWD/src:/tmp/site PYTHONUNBUFFERED=1 FD="python3 -m flashdraft"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/small/gguf-*.whl
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())"
python3 drafters/device/mktiny.py /tmp/tiny .gpu/small || exit 1
$FD data regenerate --target /tmp/tiny --prompts .gpu/small/gsm8k_train.jsonl.gz --limit 96 --batch-size 48 \
  --max-new-tokens 48 --out /tmp/tinydata --target-dtype bfloat16 || exit 2
$FD train --target /tmp/tiny --data /tmp/tinydata --out /tmp/tinytrain --num-layers 2 --max-steps 6 --num-anchors 512 \
  --batch-size 4 --grad-accum 2 --eval-datasets gsm8k --eval-samples 2 --eval-max-new-tokens 16 --eval-every 3 \
  --target-dtype bfloat16 --bf16 --max-length 1024 || exit 3
$FD generate --target /tmp/tiny --draft /tmp/tinytrain "What is 2+2?" --max-new-tokens 24 --block-size 16 \
  --dtype bfloat16 || exit 4
mkdir -p /tmp/fdhome/downloads/smollm2-135m-instruct && cat .gpu/whl.part00 > /tmp/fdhome/downloads/smollm2-135m-instruct/part

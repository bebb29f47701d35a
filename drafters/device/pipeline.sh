# On the device, in its own session (start.sh launches it): regenerate (at most REGEN_S seconds; every source is
# resumable, so what is cut short continues next time), time a few training steps, train until DEADLINE (epoch
# seconds) less the export, then pack data + drafter into /tmp/pack (15 MiB pieces: what a device call brings back).
DEADLINE=$1
export FLASHDRAFT_HOME=/tmp/fdhome PYTHONPATH=$PWD/src:/tmp/site PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True   # five generate() processes share one GPU
S=.gpu/small; D=/tmp/d; mkdir -p $D /tmp/pack
R="timeout ${REGEN_S:-420} python3 -m flashdraft data regenerate --target smollm2-135m-instruct --target-dtype bfloat16 \
 --batch-size 384 --chunk-size 1024"
echo "regen start $(date +%s)"
$R --prompts $S/gsm8k_train.jsonl.gz --prompt-suffix boxed --out $D/gsm8k --max-new-tokens 256 >> $D/gsm8k.log 2>&1 &
$R --prompts $S/gsm8k_train.jsonl.gz --prompt-suffix boxed --out $D/gsm8k-t07 --max-new-tokens 256 --temperature 0.7 \
  >> $D/gsm8k-t07.log 2>&1 &
$R --prompts $S/stdlib_code.jsonl.gz --out $D/code --max-new-tokens 320 --max-length 1024 >> $D/code.log 2>&1 &
$R --prompts $S/stdlib_code.jsonl.gz --out $D/code-t07 --max-new-tokens 320 --max-length 1024 --temperature 0.7 \
  >> $D/code-t07.log 2>&1 &
$R --prompts $S/sharegpt_prompts.jsonl.gz --shuffle-seed 0 --max-length 768 --out $D/sharegpt --max-new-tokens 256 \
  >> $D/sharegpt.log 2>&1 &
wait
echo "regen end $(date +%s)"
DATA=""
for d in gsm8k gsm8k-t07 code code-t07 sharegpt; do
  python3 -c "import json,sys; sys.exit(json.load(open('$D/$d/manifest.json'))['counts']['sequences'] == 0)" \
    2>/dev/null && DATA="$DATA --data $D/$d"
done
T="python3 -m flashdraft train --target smollm2-135m-instruct $DATA --init-from ${INIT_FROM:-drafters/smollm2-135m-instruct} \
 --target-dtype bfloat16 --bf16 --block-size 16 --num-anchors 512 --lr 6e-4 --batch-size 8 --grad-accum 2 \
 --max-length 1024 --save-every 100"
# time 8 steps each way (the first steps compile flex attention) and keep the faster micro-batch shape
for mode in per-sequence padded-batches; do
  $T --$mode --out /tmp/probe-$mode --max-steps 8 --eval-datasets '' > /tmp/probe-$mode.log 2>&1
  python3 -c "import json;r=sorted(json.loads(l)['step_s'] for l in open('/tmp/probe-$mode/train_log.jsonl'));print(r[len(r)//2], '--$mode')" >> /tmp/probe.txt
done
cat /tmp/probe.txt
read STEP_S MODE <<< "$(sort -g /tmp/probe.txt | head -1)"
NOW=$(date +%s); STEPS=$(python3 -c "print(max(20, int(($DEADLINE - $NOW - 120) * 0.85 / $STEP_S)))")
echo "probe: $MODE at $STEP_S s/step -> $STEPS steps (now $NOW, deadline $DEADLINE)"
T="$T $MODE"
$T --out /tmp/run --max-steps $STEPS --eval-every $((STEPS / 5)) --eval-samples 8 --eval-max-new-tokens 64 > /tmp/run.log 2>&1
echo "train end $(date +%s) rc $?"
cp /tmp/pipeline.log /tmp/run.log /tmp/probe*.log /tmp/probe.txt $D/ 2>/dev/null
cd /tmp && tar -czf /tmp/all.tgz d/*/manifest.json d/*/shard-* d/*.log run/*.json run/*.jsonl run/README.md run/model.safetensors
split -b 15M -d /tmp/all.tgz /tmp/pack/all.tgz.part && touch /tmp/pack.done
echo "packed $(date +%s)"; ls -la /tmp/pack

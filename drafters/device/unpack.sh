#!/usr/bin/env bash
# Run HERE on what the last device call brought back: bash drafters/device/unpack.sh /work/.device/N runs/gpu2
# (results.tgz.part* from playbook.py, all.tgz.part* from the stage-6 pipeline)
set -eu
mkdir -p "$2"
if ls "$1"/results.tgz.part* > /dev/null 2>&1; then cat "$1"/results.tgz.part* | tar -xzf - -C "$2"; else
  cat "$1"/all.tgz.part* | tar -xzf - -C "$2"; fi
du -sh "$2"/*

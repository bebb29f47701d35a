#!/usr/bin/env bash
# Run HERE on what the last device call brought back: bash drafters/device/unpack.sh /work/.device/N runs/gpu2
set -eu
mkdir -p "$2" && cat "$1"/all.tgz.part* | tar -xzf - -C "$2" && du -sh "$2"/d/* "$2"/run

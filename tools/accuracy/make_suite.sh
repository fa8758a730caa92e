#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Writes a validation suite for `kvsieve eval --suite` (docs/accuracy.md, "Validation suite"): traces
# that differ in source (a real model, synthetic), context length and query behaviour, split into a
# tuning half (seed 1) and a held-out half (seed 2 and the real-model traces), and the list file.
#   tools/accuracy/make_suite.sh [DIR]          (default traces/suite; existing traces are kept)
# Environment: KVSIEVE   the kvsieve CLI (default build/kvsieve)
#              LONG=1    also the 64K-token synthetic traces (minutes to evaluate on two cores)
# Then:  build/kvsieve eval --suite DIR/suite.txt --half tuning  --methods all --budget 0.05
#        build/kvsieve eval --suite DIR/suite.txt --half heldout --methods all --budget 0.05
# Real-model traces: the stories260K trace shipped in tests/data, plus every *.safetensors in
# DIR/real/ (make them with tools/traces/ or the commands of docs/real-traces.md, e.g. SmolLM2-135M
# over texts of other genres): they all go to the held-out half.
set -euo pipefail
cd "$(dirname "$0")/../.."
DIR=${1:-traces/suite}
KVS=${KVSIEVE:-build/kvsieve}
mkdir -p "$DIR" "$DIR/real"
LIST="$DIR/suite.txt"

# name prefill decode retarget: query behaviour from the synthetic generator's --retarget (the
# probability per token that a query draws new targets): 0.02 keeps a topic for ~50 steps (query
# locality), 0.25 is the generator's default, 1.0 jumps to another topic at every decode step.
CASES=(
  "local-4k 4096 64 0.02"
  "default-4k 4096 64 0.25"
  "jumps-4k 4096 64 1.0"
  "jumps-16k 16384 32 1.0"
  "local-16k 16384 32 0.02"
)
if [ "${LONG:-0}" = 1 ]; then
  CASES+=("jumps-64k 65536 16 1.0" "local-64k 65536 16 0.02")
fi

{
  echo "# kvsieve validation suite (tools/accuracy/make_suite.sh): PATH HALF"
  echo "# tuning: synthetic seed 1; heldout: synthetic seed 2 and every real-model trace"
} >"$LIST"
for c in "${CASES[@]}"; do
  read -r name prefill decode retarget <<<"$c"
  for seed in 1 2; do
    f="synth-$name-s$seed.safetensors"
    [ -f "$DIR/$f" ] || "$KVS" synth --out "$DIR/$f" --seed "$seed" --prefill "$prefill" --decode "$decode" \
      --retarget "$retarget" --layers 2 --dtype bf16 -q
    echo "$f $([ "$seed" = 1 ] && echo tuning || echo heldout)" >>"$LIST"
  done
done
cp -f tests/data/stories260k-gen-t512.safetensors "$DIR/real/stories260k-gen-t512.safetensors"
for f in "$DIR"/real/*.safetensors; do
  echo "real/$(basename "$f") heldout" >>"$LIST"
done
echo "wrote $LIST ($(grep -vc '^#' "$LIST") traces)"

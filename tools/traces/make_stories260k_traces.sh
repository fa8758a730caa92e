#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Rebuilds the two stories260K traces of docs/real-traces.md into OUT_DIR (default: traces/ in the checkout).
# Needs python3-numpy and, for the text trace, Debian's bible-kjv (program) + bible-kjv-text (data).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-traces}
mkdir -p "$OUT"
PY=tools/traces/stories260k.py
python3 $PY check
python3 $PY trace --out "$OUT/stories260k-gen.safetensors" --generate 511 --seed 42 \
  --temperature 1.0 --prefill-len 256
# Genesis 1:1-2:25 (KJV) as plain text: chapter headings and verse numbers removed.
bible 'gen1:1-2:25' | grep -v '^Genesis [0-9]*$' | sed -E 's/^ +[0-9]+ //' | tr '\n' ' ' \
  | tr -s ' ' | fold -s -w 100 > "$OUT/kjv-genesis-1-2.txt"
python3 $PY trace --out "$OUT/stories260k-text.safetensors" --text "$OUT/kjv-genesis-1-2.txt" \
  --length 512 --prefill-len 256 --source "King James Bible, Genesis 1:1-2:25, from Debian package bible-kjv-text (/usr/lib/bible.data, extracted with bible-kjv's 'bible gen1:1-2:25', verse numbers removed)"

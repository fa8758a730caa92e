#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Regenerates every measurement behind docs/accuracy.md for stories260K, then its tables and plots:
#   kvsieve eval (every method, budgets 1/2/5/10/20%) on both stories260K traces, and the end-to-end
#   harness examples/python/kvsieve_e2e.py on the same two texts.
# Usage: tools/accuracy/run_stories260k.sh [TRACES_DIR]   (default traces/ in the checkout; traces made if missing)
# Environment: KVSIEVE   the kvsieve CLI (default build/kvsieve)
#              PYTHON    Python with NumPy and the kvsieve package importable (set PYTHONPATH to
#                        <build>/bindings/python; default python3)
#              PLOT_PYTHON  Python with matplotlib for accuracy_report.py (default $PYTHON)
#              THREADS   library threads (default 1)
set -euo pipefail
cd "$(dirname "$0")/../.."
TR=${1:-traces}
KVS=${KVSIEVE:-build/kvsieve}
PY=${PYTHON:-python3}
THREADS=${THREADS:-1}
OUT=docs/accuracy
mkdir -p "$OUT"
[ -f "$TR/stories260k-text.safetensors" ] && [ -f "$TR/stories260k-gen.safetensors" ] ||
  tools/traces/make_stories260k_traces.sh "$TR"

# The harness's small-model presets (PRESETS in kvsieve_e2e.py), as kvsieve eval --params.
mapfile -t PARAMS < <("$PY" -c '
import sys; sys.path.insert(0, "examples/python")
import kvsieve_e2e
for m, p in kvsieve_e2e.PRESETS.items():
    print("--params"); print("%s:%s" % (m, p))')

for t in gen text; do
  for b in 0.01 0.02 0.05 0.10 0.20; do
    echo "eval stories260k-$t budget $b" >&2
    "$KVS" eval --trace "$TR/stories260k-$t.safetensors" --methods all --budget "$b" \
      --threads "$THREADS" "${PARAMS[@]}" --json "$OUT/eval-stories260k-$t-$b.json" \
      > "$OUT/eval-stories260k-$t-$b.txt" 2> >(sort -u >&2)
  done
done

# Four windows per text (the first is the trace's sequence): 4 x 255 scored tokens each.
"$PY" examples/python/kvsieve_e2e.py --story --windows 4 --threads "$THREADS" -q \
  --json "$OUT/e2e-stories260k-gen.json" > /dev/null
"$PY" examples/python/kvsieve_e2e.py --text "$TR/kjv-genesis-1-2.txt" --windows 4 \
  --threads "$THREADS" -q --text-name "King James Bible, Genesis 1:1-2:25 (Debian bible-kjv-text)" \
  --json "$OUT/e2e-stories260k-text.json" > /dev/null

"${PLOT_PYTHON:-$PY}" examples/python/accuracy_report.py

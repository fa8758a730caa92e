#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# One method's parameter settings on one half of a validation suite (docs/accuracy.md), one
# `kvsieve eval` per setting, merged into one JSON file: {"suite", "half", "method", "budget",
# "runs": [{"params", "result"}]} ("result" is that run's `eval --json` output).
#   tools/accuracy/sweep.sh LIST HALF METHOD OUT.json P...
# P is a parameter text (key=value,key=value) or "-" for the method's defaults.
# Environment: KVSIEVE (default build/kvsieve), BUDGET (0.05), THREADS (1), PYTHON (python3).
# Prints one line per setting: mean mass recall, mean 5th-percentile step, mean output error,
# worst trace's mass recall (the eval's summary row).
set -euo pipefail
[ $# -ge 5 ] || { sed -n 3,10p "$0" >&2; exit 2; }
LIST=$1 HALF=$2 METHOD=$3 OUTJ=$4
shift 4
KVS=${KVSIEVE:-build/kvsieve}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
i=0
for p in "$@"; do
  i=$((i + 1))
  args=()
  [ "$p" = - ] || args=(--params "$METHOD:$p")
  "$KVS" eval --suite "$LIST" --half "$HALF" --methods "$METHOD" "${args[@]}" --budget "${BUDGET:-0.05}" \
    --threads "${THREADS:-1}" --json "$TMP/$i.json" >"$TMP/$i.txt" 2>&1 || { cat "$TMP/$i.txt" >&2; exit 1; }
  printf '%s\n' "$p" >"$TMP/$i.params"
done
"${PYTHON:-python3}" - "$LIST" "$HALF" "$METHOD" "${BUDGET:-0.05}" "$OUTJ" "$TMP" "$i" <<'EOF'
import json, sys
lst, half, method, budget, out, tmp, n = sys.argv[1:]
runs = []
for i in range(1, int(n) + 1):
    p = open(f"{tmp}/{i}.params").read().strip()
    r = json.load(open(f"{tmp}/{i}.json"))
    runs.append({"params": "(defaults)" if p == "-" else p, "result": r})
    s = next(x for x in r["summary"] if x["name"] == method)
    print(f"{runs[-1]['params']:<50} mass {s['mass_recall']:.3f}  p5 {s['mass_recall_p5']:.3f}  "
          f"err {s['output_rel_err']:.3f}  worst {s['worst_mass_recall']:.3f} ({s['worst_trace'].rsplit('/', 1)[-1]})")
json.dump({"suite": lst, "half": half, "method": method, "budget": float(budget), "runs": runs},
          open(out, "w"), indent=1)
EOF

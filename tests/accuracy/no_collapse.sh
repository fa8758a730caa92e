#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# "No collapse" (docs/accuracy.md, "No collapse below streaming"): at a 5% budget, csattention, hgca,
# lfps and retroinfer at their defaults keep at least streaming's mass recall while attending at most
# streaming's keys, on the stories260K trace shipped in tests/data (a real model, 512 tokens) and on
# a short synthetic trace (`kvsieve synth --seed 2 --prefill 512 --decode 32`, below retroinfer's
# indexing threshold; docs/methods.md's "synth 512"). Each method fell below streaming on one of
# them before 2026-11-26 (stories260K: hgca 0.626, lfps 0.747, csattention 0.747 vs 0.763 —
# csattention's 1-dim subspaces at head_dim 8; synthetic: retroinfer 0.130 vs 0.235).
#
#   tests/accuracy/no_collapse.sh path/to/kvsieve path/to/stories260k-gen-t512.safetensors
#
# Tolerances: mass recall >= streaming's - 0.002, kept fraction <= streaming's + 0.001. Below its
# indexing threshold (index_min, 1024 clusterable tokens) retroinfer selects exactly streaming's keys
# (equal mass recall; indexed from 64 tokens instead, index_min=0, it fell to 0.735 on stories260K); csattention
# clears streaming by 0.008 (stories260K) and 0.63 (synthetic), hgca clears
# streaming by 0.008 (stories260K) and 0.36 (synthetic), lfps by 0.036 and 0.30. 0.002 absorbs
# rounding differences of the attention kernels between instruction sets (AVX-512, AVX2, scalar)
# and stays well below the failures it guards against (0.016 to 0.137 below streaming). Every method attends exactly the budget
# per KV head, as streaming does, so the kept fractions are equal; 0.001 is rounding.
# Needs python3 to read the JSON (exit 77, skipped, without it).
set -u
KVS=${1:?usage: no_collapse.sh path/to/kvsieve stories260k.safetensors}
STORIES=${2:?usage: no_collapse.sh path/to/kvsieve stories260k.safetensors}
command -v python3 >/dev/null 2>&1 || { echo "no_collapse.sh: python3 not found, skipped"; exit 77; }
TMP=$(mktemp -d "${TMPDIR:-/tmp}/kvsieve-nocollapse.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
"$KVS" synth --out "$TMP/short.safetensors" --seed 2 --prefill 512 --decode 32 -q || exit 1
FAIL=0
for T in "$STORIES" "$TMP/short.safetensors"; do
  "$KVS" eval --trace "$T" --methods streaming,csattention,hgca,lfps,retroinfer --budget 0.05 --threads 1 \
    --json "$TMP/r.json" >"$TMP/table.txt" 2>&1 || { cat "$TMP/table.txt"; exit 1; }
  python3 - "$TMP/r.json" "$(basename "$T")" <<'PY' || FAIL=1
import json, sys
d = json.load(open(sys.argv[1]))
by = {m["name"]: m for m in d["methods"]}
s = by["streaming"]
bad = False
for name in ("csattention", "hgca", "lfps", "retroinfer"):
    m = by[name]
    ok = m["mass_recall"] >= s["mass_recall"] - 0.002 and m["kept_fraction"] <= s["kept_fraction"] + 0.001
    print(f"{sys.argv[2]}: {name} mass recall {m['mass_recall']:.4f} kept {m['kept_fraction']:.4f}; "
          f"streaming {s['mass_recall']:.4f} kept {s['kept_fraction']:.4f}: {'ok' if ok else 'FAIL'}")
    bad |= not ok
sys.exit(1 if bad else 0)
PY
done
exit $FAIL

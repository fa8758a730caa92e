#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Seed corpora and dictionaries of the fuzzers, made with the kvsieve command (nothing binary is
# committed):
#
#   tests/fuzz/make_corpus.sh path/to/kvsieve OUT_DIR
#
# writes
#   OUT_DIR/trace/          traces from `kvsieve synth` (three dtypes, absent layers) + the golden trace
#   OUT_DIR/tables/         `kvsieve build` of every CPU method, with and without the KV cache, + the
#                           golden tables file
#   OUT_DIR/method_params/  every parameter of every method at its default, one file each and all of
#                           a method's in one (from `kvsieve methods --json`), + the hand-written
#                           tests/fuzz/seeds/method_params/*
#   OUT_DIR/tables.dict     tests/fuzz/tables.dict + the seeds' header keys, values and section tags
#   OUT_DIR/method_params.dict  parameter names and enum values
# Shapes are tiny, so one input runs in about a millisecond. Needs python3.
set -euo pipefail
KVS=${1:?usage: make_corpus.sh path/to/kvsieve OUT_DIR}
OUT=${2:?usage: make_corpus.sh path/to/kvsieve OUT_DIR}
HERE=$(cd "$(dirname "$0")" && pwd)
GOLDEN=$HERE/../data/golden
# One thread: the corpus does not depend on it, and a sanitizer build of the command stays quiet.
export OMP_NUM_THREADS=1
rm -rf "$OUT/trace" "$OUT/tables" "$OUT/method_params"
mkdir -p "$OUT/trace" "$OUT/tables" "$OUT/method_params"
TMP=$(mktemp -d "${TMPDIR:-/tmp}/kvsieve-corpus.XXXXXX")
trap 'rm -rf "$TMP"' EXIT

# quiet CMD...: runs CMD, showing its stderr (warnings about the tiny shapes) only when it fails.
quiet() {
  if ! "$@" 2>"$TMP/stderr"; then
    cat "$TMP/stderr" >&2
    echo "make_corpus.sh: failed: $*" >&2
    exit 1
  fi
}

# ---- traces ------------------------------------------------------------------------------------
SMALL=(--q-heads 2 --kv-heads 1 --head-dim 16 --prefill 64 --decode 2 --segments 2 --threads 1 -q)
quiet "$KVS" synth --out "$OUT/trace/bf16-2layers.safetensors" --layers 2 --dtype bf16 "${SMALL[@]}"
quiet "$KVS" synth --out "$OUT/trace/f16-present1of3.safetensors" --layers 3 --present 1 --dtype f16 \
  --q-heads 4 --kv-heads 2 --head-dim 8 --prefill 32 --decode 1 --segments 1 --threads 1 -q
quiet "$KVS" synth --out "$OUT/trace/f32-1layer.safetensors" --layers 1 --dtype f32 --q-heads 2 --kv-heads 2 \
  --head-dim 8 --prefill 16 --decode 4 --segments 1 --threads 1 -q
cp "$GOLDEN"/*.safetensors "$OUT/trace/"

# ---- tables ------------------------------------------------------------------------------------
quiet "$KVS" synth --out "$TMP/bf16.safetensors" --layers 2 --dtype bf16 "${SMALL[@]}"
quiet "$KVS" synth --out "$TMP/f16-present1.safetensors" --layers 2 --present 1 --dtype f16 "${SMALL[@]}"
quiet "$KVS" methods --json >"$TMP/methods.json"
mapfile -t METHODS < <(python3 -c 'import json, sys
for m in json.load(open(sys.argv[1]))["methods"]:
    if "cpu" in m["backends"]: print(m["name"])' "$TMP/methods.json")
# Small parameters where the defaults make large tables (or none at all) on a 64-token prompt.
small_params() {
  case $1 in
    csattention) echo centroids=8,subspaces=4 ;;
    ctkvr) echo centroids=16,rho=32,local=8 ;;
    retroinfer) echo update_segment=16,index_min=0,cluster_size=8,local=8,sinks=2 ;;
    quest) echo page_size=8 ;;
    *) echo "" ;;
  esac
}
for m in "${METHODS[@]}"; do
  P=$(small_params "$m")
  quiet "$KVS" build --trace "$TMP/bf16.safetensors" --method "$m" ${P:+--params "$P"} --budget 0.25 --threads 1 \
    -q --out "$OUT/tables/$m.kvs"
  quiet "$KVS" build --trace "$TMP/f16-present1.safetensors" --method "$m" ${P:+--params "$P"} --budget 0.25 \
    --threads 1 -q --include-kv --out "$OUT/tables/$m-kv.kvs"
done
cp "$GOLDEN"/*.kvs "$OUT/tables/"
mkdir "$TMP/describe"
for f in "$OUT"/tables/*; do quiet "$KVS" inspect --json "$f" >"$TMP/describe/${f##*/}.json"; done

# ---- dictionaries and method_params --------------------------------------------------------------
python3 - "$TMP" "$OUT" "$HERE/tables.dict" <<'PY'
import glob, json, sys
tmp, out, fixed = sys.argv[1:4]

def entry(word):
    # libFuzzer's dictionary syntax: printable ASCII, with \\, \" and \xNN escapes.
    out = ""
    for b in word.encode():
        c = chr(b)
        out += "\\" + c if c in '\\"' else c if 0x20 <= b < 0x7F else "\\x%02X" % b
    return '"%s"\n' % out

# tables.dict: the JSON keys (with their colon), short string values and section tags of the seeds.
words = set()
def walk(v):
    if isinstance(v, dict):
        for k, x in v.items():
            words.add('"%s":' % k)
            walk(x)
    elif isinstance(v, list):
        for x in v:
            walk(x)
    elif isinstance(v, str) and len(v) <= 32:
        words.add('"%s"' % v)
for path in sorted(glob.glob(f"{tmp}/describe/*.json")):
    d = json.load(open(path))
    walk(d.get("header"))
    for s in d.get("sections", []):
        words.add(s["tag"])
with open(f"{out}/tables.dict", "w") as f:
    f.write(open(fixed).read())
    f.writelines(entry(w) for w in sorted(words))

# method_params: name=default per parameter and per method; the dictionary: names and enum values.
words = set()
for m in json.load(open(f"{tmp}/methods.json"))["methods"]:
    items = []
    for p in m["params"]:
        item = p["name"] + "=" + p["default"]
        items.append(item)
        words.add(p["name"] + "=")
        if p["type"].startswith("enum:"):
            words.update(p["type"][5:].split("|"))
        with open(f"{out}/method_params/{m['name']}-{p['name']}", "w") as f:
            f.write(item)
    if items:
        with open(f"{out}/method_params/{m['name']}-all", "w") as f:
            f.write(",".join(items))
with open(f"{out}/method_params.dict", "w") as f:
    f.writelines(entry(w) for w in sorted(words))
PY
cp "$HERE"/seeds/method_params/* "$OUT/method_params/"
echo "make_corpus.sh: $(ls "$OUT/trace" | wc -l) traces, $(ls "$OUT/tables" | wc -l) tables files," \
  "$(ls "$OUT/method_params" | wc -l) method_params strings in $OUT"

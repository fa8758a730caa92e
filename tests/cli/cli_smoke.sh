#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Smoke tests of the kvsieve command: every subcommand on small inputs, the JSON it writes, and its
# error exits (0 ok, 1 runtime error, 2 usage error, 3 corrupt file; docs/cli.md).
#
#   tests/cli/cli_smoke.sh path/to/kvsieve
#
# Prints one line per failure (with the command's stderr) and ends with "N passed, M failed";
# exits nonzero when anything failed. Needs bash, cmp, dd, head, od; python3 (if present) checks the
# JSON documents key by key.
set -u

KVS=${1:?usage: cli_smoke.sh path/to/kvsieve}
if [[ ! -x $KVS ]]; then
  echo "cli_smoke.sh: '$KVS' is not an executable" >&2
  echo "0 passed, 1 failed"
  exit 1
fi
TMP=$(mktemp -d "${TMPDIR:-/tmp}/kvsieve-smoke.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
OUT=$TMP/stdout
ERR=$TMP/stderr
PASSED=0
FAILED=0
HAVE_PY=0
command -v python3 >/dev/null 2>&1 && HAVE_PY=1

ok() { PASSED=$((PASSED + 1)); }
ko() {
  FAILED=$((FAILED + 1))
  echo "FAIL: $1"
  if [[ -s $ERR ]]; then sed 's/^/    stderr: /' "$ERR" | head -n 5; fi
}

# expect WANT NAME CMD...: runs CMD; WANT is an exit code or "nonzero".
expect() {
  local want=$1 name=$2
  shift 2
  "$@" >"$OUT" 2>"$ERR"
  local rc=$?
  if [[ $want == nonzero && $rc -ne 0 ]] || [[ $want == "$rc" ]]; then
    ok
  else
    ko "$name: exit $rc, expected $want ($*)"
  fi
}

# contains FILE TEXT NAME: the last command's stdout/stderr file holds TEXT.
contains() {
  if grep -qF -- "$2" "$1"; then ok; else ko "$3: output lacks '$2'"; fi
}

# one_line NAME: the last command wrote exactly one line to stderr, starting "kvsieve: error:".
one_error_line() {
  if [[ $(wc -l <"$ERR") -eq 1 ]] && grep -q '^kvsieve: error: ' "$ERR"; then ok; else ko "$1: expected one 'kvsieve: error:' line on stderr"; fi
}

# py NAME SCRIPT ARGS...: a python3 check (skipped, counted as passed, without python3).
py() {
  local name=$1 script=$2
  shift 2
  if [[ $HAVE_PY -eq 0 ]]; then ok; return; fi
  if python3 -c "$script" "$@" >"$TMP/py.out" 2>&1; then ok; else
    ko "$name: $(tail -n 1 "$TMP/py.out")"
  fi
}

# ---- top level ---------------------------------------------------------------------------------
expect 0 "--help" "$KVS" --help
for cmd in demo methods synth build inspect eval bench; do
  contains "$OUT" "$cmd" "--help lists $cmd"
done
for cmd in demo methods synth build inspect eval bench; do
  expect 0 "$cmd --help" "$KVS" "$cmd" --help
done
expect 0 "--version" "$KVS" --version
contains "$OUT" "kvsieve" "--version"
expect 2 "no command" "$KVS"
one_error_line "no command"
expect 2 "unknown command" "$KVS" frobnicate
expect 2 "unknown option" "$KVS" methods --frob
one_error_line "unknown option"

# ---- methods -----------------------------------------------------------------------------------
expect 0 "methods" "$KVS" methods
contains "$OUT" "full" "methods lists full"
expect 0 "methods --json" "$KVS" methods --json
cp "$OUT" "$TMP/methods.json"
py "methods --json schema" '
import json, sys
d = json.load(open(sys.argv[1]))
names = [m["name"] for m in d["methods"]]
assert "full" in names, names
for m in d["methods"]:
    assert set(m) == {"name", "doc", "backends", "params"}, m.keys()
    for p in m["params"]:
        assert set(p) == {"name", "type", "default", "doc"}, p.keys()
' "$TMP/methods.json"
# The method and parameter descriptions are for users: no references to files that do not ship,
# no internal tags.
py "methods texts cite only shipped documents" '
import json, re, sys
bad = re.compile(r"METHODS\.md|DESIGN\.md|PLACEMENTS\.md|STYLE\.md|PAPER-000|\bRECON\b|\bASSUMPTION\b|/work/|/root/|/home/")
hits = []
for m in json.load(open(sys.argv[1]))["methods"]:
    for where, text in [("doc", m["doc"])] + [("param " + p["name"], p["doc"]) for p in m["params"]]:
        if bad.search(text):
            hits.append(m["name"] + " " + where + ": " + text)
assert not hits, hits
' "$TMP/methods.json"
METHODS=()
if [[ $HAVE_PY -eq 1 ]]; then
  mapfile -t METHODS < <(python3 -c 'import json,sys; [print(m["name"]) for m in json.load(open(sys.argv[1]))["methods"] if "cpu" in m["backends"]]' "$TMP/methods.json" 2>/dev/null)
fi
[[ ${#METHODS[@]} -gt 0 ]] || METHODS=(full)

# ---- synth -------------------------------------------------------------------------------------
SHAPE=(--q-heads 4 --kv-heads 2 --head-dim 32 --prefill 512 --decode 6 --segments 4)
T1=$TMP/t1.safetensors
expect 0 "synth" "$KVS" synth --out "$T1" --layers 3 --present 0,2 --dtype bf16 "${SHAPE[@]}"
contains "$OUT" "layers 0,2 of 3" "synth reports the present layers"
expect 0 "synth again" "$KVS" synth --out "$TMP/t1b.safetensors" --layers 3 --present 0,2 --dtype bf16 --threads 1 -q "${SHAPE[@]}"
if cmp -s "$T1" "$TMP/t1b.safetensors"; then ok; else ko "synth is not deterministic (seed 1, 1 vs all threads)"; fi
expect 0 "synth seed 2" "$KVS" synth --out "$TMP/t1c.safetensors" --layers 3 --present 0,2 --dtype bf16 --seed 2 -q "${SHAPE[@]}"
if ! cmp -s "$T1" "$TMP/t1c.safetensors"; then ok; else ko "synth ignores --seed"; fi
expect 0 "synth f16 --stats" "$KVS" synth --out "$TMP/t16.safetensors" --dtype f16 --stats "${SHAPE[@]}"
contains "$OUT" "top 5% keys" "synth --stats"
T32=$TMP/t32.safetensors
expect 0 "synth f32" "$KVS" synth --out "$T32" --dtype f32 -q "${SHAPE[@]}"
expect 2 "synth heads not a multiple" "$KVS" synth --out "$TMP/x" --q-heads 3 --kv-heads 2
one_error_line "synth heads not a multiple"
expect 2 "synth bad dtype" "$KVS" synth --out "$TMP/x" --dtype f64
expect 2 "synth odd head dim" "$KVS" synth --out "$TMP/x" --head-dim 7
expect 2 "synth absent present layer" "$KVS" synth --out "$TMP/x" --layers 2 --present 5
expect 2 "synth prompt too short" "$KVS" synth --out "$TMP/x" --prefill 8 --segments 16
expect 2 "synth without --out" "$KVS" synth
expect 1 "synth unwritable" "$KVS" synth --out "$TMP/no/such/dir/x.safetensors" -q "${SHAPE[@]}"
one_error_line "synth unwritable"

# ---- build / inspect ---------------------------------------------------------------------------
TB=$TMP/quest.kvt
BUILD_METHOD=quest
[[ " ${METHODS[*]} " == *" quest "* ]] || BUILD_METHOD=${METHODS[0]}
expect 0 "build" "$KVS" build --trace "$T1" --method "$BUILD_METHOD" --budget 0.1 --out "$TB"
contains "$OUT" "2 of 3 layers" "build prefills only the present layers"
expect 0 "build --include-kv" "$KVS" build --trace "$T1" --method "$BUILD_METHOD" --include-kv --out "$TMP/kv.kvt" -q
expect 0 "inspect" "$KVS" inspect "$TB"
contains "$OUT" ": ok" "inspect says ok"
expect 0 "inspect --json" "$KVS" inspect --json "$TMP/kv.kvt"
cp "$OUT" "$TMP/describe.json"
py "inspect --json parses" 'import json, sys; d = json.load(open(sys.argv[1])); assert isinstance(d, dict) and d' "$TMP/describe.json"
SIZE=$(wc -c <"$TB" 2>/dev/null || echo 128)
cp "$TB" "$TMP/flipped.kvt" 2>/dev/null || : >"$TMP/flipped.kvt"
printf '\xde\xad\xbe\xef\xde\xad\xbe\xef' | dd of="$TMP/flipped.kvt" bs=1 seek=$((SIZE - 64)) conv=notrunc 2>/dev/null
expect 3 "inspect a flipped payload" "$KVS" inspect "$TMP/flipped.kvt"
one_error_line "inspect a flipped payload"
head -c $((SIZE / 2)) "$TB" >"$TMP/truncated.kvt" 2>/dev/null
expect 3 "inspect a truncated file" "$KVS" inspect "$TMP/truncated.kvt"
expect 3 "inspect a non-tables file" "$KVS" inspect "$T1"
expect 1 "inspect a missing file" "$KVS" inspect "$TMP/missing.kvt"
one_error_line "inspect a missing file"
expect 2 "inspect without a file" "$KVS" inspect
expect 2 "build unknown method" "$KVS" build --trace "$T1" --method no_such_method --out "$TMP/x.kvt"
contains "$ERR" "available" "build unknown method lists the methods"
expect 1 "build unknown parameter" "$KVS" build --trace "$T1" --method full --params no_such_param=1 --out "$TMP/x.kvt"
expect 1 "build missing trace" "$KVS" build --trace "$TMP/missing.safetensors" --method full --out "$TMP/x.kvt"
expect 2 "build bad budget" "$KVS" build --trace "$T1" --method full --budget 0 --out "$TMP/x.kvt"
expect 2 "build bad backend" "$KVS" build --trace "$T1" --method full --backend tpu --out "$TMP/x.kvt"

# ---- eval --------------------------------------------------------------------------------------
expect 0 "eval" "$KVS" eval --trace "$T1" --methods full,exact_topk --budget 0.1 --json "$TMP/eval.json"
contains "$OUT" "exact_topk" "eval table"
py "eval JSON schema and sanity" '
import json, sys
d = json.load(open(sys.argv[1]))
assert list(d) == ["trace", "trace_bytes", "trace_xxh3_64", "version", "backend", "threads", "budgets",
                   "steps", "layers", "methods"], list(d)
assert d["steps"] == 6 and d["layers"] == 2, (d["steps"], d["layers"])
assert d["budgets"] == [0.1] and d["backend"] == "cpu", d
assert isinstance(d["threads"], int) and d["threads"] >= 1, d["threads"]
keys = ["name", "budget", "kept_fraction", "over_budget", "over_budget_selections", "selections",
        "max_over_budget_ratio", "under_budget", "params", "recall_at_k", "mass_recall", "mass_recall_p5", "layer_mass_recall",
        "output_rel_err", "output_rel_err_p95", "lse_abs_err", "step_us", "full_step_us", "nonfinite_outputs"]
by = {m["name"]: m for m in d["methods"]}
assert list(by) == ["full", "exact_topk"], list(by)
for m in d["methods"]:
    assert list(m) == keys, list(m)
    assert m["step_us"] > 0 and m["full_step_us"] == by["full"]["step_us"]
f, x = by["full"], by["exact_topk"]
assert f["recall_at_k"] == 1 and abs(f["mass_recall"] - 1) < 1e-9, f
assert f["output_rel_err"] < 1e-3 and f["lse_abs_err"] < 1e-3, f
assert x["recall_at_k"] > 0.99, x
assert x["mass_recall"] <= 1 + 1e-9 and x["output_rel_err"] <= x["output_rel_err_p95"] + 1e-12, x
# worst steps and layers: p5 at most the mean; the per-layer means average to the mean (equal weights).
assert abs(f["mass_recall_p5"] - 1) < 1e-9 and len(f["layer_mass_recall"]) == d["layers"], f
assert x["mass_recall_p5"] <= x["mass_recall"] + 1e-12, x
lm = list(x["layer_mass_recall"].values())
assert len(lm) == 2 and abs(sum(lm) / 2 - x["mass_recall"]) < 1e-9, (lm, x["mass_recall"])
# kept fraction: full attends every key; exact_topk about the budget (0.1 of 513..518 keys).
assert abs(f["kept_fraction"] - 1) < 1e-9, f["kept_fraction"]
assert 0.09 <= x["kept_fraction"] <= 0.12, x["kept_fraction"]
# resolved parameters: every parameter of the method, defaults filled in.
assert f["params"] == {}, f["params"]
assert set(x["params"]) >= {"sinks", "local"}, x["params"]
' "$TMP/eval.json"
# A method under 0.9 x the budget's keys (ctkvr with the paper's recall of one list of 4 keys) is
# marked '~' with a warning; one that keeps the budget is not.
expect 0 "eval under budget" "$KVS" eval --trace "$T1" --methods exact_topk,ctkvr --params ctkvr:recall=lambda,rho=4,lambda=1 \
  --budget 0.1 --json "$TMP/eval_under.json"
contains "$OUT" "% ~" "eval marks a row under the budget"
contains "$ERR" "ctkvr attends" "eval warns about a row under the budget"
py "eval under_budget in the JSON" '
import json, sys
by = {m["name"]: m for m in json.load(open(sys.argv[1]))["methods"]}
assert by["ctkvr"]["under_budget"] is True and by["ctkvr"]["kept_fraction"] < 0.09, by["ctkvr"]
assert by["exact_topk"]["under_budget"] is False and by["exact_topk"]["over_budget"] is False, by["exact_topk"]
' "$TMP/eval_under.json"
# --suite: every trace of a list, then per method the mean over the traces and the worst.
mkdir -p "$TMP/suite"
cp "$T1" "$TMP/suite/a.safetensors"
cp "$TMP/t1c.safetensors" "$TMP/suite/b.safetensors"
printf '# two synthetic traces\na.safetensors tuning\n\nb.safetensors   heldout  # seed 2\n' > "$TMP/suite/list.txt"
expect 0 "eval --suite" "$KVS" eval --suite "$TMP/suite/list.txt" --methods full,exact_topk --budget 0.1 --json "$TMP/suite.json"
contains "$OUT" "worst trace" "eval --suite summary"
py "eval --suite: the summary is the mean over the traces and their minimum" '
import json, sys
d = json.load(open(sys.argv[1]))
assert d["half"] == "all" and len(d["traces"]) == 2, d.keys()
per = [{m["name"]: m for m in t["methods"]} for t in d["traces"]]
for s in d["summary"]:
    vals = [p[s["name"]]["mass_recall"] for p in per]
    assert abs(s["mass_recall"] - sum(vals) / 2) < 1e-12, (s, vals)
    assert s["worst_mass_recall"] == min(vals), (s, vals)
    assert s["worst_trace"].endswith(("a.safetensors", "b.safetensors")), s
    assert abs(s["kept_fraction"] - sum(p[s["name"]]["kept_fraction"] for p in per) / 2) < 1e-12
' "$TMP/suite.json"
expect 0 "eval --suite --half heldout" "$KVS" eval --suite "$TMP/suite/list.txt" --half heldout --methods full --json -
py "eval --suite --half heldout runs the held-out traces only" '
import json, sys
d = json.load(open(sys.argv[1]))
assert d["half"] == "heldout" and len(d["traces"]) == 1 and d["traces"][0]["trace"].endswith("b.safetensors"), d
' "$OUT"
printf 'a.safetensors sideways\n' > "$TMP/suite/bad.txt"
expect 2 "eval --suite with a bad half" "$KVS" eval --suite "$TMP/suite/bad.txt" --methods full
contains "$ERR" "line 1" "eval --suite names the bad line"
expect 2 "eval with --trace and --suite" "$KVS" eval --trace "$T1" --suite "$TMP/suite/list.txt"
expect 2 "eval with neither --trace nor --suite" "$KVS" eval --methods full
VERSION=$("$KVS" --version | head -n 1)
py "eval JSON version, checksum and size match the library and the trace" '
import json, os, sys
d = json.load(open(sys.argv[1]))
assert d["version"] and d["version"] in sys.argv[3], (d["version"], sys.argv[3])
assert d["trace_bytes"] == os.path.getsize(sys.argv[2]), d["trace_bytes"]
h = d["trace_xxh3_64"]
assert len(h) == 16 and int(h, 16) != 0, h
try:
    import xxhash
except ImportError:
    pass
else:
    assert h == xxhash.xxh3_64_hexdigest(open(sys.argv[2], "rb").read()), h
' "$TMP/eval.json" "$T1" "$VERSION"
expect 0 "eval the same trace again" "$KVS" eval --trace "$T1" --methods full --steps 1 --json "$TMP/eval_again.json"
expect 0 "eval another trace" "$KVS" eval --trace "$T32" --methods full --steps 1 --json "$TMP/eval_other.json"
py "eval checksum is of the file: same file, same value; another file, another" '
import json, sys
a, b, c = (json.load(open(p)) for p in sys.argv[1:4])
assert a["trace_xxh3_64"] == b["trace_xxh3_64"], (a["trace_xxh3_64"], b["trace_xxh3_64"])
assert a["trace_xxh3_64"] != c["trace_xxh3_64"], "two different traces, one checksum"
' "$TMP/eval.json" "$TMP/eval_again.json" "$TMP/eval_other.json"
expect 0 "eval --params shows in the resolved parameters" "$KVS" eval --trace "$T1" --methods exact_topk --params exact_topk:sinks=2,local=4 --steps 1 --threads 1 --json "$TMP/params.json"
py "eval JSON params and threads" '
import json, sys
d = json.load(open(sys.argv[1]))
p = d["methods"][0]["params"]
assert str(p["sinks"]) == "2" and str(p["local"]) == "4", p
assert d["threads"] == 1, d["threads"]
' "$TMP/params.json"

# eval --budgets: a sweep, one row per method per budget
expect 0 "eval --budgets" "$KVS" eval --trace "$T1" --methods full,exact_topk,streaming --budgets 0.05,0.1,0.2 --steps 2 --json "$TMP/sweep.json"
contains "$OUT" "budgets 0.05,0.1,0.2" "eval --budgets names the budgets"
py "eval --budgets: one row per method per budget, kept fraction follows the budget" '
import json, sys
d = json.load(open(sys.argv[1]))
assert d["budgets"] == [0.05, 0.1, 0.2], d["budgets"]
rows = [(m["name"], m["budget"]) for m in d["methods"]]
want = [(n, b) for b in (0.05, 0.1, 0.2) for n in ("full", "exact_topk", "streaming")]
assert rows == want, rows
kept = {(m["name"], m["budget"]): m["kept_fraction"] for m in d["methods"]}
mass = {(m["name"], m["budget"]): m["mass_recall"] for m in d["methods"]}
for n in ("exact_topk", "streaming"):
    assert kept[(n, 0.05)] < kept[(n, 0.1)] < kept[(n, 0.2)], (n, kept)
    assert mass[(n, 0.05)] <= mass[(n, 0.2)] + 1e-9, (n, mass)
    for b in (0.05, 0.1, 0.2):
        assert abs(kept[(n, b)] - b) < 0.03, (n, b, kept[(n, b)])
for b in (0.05, 0.1, 0.2):
    assert kept[("full", b)] == 1, kept
' "$TMP/sweep.json"
if [[ $(grep -c '^exact_topk' "$OUT") -eq 3 ]]; then ok; else ko "eval --budgets prints one exact_topk row per budget"; fi
expect 2 "eval --budgets with --budget" "$KVS" eval --trace "$T1" --methods full --budget 0.1 --budgets 0.1,0.2
contains "$ERR" "--budget" "eval --budgets with --budget names the option"
expect 2 "eval --budgets out of range" "$KVS" eval --trace "$T1" --methods full --budgets 0.1,1.5
contains "$ERR" "--budgets: 1.5 is outside (0, 1]" "eval --budgets names the bad budget"
one_error_line "eval --budgets out of range"
expect 2 "eval --budgets not a number" "$KVS" eval --trace "$T1" --methods full --budgets 0.1,abc
contains "$ERR" "--budgets: 'abc' is not a number" "eval --budgets names the bad item"
expect 2 "eval --budgets repeated" "$KVS" eval --trace "$T1" --methods full --budgets 0.1,0.1
contains "$ERR" "given twice" "eval --budgets repeated"
expect 2 "eval --budgets empty" "$KVS" eval --trace "$T1" --methods full --budgets ,

# eval --json -: the JSON document alone on stdout, the table on stderr, no file named -
KVS_ABS=$(cd "$(dirname "$KVS")" && pwd)/$(basename "$KVS")
(cd "$TMP" && "$KVS_ABS" eval --trace "$T1" --methods full,exact_topk --budget 0.1 --steps 2 --json - >"$TMP/json_stdout" 2>"$TMP/json_stderr")
rc=$?
if [[ $rc -eq 0 ]]; then ok; else ko "eval --json -: exit $rc"; fi
if [[ ! -e $TMP/- ]]; then ok; else ko "eval --json - wrote a file named -"; fi
if grep -q "exact_topk" "$TMP/json_stderr"; then ok; else ko "eval --json - puts the table on stderr"; fi
py "eval --json - writes only JSON to stdout" '
import json, sys
d = json.load(open(sys.argv[1]))
assert [m["name"] for m in d["methods"]] == ["full", "exact_topk"], d["methods"]
assert d["steps"] == 2, d["steps"]
' "$TMP/json_stdout"
# eval --plot FILE.png: drawn by Python's matplotlib ($KVSIEVE_PYTHON, else python3); without it, a
# clear error before the replay.
KVSIEVE_PYTHON=$TMP/no-such-python expect 1 "eval --plot without a Python" "$KVS" eval --trace "$T1" --methods full --steps 1 --plot "$TMP/p.png"
contains "$ERR" "--plot needs Python with matplotlib: '$TMP/no-such-python' could not be run" "eval --plot names the missing Python"
one_error_line "eval --plot without a Python"
if [[ ! -e $TMP/p.png ]]; then ok; else ko "eval --plot without a Python wrote a PNG"; fi
PLOT_PY=${KVS_TEST_PLOT_PYTHON:-python3}
if "$PLOT_PY" -c "import matplotlib" >/dev/null 2>&1; then
  KVSIEVE_PYTHON=$PLOT_PY expect 0 "eval --plot" "$KVS" eval --trace "$T1" --methods full,exact_topk,streaming --budgets 0.05,0.2 --steps 1 --plot "$TMP/p.png" --json -
  if [[ $(head -c 8 "$TMP/p.png" | od -An -tx1 | tr -d ' \n') == 89504e470d0a1a0a ]]; then ok; else ko "eval --plot did not write a PNG"; fi
  py "eval --plot keeps stdout JSON" 'import json, sys; json.load(open(sys.argv[1]))' "$OUT"
else
  KVSIEVE_PYTHON=$PLOT_PY expect 1 "eval --plot without matplotlib" "$KVS" eval --trace "$T1" --methods full --steps 1 --plot "$TMP/p.png"
  contains "$ERR" "cannot import matplotlib" "eval --plot says matplotlib is missing"
  one_error_line "eval --plot without matplotlib"
fi
expect 0 "eval all, f32, 2 steps" "$KVS" eval --trace "$T32" --methods all --steps 2 --threads 1 --json "$TMP/all.json"
for m in "${METHODS[@]}"; do contains "$OUT" "$m" "eval --methods all runs $m"; done
py "eval --steps limits the steps" 'import json, sys; d = json.load(open(sys.argv[1])); assert d["steps"] == 2, d["steps"]' "$TMP/all.json"
expect 2 "eval unknown methods" "$KVS" eval --trace "$T1" --methods full,no_such_method,other
contains "$ERR" "no_such_method, other" "eval names the unknown methods"
contains "$ERR" "available: " "eval lists the available methods"
one_error_line "eval unknown methods"
expect 2 "eval params of an absent method" "$KVS" eval --trace "$T1" --methods full --params exact_topk:sinks=1
expect 2 "eval params without method" "$KVS" eval --trace "$T1" --methods full --params sinks=1
expect 1 "eval bad parameter value" "$KVS" eval --trace "$T1" --methods exact_topk --params exact_topk:sinks=abc
expect 0 "eval method params" "$KVS" eval --trace "$T1" --methods exact_topk --params exact_topk:sinks=2,local=4 --steps 1
expect 1 "eval missing trace" "$KVS" eval --trace "$TMP/missing.safetensors" --methods full
expect 2 "eval bad budget" "$KVS" eval --trace "$T1" --budget 1.5
expect 0 "synth without decode" "$KVS" synth --out "$TMP/nodecode.safetensors" --decode 0 -q --q-heads 2 --kv-heads 1 --head-dim 16 --prefill 64 --segments 2
expect 1 "eval a trace without decode steps" "$KVS" eval --trace "$TMP/nodecode.safetensors" --methods full
one_error_line "eval a trace without decode steps"

# ---- bench -------------------------------------------------------------------------------------
BENCH=(--context 1024 --q-heads 4 --kv-heads 2 --head-dim 64 --steps 3 --warmup 1 --threads 2)
expect 0 "bench" "$KVS" bench --method "$BUILD_METHOD" "${BENCH[@]}" --membw-mib 16 --stats no_such_stat --json "$TMP/bench.json"
contains "$OUT" "speedup vs full" "bench summary"
contains "$OUT" "phases, median us/step: update" "bench phase split"
py "bench JSON schema" '
import json, sys
d = json.load(open(sys.argv[1]))
keys = ["method", "params", "backend", "threads", "context", "q_heads", "kv_heads", "head_dim", "dtype", "budget",
        "steps", "batch", "step_us", "full_step_us", "step_p99_us", "full_step_p99_us", "step_mean_us",
        "full_step_mean_us", "speedup_vs_full", "update_us", "select_us", "attention_us", "index_build_ms", "achieved_GBps", "measured_read_GBps",
        "index_bytes", "kv_bytes", "stats"]
assert list(d) == keys, list(d)
assert d["context"] == 1024 and d["steps"] == 3 and d["dtype"] == "bf16" and d["batch"] == 1, d
assert d["params"] == "" and d["threads"] == 2 and d["stats"] == {"no_such_stat": None}, d
assert d["step_us"] > 0 and d["full_step_us"] > 0 and d["speedup_vs_full"] > 0, d
assert d["step_p99_us"] >= d["step_us"] and d["full_step_p99_us"] >= d["full_step_us"], d
# Over 3 steps the mean lies between the smallest and the interpolated p99: (v1 + v2 + v3) / 3 <=
# v2 + (v3 - v2) / 3 <= v2 + 0.98 (v3 - v2).
for m, p in (("step_mean_us", "step_p99_us"), ("full_step_mean_us", "full_step_p99_us")):
    assert 0 < d[m] <= d[p] * (1 + 1e-9), (m, d)
# The phases are parts of the step: each positive (the method updates, searches and attends), their
# sum at most the step (medians of each part; the step adds the output conversion).
ph = [d["update_us"], d["select_us"], d["attention_us"]]
assert min(ph) > 0 and sum(ph) <= 1.5 * d["step_us"], d
assert d["achieved_GBps"] > 0 and d["measured_read_GBps"] > 0 and d["kv_bytes"] > 0, d
' "$TMP/bench.json"
expect 0 "bench full, no probe" "$KVS" bench --method full "${BENCH[@]}" --no-membw --dtype f16
# --batch: three sessions of each kind stepped by kvs_decode_batch; the bytes read are the batch's.
expect 0 "bench batch" "$KVS" bench --method ctkvr --params rho=64,lambda=2 "${BENCH[@]}" --no-membw --batch 3 --stats recalled_centroids --json "$TMP/bench3.json"
contains "$OUT" "batches of 3 sessions per kind" "bench batch summary"
py "bench batch JSON" '
import json, sys
d = json.load(open(sys.argv[1]))
assert d["batch"] == 3 and d["step_us"] > 0 and d["full_step_us"] > 0 and d["select_us"] > 0, d
# The parameters and the method statistic asked for are recorded (ctkvr recalls at least lambda lists).
assert d["method"] == "ctkvr" and d["params"] == "rho=64,lambda=2" and d["stats"]["recalled_centroids"] >= 2, d
' "$TMP/bench3.json"
contains "$OUT" "reads 1.5 MiB" "bench batch reads three sessions' KV (3 x 1027 tokens x 512 bytes)"
expect 2 "bench batch 0" "$KVS" bench --method full "${BENCH[@]}" --batch 0
# bench --backend cuda: a build without CUDA refuses (exit 2, pointing at bench/); a CUDA build on a
# machine without a GPU says so (exit 1); with a GPU it runs.
"$KVS" bench --method full --backend cuda --context 2048 --steps 2 --no-membw >"$OUT" 2>"$ERR"
rc=$?
if [[ $rc -eq 2 ]]; then contains "$ERR" "bench/" "bench cuda (no CUDA build) points at bench/"
elif [[ $rc -eq 1 ]]; then contains "$ERR" "CUDA device" "bench cuda (no GPU) names the missing device"
elif [[ $rc -eq 0 ]]; then contains "$OUT" "bench" "bench cuda runs"
else ko "bench cuda: exit $rc"; fi
one_error_line_or_ok() { if [[ $rc -eq 0 ]]; then ok; else one_error_line "$1"; fi; }
one_error_line_or_ok "bench cuda"
expect 2 "bench unknown method" "$KVS" bench --method no_such_method "${BENCH[@]}"
expect 2 "bench without method" "$KVS" bench
expect 2 "bench tiny context" "$KVS" bench --method full --context 8

# ---- demo --------------------------------------------------------------------------------------
expect 0 "demo" "$KVS" demo --out-dir "$TMP/demo" --quick --threads 2
contains "$OUT" "accuracy on a real model" "demo replays the real-model trace"
contains "$OUT" "stories260k" "demo names the real-model trace"
contains "$OUT" "vs full" "demo prints the table"
for m in "${METHODS[@]}"; do contains "$OUT" "$m" "demo evaluates $m"; done
for m in "${METHODS[@]}"; do
  [[ $m == full ]] && continue
  contains "$OUT" "$m: " "demo has a take-away line for $m"
done
contains "$OUT" "of the attention mass on stories260K" "demo take-away lines quote the mass recall"
if [[ -s $TMP/demo/eval.json && -s $TMP/demo/bench.json ]]; then ok; else ko "demo leaves eval.json and bench.json"; fi
expect 0 "demo cuda" "$KVS" demo --out-dir "$TMP/demo-cuda" --quick --threads 2 --backend cuda
contains "$OUT" "speed on the GPU" "demo --backend cuda reports the GPU part (run or not run)"
expect 0 "verbose flag" "$KVS" -v methods
expect 1 "demo unwritable dir" "$KVS" demo --out-dir /proc/kvsieve-demo

echo "$PASSED passed, $FAILED failed"
[[ $FAILED -eq 0 ]]

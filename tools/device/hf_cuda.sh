#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# On the GPU machine: the transformers integration (examples/python/kvsieve_hf.py) with kvsieve's
# cuda backend. Builds the Python binding with CUDA into build-gpu (as tools/device/bindings_cuda.sh:
# kvsieve's Debian build dependencies carried as .deb files in .debs/, unpacked into a private
# sysroot), then
#   1. tests/python/test_hf_integration.py with KVSIEVE_HF_BACKEND=cuda: a tiny random Llama on the
#      GPU, kvsieve full and exact_topk (budget 1.0) vs transformers' eager attention, fp16 KV;
#   2. examples/python/generate_hf.py --backend cuda: a random 4-layer Llama (bf16, 2048-token prompt,
#      exact_topk 0.1 vs full) and, if a model is carried in .hfmodel/ (a directory transformers can
#      load, or one holding a .gguf; optional .hfmodel/prompt.txt), real text.
# Logs under $OUT. transformers must be importable by PYTHON (the 'cuda' image has 5.17; else carry
# wheels in .whl/, /work/.library/device/README.md).
#   tools/device/hf_cuda.sh [PYTHON]
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/kvs_out}
mkdir -p "$OUT"
PY=${1:-$(command -v python3)}
if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/env.txt"
"$PY" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__, "cuda", torch.cuda.is_available())' | tee -a "$OUT/env.txt"

# The binding with the cuda backend (skipped when build-gpu already holds one, e.g. carried).
if ! ls build-gpu/bindings/python/kvsieve/_capi*.so >/dev/null 2>&1; then
  . tests/bindings/debs_sysroot.sh   # KVS_SYSROOT_ARGS; unpacks .debs/ when present
  [ -x /usr/local/cuda/bin/nvcc ] && export PATH=/usr/local/cuda/bin:$PATH
  cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVS_WITH_CUDA=ON -DKVS_BUILD_PYTHON=ON \
    -DKVS_BUILD_TESTS=OFF -DPython3_EXECUTABLE="$PY" "${KVS_SYSROOT_ARGS[@]}" >"$OUT/configure.log" 2>&1 \
    || { tail -30 "$OUT/configure.log"; exit 1; }
  cmake --build build-gpu --target kvsieve_python >"$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
elif [ -d /tmp/kvsieve-sysroot ]; then
  export LD_LIBRARY_PATH=/tmp/kvsieve-sysroot/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
fi
export PYTHONPATH=$PWD/build-gpu/bindings/python${PYTHONPATH:+:$PYTHONPATH}
export KVS_GEMM=openblas HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1   # KVS_GEMM: see docs/bindings.md

rc=0
set -o pipefail
echo "== test_hf_integration.py, backend cuda"
KVSIEVE_HF_BACKEND=cuda "$PY" -m pytest -v -rs -p no:cacheprovider tests/python/test_hf_integration.py 2>&1 \
  | tee "$OUT/hf_cuda_test.log" | tail -40 || rc=1
echo "== the same on the cpu backend (this machine's torch/transformers)"
"$PY" -m pytest -q -rs -p no:cacheprovider tests/python/test_hf_integration.py 2>&1 \
  | tee "$OUT/hf_cpu_test.log" | tail -5 || rc=1

echo "== generate_hf.py, random Llama, cuda backend, exact_topk 0.1 vs full"
"$PY" examples/python/generate_hf.py --random-llama --prompt-tokens 2048 --backend cuda \
  --dtype bfloat16 --method exact_topk --budget 0.1 --max-new-tokens 32 --compare-full \
  --json "$OUT/generate_random.json" 2>&1 | tee "$OUT/generate_random.log" | tail -8 || rc=1
# A real model: KVS_HF_MODEL_DIR (default .hfmodel). A carried file is limited to the 64 MiB of the
# working tree per call, so a larger GGUF comes in parts over two calls (docs/real-traces.md):
# NAME.gguf.part-aa, -ab, ... are joined here and checked against NAME.gguf.sha256 when present.
M=${KVS_HF_MODEL_DIR:-.hfmodel}
for first in "$M"/*.gguf.part-aa; do
  [ -e "$first" ] || break
  g=${first%.part-aa}
  cat "$g".part-* > "$g"
  if [ -f "$g.sha256" ]; then
    [ "$(sha256sum "$g" | cut -d' ' -f1)" = "$(cut -d' ' -f1 "$g.sha256")" ] \
      || { echo "$g: sha256 mismatch (a part is missing?)"; rc=1; rm -f "$g"; }
  fi
done
if [ -d "$M" ] && { ls "$M"/*.gguf >/dev/null 2>&1 || [ -f "$M/config.json" ]; }; then
  G=$(ls "$M"/*.gguf 2>/dev/null | head -1)
  GARGS=(--model "$M"); [ -n "$G" ] && GARGS+=(--gguf-file "$(basename "$G")")
  P=$M/prompt.txt; [ -f "$P" ] || P=README.md
  echo "== generate_hf.py, $M, cuda backend, exact_topk 0.05 vs full"
  "$PY" examples/python/generate_hf.py "${GARGS[@]}" --prompt-file "$P" --prompt-tokens 4000 --backend cuda \
    --dtype bfloat16 --method exact_topk --budget 0.05 --max-new-tokens 48 --compare-full \
    --json "$OUT/generate_model.json" 2>&1 | tee "$OUT/generate_model.log" | tail -12 || rc=1
fi
exit $rc

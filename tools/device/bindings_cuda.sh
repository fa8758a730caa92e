#!/usr/bin/env bash
# On the GPU machine: the Python binding's CUDA tests (tests/bindings/cuda_python.sh) with kvsieve's
# Debian build dependencies carried as .deb files in .debs/ (unpacked into a private sysroot). The
# OpenBLAS library links that Debian's alternatives system would make are made by hand here.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/kvs_out}
mkdir -p "$OUT"
SR=/tmp/kvsieve-sysroot
mkdir -p $SR
for d in .debs/*.deb; do dpkg -x "$d" $SR; done
L=$SR/usr/lib/x86_64-linux-gnu
for f in libopenblas.so libopenblas.so.0 libblas.so libblas.so.3; do
  [ -e $L/$f ] || ln -sf openblas-pthread/$f $L/$f
done
[ -e $L/libblas.so.3 ] || ln -sf openblas-pthread/libblas.so.3 $L/libblas.so.3
ls -la $L/libopenblas* $L/openblas-pthread/ | head -20
bash tests/bindings/cuda_python.sh "${1:-$(command -v python3)}" 2>&1 | tee "$OUT/bindings_cuda.log" | tail -60

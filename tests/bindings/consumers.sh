#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Installs the build into a fresh prefix and builds consumers against the installed tree only:
# the install layout (headers, SONAME'd library, CLI with RPATH, CMake package, kvsieve.pc), the
# C++ example through find_package(kvsieve) and through pkg-config, the Rust crates (kvsieve-sys,
# whose bindgen output must match the header, and the safe kvsieve: cargo test --offline) and the
# Rust example on them, the Go package (go test) and the Go example on it. Each consumer runs a prefill
# and a decode checked against a reference, a batch of two sessions (kvs_batch_plan per token,
# kvs_batch_decode per layer) checked against per-session decodes, and handles errors.
#   tests/bindings/consumers.sh BUILD_DIR [WORK_DIR]
# KVS_CONSUMERS_OPTIONAL=1 skips Rust/Go when cargo/go are missing, and the bindings.rs check when
# bindgen is (CI installs all three and requires them).
set -euo pipefail
SRC=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=$(cd "$1" && pwd)
WORK=${2:-$BUILD/consumers}
rm -rf "$WORK"
mkdir -p "$WORK"
PREFIX=$WORK/prefix
step() { echo "== consumers: $*"; }
die() { echo "consumers: FAILED: $*" >&2; exit 1; }

step "cmake --install"
cmake --install "$BUILD" --prefix "$PREFIX" >/dev/null
LIBDIR=$(dirname "$(find "$PREFIX" -name 'libkvsieve.so.*.*.*' | head -1)")
[ -d "$LIBDIR" ] || die "no libkvsieve.so.X.Y.Z under $PREFIX"
for f in include/kvsieve/kvsieve.h include/kvsieve/kvsieve.hpp; do [ -f "$PREFIX/$f" ] || die "missing $f"; done
[ -f "$LIBDIR/cmake/kvsieve/kvsieveConfig.cmake" ] && [ -f "$LIBDIR/cmake/kvsieve/kvsieveConfigVersion.cmake" ] \
  && [ -f "$LIBDIR/cmake/kvsieve/kvsieveTargets.cmake" ] || die "CMake package files missing"
[ -f "$LIBDIR/pkgconfig/kvsieve.pc" ] || die "kvsieve.pc missing"
soname=$(readelf -d "$LIBDIR/libkvsieve.so" | sed -n 's/.*SONAME.*\[\(.*\)\]/\1/p')
[ "$soname" = "libkvsieve.so.0" ] || die "SONAME is '$soname', expected libkvsieve.so.0"
[ -L "$LIBDIR/libkvsieve.so" ] && [ -L "$LIBDIR/libkvsieve.so.0" ] || die "libkvsieve.so and .so.0 must be links"
if [ -x "$PREFIX/bin/kvsieve" ]; then
  step "installed CLI runs through its RPATH (no LD_LIBRARY_PATH)"
  readelf -d "$PREFIX/bin/kvsieve" | grep -Eq 'R(UN)?PATH.*\$ORIGIN/\.\./' || die "CLI has no \$ORIGIN RPATH"
  # (captured first: `| grep -q` would close the pipe early and fail the CLI with SIGPIPE under pipefail)
  methods_out=$(env -u LD_LIBRARY_PATH "$PREFIX/bin/kvsieve" methods) || die "installed CLI does not run"
  grep -q exact_topk <<<"$methods_out" || die "installed CLI does not list exact_topk"
fi

step "C++ example through find_package(kvsieve)"
cmake -S "$SRC/examples/cpp" -B "$WORK/cpp-cmake" -G Ninja -DCMAKE_PREFIX_PATH="$PREFIX" >/dev/null
cmake --build "$WORK/cpp-cmake" >/dev/null
env -u LD_LIBRARY_PATH "$WORK/cpp-cmake/kvsieve_cpp_example"
# the package refuses another major version
printf 'cmake_minimum_required(VERSION 3.16)\nproject(v CXX)\nfind_package(kvsieve 1.0 QUIET)\nif(kvsieve_FOUND)\n  message(FATAL_ERROR "major 1 accepted")\nendif()\n' \
  > "$WORK/major.cmake.txt"
mkdir -p "$WORK/major" && cp "$WORK/major.cmake.txt" "$WORK/major/CMakeLists.txt"
cmake -S "$WORK/major" -B "$WORK/major/b" -G Ninja -DCMAKE_PREFIX_PATH="$PREFIX" >/dev/null || die "SameMajorVersion not enforced"

step "C++ example through pkg-config"
export PKG_CONFIG_PATH=$LIBDIR/pkgconfig
pkg-config --static --libs kvsieve | grep -q -- -ldnnl || die "Libs.private missing from kvsieve.pc"
[ "$(pkg-config --variable=prefix kvsieve | xargs realpath)" = "$(realpath "$PREFIX")" ] || die "kvsieve.pc prefix is not relocatable"
# shellcheck disable=SC2046
c++ -std=c++17 -O1 "$SRC/examples/cpp/main.cpp" -o "$WORK/cpp-pkgconfig" $(pkg-config --cflags --libs kvsieve) \
  -Wl,-rpath,"$LIBDIR"
"$WORK/cpp-pkgconfig"

if command -v cargo >/dev/null; then
  if command -v bindgen >/dev/null; then
    step "Rust: kvsieve-sys's committed bindings.rs is what bindgen makes of kvsieve.h"
    bash "$SRC/bindings/rust/kvsieve-sys/regen.sh" "$WORK/bindings.rs"
    diff -u "$SRC/bindings/rust/kvsieve-sys/src/bindings.rs" "$WORK/bindings.rs" >&2 \
      || die "bindings/rust/kvsieve-sys/src/bindings.rs differs from the header: run bindings/rust/kvsieve-sys/regen.sh and commit it"
  elif [ "${KVS_CONSUMERS_OPTIONAL:-0}" = 1 ]; then echo "consumers: bindgen missing, bindings.rs drift check skipped"
  else die "bindgen not found (Debian package bindgen, with libclang1-14 and libclang-common-14-dev)"; fi
  # built from a copy of bindings/rust and examples/rust (the path dependencies keep their relative
  # places): cargo writes Cargo.lock next to the manifest, in the format of its version
  RT=$WORK/rust-tree
  mkdir -p "$RT/bindings" "$RT/examples"
  cp -r "$SRC/bindings/rust" "$RT/bindings/rust" && cp -r "$SRC/examples/rust" "$RT/examples/rust"
  find "$RT" \( -name target -o -name Cargo.lock \) -prune -exec rm -rf {} +
  step "Rust crates: cargo test --offline (kvsieve-sys: struct layouts; kvsieve: against an f64 reference)"
  for crate in kvsieve-sys kvsieve; do
    env -u LD_LIBRARY_PATH cargo test --offline --quiet --manifest-path "$RT/bindings/rust/$crate/Cargo.toml" \
      --target-dir "$WORK/rust" || die "cargo test of $crate"
  done
  step "Rust example (the kvsieve crate by path, cargo --offline)"
  cargo build --offline --quiet --manifest-path "$RT/examples/rust/Cargo.toml" --target-dir "$WORK/rust"
  env -u LD_LIBRARY_PATH "$WORK/rust/debug/kvsieve-example"
elif [ "${KVS_CONSUMERS_OPTIONAL:-0}" = 1 ]; then echo "consumers: cargo missing, Rust skipped"
else die "cargo not found"; fi

if command -v go >/dev/null; then
  # no network: the package has no dependencies, the example reaches it through a replace directive
  goenv=(env -u LD_LIBRARY_PATH GOCACHE="$WORK/gocache" GOPATH="$WORK/gopath" GOFLAGS=-mod=mod GOPROXY=off
         GO111MODULE=on CGO_ENABLED=1 CGO_LDFLAGS="-Wl,-rpath,$LIBDIR")
  step "Go package: go test (against a float64 reference)"
  (cd "$SRC/bindings/go/kvsieve" && "${goenv[@]}" go test -count=1 .) || die "go test of bindings/go/kvsieve"
  step "Go example (cgo + pkg-config through the package)"
  (cd "$SRC/examples/go" && "${goenv[@]}" go build -o "$WORK/go-example" .)
  env -u LD_LIBRARY_PATH "$WORK/go-example"
elif [ "${KVS_CONSUMERS_OPTIONAL:-0}" = 1 ]; then echo "consumers: go missing, Go skipped"
else die "go not found"; fi
echo "consumers: all passed"

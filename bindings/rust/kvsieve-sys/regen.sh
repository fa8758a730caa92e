#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Regenerates src/bindings.rs from include/kvsieve/kvsieve.h with Debian's bindgen CLI (package
# `bindgen`, 0.60; it loads libclang at run time: packages libclang1-14 and libclang-common-14-dev).
#   bindings/rust/kvsieve-sys/regen.sh [OUT]      (OUT defaults to src/bindings.rs next to this script)
# tests/bindings/consumers.sh regenerates into a temporary file and fails when it differs from the
# committed one, so the header and the crate cannot drift apart.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
SRC=$(cd "$HERE/../../.." && pwd)
OUT=${1:-$HERE/src/bindings.rs}
command -v bindgen >/dev/null || { echo "regen.sh: bindgen not found (Debian package bindgen)" >&2; exit 2; }
tmp=$(mktemp)
trap 'rm -f "$tmp"' EXIT
# Only the kvs_ API (not what <stdint.h> drags in); enum constants under their C names
# (KVS_STATUS_OK, not kvs_status_KVS_STATUS_OK); size_t as usize. Layout tests stay in: `cargo test`
# of this crate checks every struct's size, alignment and field offsets against the C compiler's.
(cd "$SRC" && bindgen --no-prepend-enum-name --size_t-is-usize \
   --allowlist-function 'kvs_.*' --allowlist-type 'kvs_.*' --allowlist-var 'KVS_.*' \
   include/kvsieve/kvsieve.h -- -Iinclude) > "$tmp"
{ echo "// SPDX-License-Identifier: Apache-2.0"
  echo "// Generated from include/kvsieve/kvsieve.h by bindings/rust/kvsieve-sys/regen.sh: do not edit."
  cat "$tmp"; } > "$OUT"

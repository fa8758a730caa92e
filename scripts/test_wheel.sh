#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The wheel stage of scripts/test.sh (issue 21), runnable alone after `KVS_BINDINGS=1 scripts/setup.sh`:
#  1. scripts/build_wheel.sh build/wheel: the self-contained wheel (pip wheel + auditwheel repair +
#     the bundled libraries' licences).
#  2. A fresh venv, build/wheel-venv (never the build venv), with the wheel, its dependencies from
#     PyPI (numpy) and pytest. torch and transformers are not installed again (5.6 GB): a .pth file
#     appends the build venv's site-packages to sys.path, after the fresh venv's own, so they come
#     from there while kvsieve and numpy come from the fresh venv (checked below).
#  3. Where a mount namespace can be made, the rest runs with the system's copies of the bundled
#     libraries hidden (bind-mounted over by /dev/null). scripts/check_wheel_deps.py: every ELF file
#     of the installed package resolves its libraries inside the wheel (beyond glibc, libstdc++,
#     libgcc_s), and at run time no oneDNN, OpenBLAS, mimalloc, xxHash, ... is mapped from the system.
#  4. The console script `kvsieve` (the packaged C++ command), then the package tests of
#     tests/python, with KVSIEVE_CLI = that console script.
# Environment: KVS_BUILD (the build tree whose venv lends torch and transformers, default build).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
BUILD=$ROOT/${KVS_BUILD:-build}
VENV=$ROOT/build/wheel-venv
T0=$SECONDS

scripts/build_wheel.sh build/wheel
whl=$(ls build/wheel/kvsieve-*.whl)
T1=$SECONDS

rm -rf "$VENV"
/usr/bin/python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --disable-pip-version-check "$whl" pytest
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [ -d "$BUILD/venv" ]; then
  "$BUILD/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' \
    > "$site/_kvsieve_test_borrowed.pth"
fi
T2=$SECONDS

# Where the machine allows a mount namespace (`unshare -m` as root, else `unshare -rm`), what follows
# runs in one in which the system's copies of the bundled libraries are /dev/null: to the loader, a
# machine without those Debian packages. Elsewhere it runs as it is (the ldd check still holds).
HIDE=()
for so in libdnnl.so.2 libopenblas.so.0 libmimalloc.so.2 libxxhash.so.0 libgomp.so.1 libgfortran.so.5 \
          libquadmath.so.0 libOpenCL.so.1; do
  # (awk reads all of ldconfig's output: an early exit would end ldconfig with SIGPIPE, a failure
  # under pipefail)
  p=$(/sbin/ldconfig -p | awk -v so="$so" '!found && $1 == so && /x86-64/ { print $NF; found = 1 }')
  [ -z "$p" ] || HIDE+=("$(realpath "$p")")
done
UNSHARE=()
for u in "unshare -m --propagation private" "unshare -rm --propagation private"; do
  # shellcheck disable=SC2086
  if [ ${#HIDE[@]} -gt 0 ] && $u sh -c "mount --bind /dev/null ${HIDE[0]}" 2>/dev/null; then
    read -r -a UNSHARE <<< "$u"
    break
  fi
done
hidden() {
  if [ ${#UNSHARE[@]} -gt 0 ]; then
    # shellcheck disable=SC2016  # (expanded by the inner sh)
    KVS_HIDE="${HIDE[*]}" "${UNSHARE[@]}" sh -c \
      'for f in $KVS_HIDE; do mount --bind /dev/null "$f" || exit 1; done; exec "$@"' sh "$@"
  else
    "$@"
  fi
}
cd "$VENV"  # nothing of the checkout on sys.path
if [ ${#UNSHARE[@]} -gt 0 ]; then
  echo "test_wheel: with the system's copies hidden (${UNSHARE[*]}): ${HIDE[*]}"
  hidden "$VENV/bin/python" -c '
import ctypes
try:
    ctypes.CDLL("libdnnl.so.2")
except OSError as e:
    print("  (loading the system libdnnl.so.2 now fails:", e, ")")
else:
    raise SystemExit("the system libdnnl.so.2 still loads")'
else
  echo "test_wheel: no mount namespace here; the system's copies of the bundled libraries stay visible"
fi
hidden "$VENV/bin/python" -c '
import os, sys, kvsieve, numpy
for m in (kvsieve, numpy):
    assert m.__file__.startswith(sys.prefix + os.sep), f"{m.__name__} from {m.__file__}, not the fresh venv"
print("kvsieve", kvsieve.version(), "from", os.path.dirname(kvsieve.__file__))'
hidden "$VENV/bin/python" "$ROOT/scripts/check_wheel_deps.py"
hidden "$VENV/bin/kvsieve" --version
hidden "$VENV/bin/kvsieve" methods > /dev/null
KVSIEVE_CLI=$VENV/bin/kvsieve HF_HUB_OFFLINE=1 OMP_NUM_THREADS=2 hidden "$VENV/bin/python" -m pytest -q -rs \
  -p no:cacheprovider "$ROOT/tests/python/test_bindings.py" "$ROOT/tests/python/test_hf_generate.py" \
  "$ROOT/tests/python/test_hf_integration.py"
echo "test_wheel: build + repair $((T1 - T0)) s, fresh venv $((T2 - T1)) s, checks + tests $((SECONDS - T2)) s"

#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The wheel stage of scripts/test.sh (issue 21), runnable alone after `KVS_BINDINGS=1 scripts/setup.sh`:
#  1. scripts/build_wheel.sh build/wheel: the self-contained wheel (pip wheel + auditwheel repair +
#     the bundled libraries' licences).
#  2. A fresh venv, build/wheel-venv (never the build venv), with the wheel, its dependencies from
#     PyPI (numpy) and pytest. torch and transformers are not installed again (5.6 GB): a .pth file
#     appends the build venv's site-packages to sys.path, after the fresh venv's own, so they come
#     from there while kvsieve and numpy come from the fresh venv (checked below).
#  3. scripts/check_wheel_deps.py: every ELF file of the installed package resolves its libraries
#     inside the wheel (beyond glibc, libstdc++, libgcc_s), and at run time no oneDNN, OpenBLAS,
#     mimalloc, xxHash, ... is mapped from the system.
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

"$VENV/bin/python" -c '
import os, sys, kvsieve, numpy
for m in (kvsieve, numpy):
    assert m.__file__.startswith(sys.prefix + os.sep), f"{m.__name__} from {m.__file__}, not the fresh venv"
print("kvsieve", kvsieve.version(), "from", os.path.dirname(kvsieve.__file__))'
(cd /tmp && "$VENV/bin/python" "$ROOT/scripts/check_wheel_deps.py")
"$VENV/bin/kvsieve" --version
"$VENV/bin/kvsieve" methods > /dev/null

# Outside the checkout, so that nothing of the source tree is importable.
(cd "$BUILD" && KVSIEVE_CLI=$VENV/bin/kvsieve HF_HUB_OFFLINE=1 OMP_NUM_THREADS=2 \
   "$VENV/bin/python" -m pytest -q -rs -p no:cacheprovider "$ROOT/tests/python/test_bindings.py" \
   "$ROOT/tests/python/test_hf_generate.py" "$ROOT/tests/python/test_hf_integration.py")
echo "test_wheel: build + repair $((T1 - T0)) s, fresh venv $((T2 - T1)) s, checks + tests $((SECONDS - T2)) s"

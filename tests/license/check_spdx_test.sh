#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Licence checks: LICENSE and NOTICE exist, every source file of the repository carries an
# SPDX-License-Identifier line (scripts/check_spdx.py), and the checker itself fails on a file that
# lacks the line and passes once --fix has added it.
#   tests/license/check_spdx_test.sh REPO_ROOT
set -euo pipefail
ROOT=${1:?usage: check_spdx_test.sh REPO_ROOT}
CHECK="$ROOT/scripts/check_spdx.py"
fail() { echo "FAIL: $*" >&2; exit 1; }

grep -q "Apache License" "$ROOT/LICENSE" && grep -q "Version 2.0" "$ROOT/LICENSE" || fail "LICENSE is not the Apache-2.0 text"
for lib in oneDNN OpenBLAS mimalloc xxHash nlohmann/json CLI11 DLPack doctest; do
  grep -q "$lib" "$ROOT/NOTICE" || fail "NOTICE does not list $lib"
done

python3 "$CHECK" --root "$ROOT" || fail "source files without an SPDX line (listed above)"

TMP=$(mktemp -d "${TMPDIR:-/tmp}/kvsieve-spdx.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
mkdir -p "$TMP/src" "$TMP/scripts"
printf '#include <cstdio>\nint main() { return 0; }\n' > "$TMP/src/a.cpp"
printf '/* SPDX-License-Identifier: Apache-2.0 */\nint f(void);\n' > "$TMP/src/b.h"
printf '#!/bin/sh\necho hi\n' > "$TMP/scripts/run.sh"
printf 'package main\n' > "$TMP/src/m.go"

set +e
out=$(python3 "$CHECK" --root "$TMP" src/a.cpp src/b.h scripts/run.sh src/m.go 2>&1); rc=$?
set -e
[ $rc -eq 1 ] || fail "checker exit $rc on files without the line (want 1): $out"
for f in src/a.cpp scripts/run.sh src/m.go; do
  grep -q "^$f: no 'SPDX-License-Identifier:'" <<<"$out" || fail "checker does not name $f: $out"
done
grep -q "src/b.h" <<<"$out" && fail "checker flags src/b.h, which has the line: $out"

python3 "$CHECK" --root "$TMP" --fix src/a.cpp src/b.h scripts/run.sh src/m.go >/dev/null 2>&1 || fail "--fix failed"
python3 "$CHECK" --root "$TMP" src/a.cpp src/b.h scripts/run.sh src/m.go >/dev/null || fail "still missing after --fix"
[ "$(head -1 "$TMP/scripts/run.sh")" = "#!/bin/sh" ] || fail "--fix moved the shebang"
[ "$(sed -n 2p "$TMP/scripts/run.sh")" = "# SPDX-License-Identifier: Apache-2.0" ] || fail "--fix did not put the line after the shebang"
[ "$(head -1 "$TMP/src/a.cpp")" = "// SPDX-License-Identifier: Apache-2.0" ] || fail "--fix wrote a wrong C++ line"
[ "$(grep -c SPDX "$TMP/src/b.h")" = 1 ] || fail "--fix touched a file that had the line"

set +e
python3 "$CHECK" --root "$TMP/nonexistent" >/dev/null 2>&1; rc=$?
set -e
[ $rc -eq 2 ] || fail "checker exit $rc on a missing --root (want 2)"
echo "license checks: ok"

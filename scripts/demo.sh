#!/usr/bin/env bash
# The demo: builds kvsieve, synthesises a trace, evaluates every method at a 5% budget.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh build >&2
exec build/kvsieve demo "$@"

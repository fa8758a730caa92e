#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The demo: builds kvsieve, synthesises a trace, evaluates every method at a 5% budget.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh build >&2
exec build/kvsieve demo "$@"

#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The demo: builds kvsieve, then every method at a 5% budget: accuracy on the real stories260K
# trace (tests/data/) and speed-up over full at a 128K-token context (docs/cli.md, `demo`).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh build >&2
exec build/kvsieve demo "$@"

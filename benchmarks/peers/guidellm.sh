#!/usr/bin/env bash
# guidellm (vLLM's ecosystem's load generator), in a venv of its own, for the test that points it
# at this server unmodified (tests/server/e2e/test_guidellm.py) and for anyone measuring with it.
#
#     benchmarks/peers/guidellm.sh [--cache DIR]
#
# Cache: --cache DIR, else $SPYRE_SERVE_PEERS_CACHE, else ~/.cache/spyre-serve/peers. Produces
#   <cache>/guidellm-venv/   guidellm 0.8.1 with torch pinned to 2.13.0 (guidellm asks for an
#                            unpinned torch, which would be the registry's multi-GB CUDA build)
# Skipped when the venv is complete, so a second run only prints the path.
set -euo pipefail

GUIDELLM_VERSION=0.8.1
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"   # ROOT, PY, CACHE, log
VENV="$CACHE/guidellm-venv"

if [[ ! -f "$VENV/.complete" ]]; then
    fresh_venv "$VENV" "guidellm==$GUIDELLM_VERSION" "torch==2.13.0"
    "$VENV/bin/guidellm" --help > /dev/null
    touch "$VENV/.complete"
fi
echo "$VENV/bin/guidellm"

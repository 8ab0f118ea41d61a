# ddptrain on NVIDIA GPUs: the pinned torch CUDA build + the package, `ddptrain` on PATH, run as a non-root user.
#   docker build -t ddptrain .
#   docker run --gpus all --ipc=host ddptrain torchrun --nproc-per-node=8 -m ddptrain +experiment=gpt2_small
# Several nodes over InfiniBand/RoCE: --network=host, the /dev/infiniband devices and --ulimit memlock=-1 too
# (docs/multinode.md, "On GPUs: the container").
# The CUDA base image (not -runtime/-cudnn): the torch wheel brings its own CUDA runtime, cuBLAS, cuDNN and NCCL
# as pip packages, so a -runtime/-cudnn image would hold a second copy of each; the driver comes from the host.
FROM nvidia/cuda:12.8.1-base-ubuntu24.04

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# Ubuntu's own python3.12 (its stdlib sources are the default corpus); versions follow the pinned base image.
# A C compiler, the C library's headers and Python's: Triton builds a small C launcher against Python.h at its
# first kernel launch, and Inductor (train.compile) compiles C++ the same way; without them both fail at step 1.
# InfiniBand/RoCE userspace: NCCL's IB transport loads libibverbs at start-up, and ibverbs-providers holds the
# drivers for the adapters (mlx5: ConnectX; efa; ...). Without them NCCL quietly falls back to TCP sockets
# ("NET/Socket" in NCCL_DEBUG=INFO) on an IB cluster. rdma-core brings the udev/limits set-up, ibverbs-utils
# ibv_devinfo (are the adapters visible in the container?). Package names are Ubuntu 24.04's.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.12 python3.12-venv python3.12-dev gcc g++ libc6-dev \
        rdma-core libibverbs1 ibverbs-providers ibverbs-utils \
    && rm -rf /var/lib/apt/lists/*

RUN python3.12 -m venv /opt/venv \
    && pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"

WORKDIR /opt/ddptrain
# The dependencies from pyproject.toml alone, before any source is copied: a change to the source reuses this
# layer (the pinned torch is already installed and satisfies its own pin), only a change to pyproject.toml
# reinstalls them.
COPY pyproject.toml ./
# With them the ft extra (torchft: its lighthouse and Manager), so that ddptrain-k8s --replica-groups runs on this
# image as printed.
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
print('\n'.join(p['dependencies'] + p['optional-dependencies']['ft']))" \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt
# Every package pyproject.toml lists, from the directories it maps them to (the Hydra launcher plugin is a package of
# its own); .dockerignore keeps the rest of the checkout out of the context.
COPY README.md ./
COPY ddptrain ./ddptrain
COPY configs ./configs
COPY hydra_plugins ./hydra_plugins
# The package alone (its dependencies are in). Fail the build, not the first GPU run, if the torch that ends up
# installed is a CPU build, if C against Python.h does not compile (what Triton's first launch does), or if the
# InfiniBand verbs library and the ConnectX (mlx5) provider cannot be loaded.
RUN pip install --no-deps . \
    && python -c "import torch; assert torch.version.cuda, f'torch {torch.__version__} is not a CUDA build'" \
    && python -c "import subprocess, sysconfig; subprocess.run(['gcc', '-fsyntax-only', '-x', 'c', '-I', \
sysconfig.get_paths()['include'], '-'], input=b'#include <Python.h>\n', check=True)" \
    && python -c "import ctypes; ctypes.CDLL('libibverbs.so.1'); ctypes.CDLL('libmlx5.so.1')" \
    && torchft_lighthouse --help > /dev/null

# A non-root user with a writable home: the data cache (~/.cache/ddptrain) and Hugging Face's cache live there.
RUN groupadd --gid 10001 ddptrain \
    && useradd --create-home --no-log-init --shell /bin/bash --uid 10001 --gid 10001 ddptrain \
    && mkdir -p /workspace \
    && chown ddptrain:ddptrain /workspace
USER 10001:10001
ENV HOME=/home/ddptrain \
    HF_HOME=/home/ddptrain/.cache/huggingface

WORKDIR /workspace
CMD ["ddptrain", "--help"]

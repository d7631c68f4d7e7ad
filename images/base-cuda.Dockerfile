# Production base images: CUDA + Python 3 + venv, the counterpart of images/build_base.sh.
# Not buildable on the CPU test machine (no registry there); build where nvidia/cuda is pullable:
#
#   docker build -f images/base-cuda.Dockerfile --target runtime -t loraship-base:cuda images/
#   docker build -f images/base-cuda.Dockerfile --target devel -t loraship-base:cuda-devel images/
#   BASE_IMAGE=loraship-base:cuda BUILDER_IMAGE=loraship-base:cuda-devel TORCH_SPEC=torch==2.13.0 \
#     images/build_all.sh
#
# runtime: train, merge, verify (and the CPU stages, for one base to patch). devel: the builder of
# the llama-cpp stage in convert/verify images (nvcc + cmake for GGML_CUDA=on). Ubuntu 24.04's
# Python is 3.12; libgomp1 is the OpenMP runtime libllama.so links against. apt versions are
# pinned per Ubuntu release (update them with the CUDA tag).
ARG CUDA_TAG=12.8.1-cudnn
ARG UBUNTU=ubuntu24.04

FROM nvidia/cuda:${CUDA_TAG}-runtime-${UBUNTU} AS runtime
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG PYTHON_APT_VERSION=3.12.3-0ubuntu2
ENV LANG=C.UTF-8 \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
         ca-certificates=20240203 \
         python3="${PYTHON_APT_VERSION}" \
         python3-venv="${PYTHON_APT_VERSION}" \
         libgomp1=14.2.0-4ubuntu2~24.04 \
    && rm -rf /var/lib/apt/lists/*
CMD ["/bin/bash"]

FROM nvidia/cuda:${CUDA_TAG}-devel-${UBUNTU} AS devel
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG PYTHON_APT_VERSION=3.12.3-0ubuntu2
ENV LANG=C.UTF-8 \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
         ca-certificates=20240203 \
         python3="${PYTHON_APT_VERSION}" \
         python3-venv="${PYTHON_APT_VERSION}" \
         python3-dev="${PYTHON_APT_VERSION}" \
         build-essential=12.10ubuntu1 \
         cmake=3.28.3-1build7 \
    && rm -rf /var/lib/apt/lists/*
CMD ["/bin/bash"]

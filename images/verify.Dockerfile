# Verify stage: loads the quantized GGUF with llama-cpp-python (CUDA in production) and gates
# on fit, perplexity, golden prompts, template against what reference recorded from the merged
# model (it loads neither torch nor the HF model).
# The same llama.cpp as convert.Dockerfile: same sdist, same wheel, same layers.
#
#   images/build_all.sh verify                  # local: reuses the wheel built on the host
#   docker build -f images/verify.Dockerfile --build-arg BASE_IMAGE=loraship-base:cuda \
#     --build-arg BUILDER_IMAGE=loraship-base:cuda-devel -t loraship-verify:0.1.0 build/image-context
ARG BASE_IMAGE=loraship-base:bookworm
ARG BUILDER_IMAGE=${BASE_IMAGE}

# llama.cpp in its own stage: rebuilt only when the sdist, the wheel or CMAKE_ARGS change.
FROM ${BUILDER_IMAGE} AS llama-cpp
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG LLAMA_CPP_PYTHON_VERSION=0.3.36
# Production verify/convert images build the CUDA backend; GGML_NATIVE=off keeps the binary
# portable across the CPUs of a cluster.
ARG CMAKE_ARGS="-DGGML_CUDA=on -DGGML_NATIVE=off"
COPY sdist/ /build/sdist/
COPY wheels/llama/ /build/wheels/
WORKDIR /build
RUN mkdir -p /out/wheels /out/llama.cpp \
    && src="llama_cpp_python-${LLAMA_CPP_PYTHON_VERSION}" \
    && tar -xzf "sdist/${src}.tar.gz" \
         "${src}/vendor/llama.cpp/convert_hf_to_gguf.py" \
         "${src}/vendor/llama.cpp/conversion" \
         "${src}/vendor/llama.cpp/gguf-py" \
    && cp -r "${src}/vendor/llama.cpp/convert_hf_to_gguf.py" "${src}/vendor/llama.cpp/conversion" \
         "${src}/vendor/llama.cpp/gguf-py" /out/llama.cpp/ \
    && if [ -n "$(find wheels -name "llama_cpp_python-${LLAMA_CPP_PYTHON_VERSION}-*.whl")" ]; then \
         cp wheels/llama_cpp_python-"${LLAMA_CPP_PYTHON_VERSION}"-*.whl /out/wheels/; \
       else \
         python3 -m venv /tmp/build-venv \
         && /tmp/build-venv/bin/pip wheel --no-cache-dir --no-deps -w /out/wheels "sdist/${src}.tar.gz"; \
       fi

FROM ${BASE_IMAGE}
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONPATH=/opt/loraship \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/home/loraship \
    PREFECT_HOME=/home/loraship/.prefect \
    LORASHIP_CACHE=/home/loraship/.cache/loraship
# /shared is the artifact volume's mount point: a new named volume copies its owner, so the
# non-root user can write there.
RUN python3 -m venv /opt/venv \
    && useradd --create-home --home-dir /home/loraship --uid 1000 --user-group loraship \
    && mkdir -p /shared && chown 1000:1000 /shared
WORKDIR /opt/loraship

# No torch and no transformers: verify reads only the GGUF and what the reference stage stored,
# so this image stays small enough for an inference node.
COPY constraints.txt /opt/loraship/images/constraints.txt
COPY requirements/verify.txt /opt/loraship/images/requirements.txt
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install -c images/constraints.txt -r images/requirements.txt

ARG LLAMA_CPP_PYTHON_VERSION=0.3.36
COPY --from=llama-cpp /out/llama.cpp/ /opt/llama.cpp/
COPY --from=llama-cpp /out/wheels/ /wheels/llama/
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install --find-links /wheels/llama -c images/constraints.txt \
      "llama-cpp-python==${LLAMA_CPP_PYTHON_VERSION}" \
    && python -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
ENV LORASHIP_LLAMA_CPP_DIR=/opt/llama.cpp

COPY src/ /opt/loraship/
USER 1000:1000
ENTRYPOINT ["python", "-m", "tasks.verify"]

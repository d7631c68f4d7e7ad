# Publish stage (CPU only): copies GGUF, adapter, manifests and model card to the artifact
# store (any fsspec URL). Same layers as plan.Dockerfile up to the entrypoint.
#
#   images/build_all.sh publish
#   docker run --rm -v /shared:/shared loraship-publish:0.1.0 /shared/config.yaml
ARG BASE_IMAGE=loraship-base:bookworm

# plan checks GGUF convertibility against the pinned converter's architecture list, so it
# needs llama.cpp's converter (not the binding): extracted from the same sdist as convert's.
FROM ${BASE_IMAGE} AS converter
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG LLAMA_CPP_PYTHON_VERSION=0.3.36
COPY sdist/ /build/sdist/
WORKDIR /build
RUN mkdir -p /out/llama.cpp \
    && src="llama_cpp_python-${LLAMA_CPP_PYTHON_VERSION}" \
    && tar -xzf "sdist/${src}.tar.gz" \
         "${src}/vendor/llama.cpp/convert_hf_to_gguf.py" \
         "${src}/vendor/llama.cpp/conversion" \
         "${src}/vendor/llama.cpp/gguf-py" \
    && cp -r "${src}/vendor/llama.cpp/convert_hf_to_gguf.py" "${src}/vendor/llama.cpp/conversion" \
         "${src}/vendor/llama.cpp/gguf-py" /out/llama.cpp/

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

COPY constraints.txt /opt/loraship/images/constraints.txt
COPY requirements/light.txt /opt/loraship/images/requirements.txt
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install -c images/constraints.txt -r images/requirements.txt

COPY --from=converter /out/llama.cpp/ /opt/llama.cpp/
ENV LORASHIP_LLAMA_CPP_DIR=/opt/llama.cpp

COPY src/ /opt/loraship/
USER 1000:1000
ENTRYPOINT ["python", "-m", "tasks.publish"]

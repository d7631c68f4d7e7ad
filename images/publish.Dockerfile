# Publish stage (CPU only): copies GGUF, adapter, manifests and model card to the artifact
# store (any fsspec URL). Same layers as plan.Dockerfile up to the entrypoint.
#
#   images/build_all.sh publish
#   docker run --rm -v /shared:/shared loraship-publish:0.1.0 /shared/config.yaml
ARG BASE_IMAGE=loraship-base:bookworm
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

COPY src/ /opt/loraship/
USER 1000:1000
ENTRYPOINT ["python", "-m", "tasks.publish"]

# Plan stage (CPU only): core dependencies + Prefect. Also runs the parent `train-and-ship`
# flow. publish.Dockerfile is the same up to its entrypoint, so the two share every layer.
#
#   images/build_all.sh plan
#   docker run --rm -v /shared:/shared loraship-plan:0.1.0 /shared/config.yaml
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
ENTRYPOINT ["python", "-m", "tasks.plan"]

# Merge stage: torch + transformers + peft (merges into the bf16 base, never the 4-bit copy).
#
#   images/build_all.sh merge                   # local CPU test image on the Debian base
#   docker build -f images/merge.Dockerfile --build-arg BASE_IMAGE=loraship-base:cuda \
#     -t loraship-merge:0.1.0 build/image-context   # production
#
# The entrypoint runs merge; reference (the merged HF model's outputs for verify, on the
# training GPU) runs in this image too (`--entrypoint python ... -m tasks.reference`, or a
# Prefect worker's own command).
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

# torch alone first: the largest layer, identical in every torch image so the cache shares it.
ARG TORCH_SPEC=torch==2.13.0
COPY constraints.txt /opt/loraship/images/constraints.txt
COPY wheels/torch/ /wheels/torch/
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install --find-links /wheels/torch -c images/constraints.txt "${TORCH_SPEC}"

COPY requirements/merge.txt /opt/loraship/images/requirements.txt
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install --find-links /wheels/torch -c images/constraints.txt -r images/requirements.txt

COPY src/ /opt/loraship/
USER 1000:1000
ENTRYPOINT ["python", "-m", "tasks.merge"]

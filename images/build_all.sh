#!/usr/bin/env bash
# Assemble the image build context and build the stage images: one target of images/Dockerfile
# per image named in loraship/stage_table.py, tagged loraship-<image>:<tag>.
#
#   images/build_all.sh                       # base (if missing) + every stage image
#   images/build_all.sh train verify          # only these
#   LORASHIP_IMAGE_TAG=0.1.0 BASE_IMAGE=loraship-base:cuda TORCH_SPEC=torch==2.13.0 images/build_all.sh
#
# The context (build/image-context, git-ignored) holds only what the Dockerfile copies: the
# source, one requirements file per image from the pyproject extras, the pins, the llama-cpp-python sdist
# and, for local CPU builds, prebuilt wheels. Wheels are hard-linked, not rebuilt: the
# llama-cpp-python wheel built on the host (about 10 minutes here) is reused so the images
# never compile llama.cpp again; without one, the llama-cpp stage builds it from the sdist
# with CMAKE_ARGS (production, GGML_CUDA=on on a CUDA devel builder).
#
# Wheels are looked up in: $LORASHIP_TORCH_WHEEL / $LORASHIP_LLAMA_WHEEL, pip's find-links
# folder and wheel cache, /tmp/llbuild, .whl/. The sdist: $LORASHIP_LLAMA_SDIST,
# $LORASHIP_CACHE, /tmp/llsdist, else `pip download`.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
DOCKER="${DOCKER:-/usr/bin/docker}"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[[ -x "$PY" ]] || PY=python3
LLAMA_VERSION="$("$PY" -c 'from loraship.constants import LLAMA_CPP_PYTHON_VERSION as v; print(v)')"
TAG="${LORASHIP_IMAGE_TAG:-$("$PY" -c 'import loraship; print(loraship.__version__)')}"
BASE_IMAGE="${BASE_IMAGE:-loraship-base:bookworm}"
CTX="${LORASHIP_IMAGE_CONTEXT:-$ROOT/build/image-context}"
read -ra STAGE_IMAGES <<<"$("$PY" images/pin.py images)"
if [[ $# -gt 0 ]]; then
  for image in "$@"; do
    [[ " ${STAGE_IMAGES[*]} " == *" $image "* ]] || {
      echo "unknown image '$image': the images are ${STAGE_IMAGES[*]} (loraship/stage_table.py)" >&2; exit 2; }
  done
  STAGE_IMAGES=("$@")
fi

link() { ln -f "$1" "$2" 2>/dev/null || cp -f "$1" "$2"; }

find_wheel() {  # find_wheel GLOB -> first match in the usual places
  local glob="$1" dir
  local dirs=()
  while IFS= read -r dir; do dirs+=("$dir"); done < <(
    "$PY" -m pip config list 2>/dev/null | sed -n "s/.*find-links='\(.*\)'/\1/p" | tr ' ' '\n'
  )
  dirs+=("${HOME}/.cache/pip/wheels" /tmp/llbuild "$ROOT/.whl")
  for dir in "${dirs[@]}"; do
    [[ -d "$dir" ]] || continue
    find "$dir" -name "$glob" -print -quit 2>/dev/null | grep . && return 0
  done
  return 1
}

start=$SECONDS
rm -rf "$CTX"
mkdir -p "$CTX"/{src,requirements,sdist,wheels/torch,wheels/llama,wheels/extra}

# Source: only what the stages import and the configs they may read.
for path in pyproject.toml README.md loraship tasks flows configs; do
  [[ -e "$path" ]] && cp -r "$path" "$CTX/src/"
done
find "$CTX/src" -name __pycache__ -prune -exec rm -rf {} +
cp images/constraints.txt "$CTX/constraints.txt"
"$PY" images/pin.py requirements "$CTX/requirements"

# torch: a local wheel (CPU, tests) pins TORCH_SPEC to it; otherwise TORCH_SPEC as given.
if [[ -z "${TORCH_SPEC:-}" ]]; then
  wheel="${LORASHIP_TORCH_WHEEL:-$(find_wheel 'torch-*.whl' || true)}"
  if [[ -n "$wheel" ]]; then
    link "$wheel" "$CTX/wheels/torch/$(basename "$wheel")"
    TORCH_SPEC="torch==$(basename "$wheel" | cut -d- -f2)"
  else
    TORCH_SPEC="torch==2.13.0"
  fi
fi

wheel="${LORASHIP_LLAMA_WHEEL:-$(find_wheel "llama_cpp_python-${LLAMA_VERSION}-*.whl" || true)}"
if [[ -n "$wheel" ]]; then
  link "$wheel" "$CTX/wheels/llama/$(basename "$wheel")"
else
  echo "no llama-cpp-python ${LLAMA_VERSION} wheel found: the images will build it from the sdist"
fi
for w in "$ROOT"/.whl/*.whl; do [[ -e "$w" ]] && link "$w" "$CTX/wheels/extra/$(basename "$w")"; done

# llama.cpp's tools (quantize's imatrix: true): the host's build from `loraship build-tools`, reused as the wheel is;
# without one the llama-tools stage builds them from the sdist.
mkdir -p "$CTX/tools"
# Where they are looked for: LORASHIP_LLAMA_CPP_TOOLS_DIR, LORASHIP_CACHE's build, the repository's cache (make's
# LORASHIP_CACHE), the user cache.
tools=
for cand in ${LORASHIP_LLAMA_CPP_TOOLS_DIR:+"$LORASHIP_LLAMA_CPP_TOOLS_DIR"} \
    ${LORASHIP_CACHE:+"$LORASHIP_CACHE/llama.cpp-tools-${LLAMA_VERSION}/bin"} \
    "$ROOT/.loraship/cache/llama.cpp-tools-${LLAMA_VERSION}/bin" "$HOME/.cache/loraship/llama.cpp-tools-${LLAMA_VERSION}/bin"; do
  if [[ -z "$tools" && -x "$cand/llama-imatrix" && -x "$cand/llama-quantize" && -x "$cand/llama-perplexity" ]]; then
    tools="$cand"
  fi
done
if [[ -n "$tools" ]]; then
  for f in llama-imatrix llama-quantize llama-perplexity build.json; do
    if [[ -e "$tools/$f" ]]; then link "$tools/$f" "$CTX/tools/$f"; fi
  done
  echo "llama.cpp tools from $tools"
else
  echo "no llama.cpp tools built for ${LLAMA_VERSION} here: the images will build them from the sdist"
fi

sdist_name="llama_cpp_python-${LLAMA_VERSION}.tar.gz"
sdist="${LORASHIP_LLAMA_SDIST:-}"
for cand in "${LORASHIP_CACHE:-$HOME/.cache/loraship}/$sdist_name" "/tmp/llsdist/$sdist_name"; do
  [[ -z "$sdist" && -f "$cand" ]] && sdist="$cand"
done
if [[ -z "$sdist" ]]; then
  "$PY" -m pip download --no-binary :all: --no-deps -d "$CTX/sdist" "llama-cpp-python==${LLAMA_VERSION}"
else
  link "$sdist" "$CTX/sdist/$sdist_name"
fi
echo "context ready in $((SECONDS - start)) s: TORCH_SPEC=$TORCH_SPEC BASE_IMAGE=$BASE_IMAGE TAG=$TAG"

if [[ "$BASE_IMAGE" == loraship-base:bookworm ]]; then
  "$ROOT/images/build_base.sh" "$BASE_IMAGE"
fi

# The llama-tools stage builds (when the context has no tools) with the flags `loraship build-tools` uses.
TOOLS_CMAKE_ARGS="$("$PY" -c 'from loraship.llamacpp.tools import CMAKE_ARGS; print(" ".join(CMAKE_ARGS))')"
builder_args=()
[[ -n "${BUILDER_IMAGE:-}" ]] && builder_args=(--build-arg "BUILDER_IMAGE=$BUILDER_IMAGE")
for image in "${STAGE_IMAGES[@]}"; do
  t0=$SECONDS
  DOCKER_BUILDKIT=1 "$DOCKER" build --progress=plain \
    -f images/Dockerfile --target "$image" \
    --build-arg "BASE_IMAGE=$BASE_IMAGE" \
    --build-arg "TORCH_SPEC=$TORCH_SPEC" \
    --build-arg "LLAMA_CPP_PYTHON_VERSION=$LLAMA_VERSION" \
    --build-arg "LLAMA_TOOLS_CMAKE_ARGS=$TOOLS_CMAKE_ARGS" \
    "${builder_args[@]}" \
    -t "loraship-${image}:${TAG}" "$CTX"
  echo "built loraship-${image}:${TAG} in $((SECONDS - t0)) s"
done
echo "all images built in $((SECONDS - start)) s"

#!/usr/bin/env bash
# images/Dockerfile's llama-tools stage when the host has no llama.cpp tools to put in the context: on a devel
# builder (the base plus g++ and make from Debian) it builds llama-imatrix, llama-quantize and llama-perplexity from
# the pinned sdist, and the tools it made are run. On the plain base the same stage must stop with its one error.
#
#   images/check_tools_from_source.sh        # needs a running dockerd (deploy/docker/dockerd.sh) and the sdist
#
# Not part of .ci/run: compiling the three tools takes minutes on 2 cores, and CI's images take the host's build.
# Run it after changing that stage.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
DOCKER="${DOCKER:-/usr/bin/docker}"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
BASE_IMAGE="${BASE_IMAGE:-loraship-base:bookworm}"
DEVEL_IMAGE="${DEVEL_IMAGE:-loraship-devel:bookworm}"
VERSION="$("$PY" -c 'from loraship.constants import LLAMA_CPP_PYTHON_VERSION as v; print(v)')"
TOOLS_CMAKE_ARGS="$("$PY" -c 'from loraship.llamacpp.tools import CMAKE_ARGS; print(" ".join(CMAKE_ARGS))')"
start=$SECONDS

images/build_base.sh "$BASE_IMAGE"
if ! "$DOCKER" image inspect "$DEVEL_IMAGE" >/dev/null 2>&1; then
  printf 'FROM %s\nRUN apt-get update -qq && apt-get install -y -qq --no-install-recommends g++ make && rm -rf /var/lib/apt/lists/*\n' \
    "$BASE_IMAGE" | DOCKER_BUILDKIT=1 "$DOCKER" build -q -t "$DEVEL_IMAGE" - >/dev/null
fi

ctx="$(mktemp -d)"
trap 'rm -rf "$ctx"' EXIT
mkdir -p "$ctx/sdist" "$ctx/tools"  # tools/ empty: nothing built on the host
sdist="$(find build/image-context/sdist "${LORASHIP_CACHE:-$ROOT/.loraship/cache}" /tmp/llsdist \
  -name "llama_cpp_python-${VERSION}.tar.gz" -print -quit 2>/dev/null || true)"
[[ -f "$sdist" ]] || { echo "no llama_cpp_python-${VERSION}.tar.gz found: run images/build_all.sh once (it fetches it)" >&2; exit 1; }
cp "$sdist" "$ctx/sdist/"

echo "llama-tools on the plain base: must refuse"
if out="$(DOCKER_BUILDKIT=1 "$DOCKER" build --progress plain --target llama-tools --build-arg "BASE_IMAGE=$BASE_IMAGE" \
    -f images/Dockerfile "$ctx" 2>&1)"; then
  echo "the llama-tools stage built on a base without g++" >&2; exit 1
fi
grep -q "pass a devel BUILDER_IMAGE" <<<"$out" || { tail -20 <<<"$out" >&2; exit 1; }

echo "llama-tools on $DEVEL_IMAGE: builds from the sdist"
DOCKER_BUILDKIT=1 "$DOCKER" build --progress plain --target llama-tools --build-arg "BASE_IMAGE=$BASE_IMAGE" \
  --build-arg "BUILDER_IMAGE=$DEVEL_IMAGE" --build-arg "LLAMA_TOOLS_CMAKE_ARGS=$TOOLS_CMAKE_ARGS" -t loraship-llama-tools-check:latest -f images/Dockerfile "$ctx" >"$ctx/build.log" 2>&1 \
  || { tail -30 "$ctx/build.log" >&2; exit 1; }
# The tools run on the plain base, where the convert image runs them (static libraries, no compiler needed).
"$DOCKER" run --rm --network none --entrypoint bash loraship-llama-tools-check:latest -c '
  set -e; cat /out/tools/build.json; grep -q -- "-DBUILD_SHARED_LIBS=OFF" /out/tools/build.json
  for t in llama-imatrix llama-quantize llama-perplexity; do test -x /out/tools/$t; done
  /out/tools/llama-quantize --help 2>&1 | grep -q "Q4_K_M"' 
cid="$("$DOCKER" create loraship-llama-tools-check:latest)"
"$DOCKER" cp "$cid:/out/tools" "$ctx/built"
"$DOCKER" rm "$cid" >/dev/null
"$DOCKER" run --rm --network none -v "$ctx/built:/t:ro" --entrypoint bash "$BASE_IMAGE" -c '
  /t/llama-quantize --help 2>&1 | grep -q "Q4_K_M" && /t/llama-imatrix --help 2>&1 | grep -q -- "--chunks" && echo "tools run on the base"'
echo "llama-tools from source OK in $((SECONDS - start)) s"

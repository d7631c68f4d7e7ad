"""llama.cpp's own command-line tools (llama-imatrix, llama-quantize, llama-perplexity), built from the pinned source.

llama-cpp-python's quantize binding cannot pass an importance matrix, and it has no perplexity tool to check our
KL figures against. So the three tools are compiled once from the same vendor/llama.cpp the converter comes from
(the pinned sdist, sha256-checked: loraship/llamacpp/llamacpp.py fetch_source), CPU only, static libraries,
and kept under LORASHIP_CACHE/llama.cpp-tools-<version>/ (or taken from LORASHIP_LLAMA_CPP_TOOLS_DIR).
Only those three targets are built, no tests, examples or server: a few minutes on two cores.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from loraship.constants import LLAMA_CPP_PYTHON_VERSION
from loraship.errors import LorashipError

log = logging.getLogger("loraship.llamacpp")

TOOLS = ("llama-imatrix", "llama-quantize", "llama-perplexity")
BUILD_FILE = "build.json"  # how and when the tools were built; its presence marks a finished build
BUILD_TIMEOUT_S = 3600
# Portable (GGML_NATIVE off: a cache or image built on one CPU runs on another), static libraries (the binaries
# need no libllama.so beside them), no OpenMP (no libgomp at run time), no HTTPS client (nothing is downloaded).
CMAKE_ARGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DGGML_NATIVE=OFF",
    "-DGGML_OPENMP=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_APP=OFF",
)


def tools_root() -> Path:
    from loraship.cache import cache_root

    return cache_root() / f"llama.cpp-tools-{LLAMA_CPP_PYTHON_VERSION}"


def source_dir() -> Path:
    """The whole vendor/llama.cpp of the pinned sdist, unpacked once into the cache."""
    from loraship.llamacpp.llamacpp import fetch_source
    from loraship.cache import cache_root

    folder = cache_root() / f"llama.cpp-src-{LLAMA_CPP_PYTHON_VERSION}"
    if (folder / "CMakeLists.txt").is_file() and (folder / "tools" / "imatrix").is_dir():
        return folder
    return fetch_source(folder)


def _have_all(folder: Path) -> bool:
    return all(os.access(folder / name, os.X_OK) for name in TOOLS)


def tools_dir(build: bool = True) -> Path:
    """Folder holding the three tools of the pinned llama.cpp; built on first use."""
    explicit = os.environ.get("LORASHIP_LLAMA_CPP_TOOLS_DIR")
    if explicit:
        folder = Path(explicit)
        if not _have_all(folder):
            raise LorashipError(
                f"LORASHIP_LLAMA_CPP_TOOLS_DIR={folder} does not hold the executables {', '.join(TOOLS)}; unset it to "
                f"let loraship build them from llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}'s llama.cpp"
            )
        return folder
    folder = tools_root() / "bin"
    if _have_all(folder) and (tools_root() / BUILD_FILE).is_file():
        return folder
    if not build:
        raise LorashipError(f"llama.cpp's tools are not built in {folder}; run `loraship build-tools`")
    return build_tools()


def ensure_tools() -> float | None:
    """Build the three tools unless they are there already; the seconds that build took, None where none was needed.
    A stage times its own work after this, so a first use's build (minutes) is not counted as that work."""
    if os.environ.get("LORASHIP_LLAMA_CPP_TOOLS_DIR"):
        tools_dir()  # checks the given folder; nothing is built
        return None
    if _have_all(tools_root() / "bin") and (tools_root() / BUILD_FILE).is_file():
        return None
    started = time.monotonic()
    build_tools()
    return round(time.monotonic() - started, 1)


def tool(name: str) -> Path:
    return tools_dir() / name


def missing_build_tools() -> list[str]:
    """What a build of llama.cpp needs and this machine lacks."""
    missing = [] if shutil.which("cmake") else ["cmake"]
    if not any(shutil.which(c) for c in (os.environ.get("CXX") or "c++", "g++", "clang++")):
        missing.append("a C++ compiler (g++ or clang++)")
    if not (shutil.which("make") or shutil.which("ninja")):
        missing.append("make (or ninja)")
    return missing


def build_tools() -> Path:
    """Configure and build the three tools from the pinned source; the finished bin/ folder replaces the cached one
    at once, so a build killed half-way leaves nothing that looks usable."""
    missing = missing_build_tools()
    if missing:
        raise LorashipError(
            "building llama.cpp's tools (imatrix: true needs llama-imatrix and llama-quantize) needs "
            f"{', '.join(missing)}, which this machine lacks; install them (Debian/Ubuntu: apt-get install cmake g++ "
            "make), or set LORASHIP_LLAMA_CPP_TOOLS_DIR to a folder with llama-imatrix, llama-quantize and "
            f"llama-perplexity built from llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}'s vendor/llama.cpp, or set "
            "imatrix: false"
        )
    source = source_dir()
    root = tools_root()
    root.mkdir(parents=True, exist_ok=True)
    jobs = str(min(os.cpu_count() or 2, int(os.environ.get("LORASHIP_BUILD_JOBS", "2"))))
    started = time.time()
    log.info("building %s from %s (about 4 minutes on 2 cores, once per llama.cpp version)", ", ".join(TOOLS), source)
    with tempfile.TemporaryDirectory(dir=root, prefix=".build-") as tmp:
        build = Path(tmp) / "build"
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        steps = [
            ["cmake", "-S", str(source), "-B", str(build), *generator, *CMAKE_ARGS],
            ["cmake", "--build", str(build), "--config", "Release", "-j", jobs, "--target", *TOOLS],
        ]
        for cmd in steps:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
            if done.returncode != 0:
                raise LorashipError(
                    f"building llama.cpp's tools failed at `{' '.join(cmd)}` (exit {done.returncode}):\n"
                    + "\n".join((done.stdout + done.stderr).strip().splitlines()[-25:])
                    + "\nfix the toolchain the error names (cmake >= 3.14, a C++17 compiler), or set "
                    "LORASHIP_LLAMA_CPP_TOOLS_DIR to prebuilt tools of the same llama.cpp, or set imatrix: false"
                )
        staging = Path(tmp) / "bin"
        staging.mkdir()
        for name in TOOLS:
            shutil.copy2(build / "bin" / name, staging / name)
        (staging / BUILD_FILE).write_text(
            json.dumps(
                {
                    "llama_cpp_python": LLAMA_CPP_PYTHON_VERSION,
                    "tools": list(TOOLS),
                    "cmake_args": list(CMAKE_ARGS),
                    "jobs": int(jobs),
                    "seconds": round(time.time() - started, 1),
                },
                indent=1,
            )
            + "\n",
            encoding="utf-8",
        )
        final = root / "bin"
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
    (root / BUILD_FILE).write_text((final / BUILD_FILE).read_text(encoding="utf-8"), encoding="utf-8")
    log.info("built llama.cpp's tools in %.0f s into %s", time.time() - started, final)
    return final


def build_info() -> dict:
    """What build.json recorded (empty for tools given by LORASHIP_LLAMA_CPP_TOOLS_DIR without one)."""
    path = tools_dir() / BUILD_FILE
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}

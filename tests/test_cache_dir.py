"""One cache for `make` and `.venv/bin/loraship`: llama.cpp's converter and tools are built once, whatever the
command or the working folder (loraship/cache.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _env_without_cache() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("LORASHIP_CACHE", "XDG_CACHE_HOME")}


def test_loraship_run_from_anywhere_uses_the_checkouts_cache(tmp_path):
    """`.venv/bin/loraship run my.yaml` from another folder, without LORASHIP_CACHE: the checkout's .loraship/cache,
    where `make demo` built the converter and tools, for every user of the cache."""
    probe = (
        "from loraship.cache import cache_root; from loraship.data import cache_root as data_cache; "
        "from loraship.llamacpp.llamacpp import converter_dir; from loraship.llamacpp.tools import tools_root; "
        "from loraship.fixtures.families import packages_dir; "
        "print(cache_root(), data_cache(), tools_root().parent, packages_dir().parent, sep='\\n')"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**_env_without_cache(), "PYTHONPATH": str(REPO)},
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(REPO / ".loraship" / "cache")] * 4


def test_make_sets_no_other_cache():
    """make's recipes run loraship from this checkout, so they find the same folder; make itself names none."""
    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    result = subprocess.run(
        ["make", "-s", "--no-print-directory", "--eval", "print-cache: ; @echo [$(LORASHIP_CACHE)]", "print-cache"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=_env_without_cache(),
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_loraship_cache_wins_and_an_installed_copy_uses_the_user_cache(monkeypatch, tmp_path):
    from loraship import cache

    monkeypatch.setenv("LORASHIP_CACHE", str(tmp_path / "mine"))
    assert cache.cache_root() == tmp_path / "mine"
    monkeypatch.delenv("LORASHIP_CACHE")
    monkeypatch.setattr(cache, "checkout_root", lambda: None)  # as from site-packages
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_root() == tmp_path / "xdg" / "loraship"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache.cache_root() == Path.home() / ".cache" / "loraship"


def test_checkout_root_is_this_repository_and_not_a_wheel(tmp_path, monkeypatch):
    from loraship import cache

    assert cache.checkout_root() == REPO
    # A package directory with no project file above it (site-packages): no checkout.
    fake = tmp_path / "site-packages" / "loraship" / "runtime" / "cache.py"
    fake.parent.mkdir(parents=True)
    monkeypatch.setattr(cache, "__file__", str(fake))
    assert cache.checkout_root() is None


def test_a_tools_build_is_timed_apart_from_the_work_after_it(monkeypatch, tmp_path):
    """ensure_tools builds once and says how long it took; with the tools there it builds nothing and says None,
    so quantize's importance-matrix time never holds a build."""
    from loraship.llamacpp import tools

    monkeypatch.setenv("LORASHIP_CACHE", str(tmp_path))
    monkeypatch.delenv("LORASHIP_LLAMA_CPP_TOOLS_DIR", raising=False)
    clock = [1000.0]
    monkeypatch.setattr(tools.time, "monotonic", lambda: clock[0])
    builds = []

    def fake_build():
        builds.append(1)
        clock[0] += 513.0  # the cold build the issue measured
        folder = tools.tools_root() / "bin"
        folder.mkdir(parents=True)
        for name in tools.TOOLS:
            (folder / name).write_text("#!/bin/sh\n")
            (folder / name).chmod(0o755)
        (tools.tools_root() / tools.BUILD_FILE).write_text("{}")
        return folder

    monkeypatch.setattr(tools, "build_tools", fake_build)
    assert tools.ensure_tools() == 513.0
    assert tools.ensure_tools() is None
    assert builds == [1]


def test_quantize_reports_the_tools_build_beside_the_matrix_time(monkeypatch, tmp_path):
    """The stage's imatrix record: seconds of llama-imatrix alone, the build in tools_build_seconds (a build of
    513 s on the clock here must not show in seconds)."""
    import importlib

    quantize = importlib.import_module("tasks.quantize")
    real_time = time.time
    shift = [0.0]
    monkeypatch.setattr(quantize.time, "time", lambda: real_time() + shift[0])

    def slow_build():
        shift[0] += 513.0
        return 513.0

    monkeypatch.setattr(quantize, "ensure_tools", slow_build)
    record = quantize.timed_imatrix(lambda: {"chunks": 1})
    assert record["tools_build_seconds"] == 513.0 and record["seconds"] < 60

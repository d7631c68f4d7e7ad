"""One cache for `make` and `.venv/bin/loraship`: llama.cpp's converter and tools are built once, whatever the
command or the working folder (loraship/runtime/cache.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _env_without_cache() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("LORASHIP_CACHE", "XDG_CACHE_HOME")}


def test_loraship_run_from_anywhere_uses_the_checkouts_cache(tmp_path):
    """`.venv/bin/loraship run my.yaml` from another folder, without LORASHIP_CACHE: the checkout's .loraship/cache,
    where `make demo` built the converter and tools, for every user of the cache."""
    probe = (
        "from loraship.runtime.cache import cache_root; from loraship.data import cache_root as data_cache; "
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
    from loraship.runtime import cache

    monkeypatch.setenv("LORASHIP_CACHE", str(tmp_path / "mine"))
    assert cache.cache_root() == tmp_path / "mine"
    monkeypatch.delenv("LORASHIP_CACHE")
    monkeypatch.setattr(cache, "checkout_root", lambda: None)  # as from site-packages
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_root() == tmp_path / "xdg" / "loraship"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache.cache_root() == Path.home() / ".cache" / "loraship"


def test_checkout_root_is_this_repository_and_not_a_wheel(tmp_path, monkeypatch):
    from loraship.runtime import cache

    assert cache.checkout_root() == REPO
    # A package directory with no project file above it (site-packages): no checkout.
    fake = tmp_path / "site-packages" / "loraship" / "runtime" / "cache.py"
    fake.parent.mkdir(parents=True)
    monkeypatch.setattr(cache, "__file__", str(fake))
    assert cache.checkout_root() is None

"""The one folder loraship caches into: the pinned llama.cpp's converter, source and built tools, tokenized rows,
`datasets`' Arrow copies and the test fixtures' packages.

LORASHIP_CACHE when set. Else, for loraship imported from a source checkout (an editable install or PYTHONPATH, as
`make` sets up), that checkout's .loraship/cache: the same folder whatever the working directory, so `make demo` and
`.venv/bin/loraship run my.yaml` share one build of llama.cpp's tools. Else (an installed wheel)
$XDG_CACHE_HOME/loraship, ~/.cache/loraship by default.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

CACHE_ENV = "LORASHIP_CACHE"
CHECKOUT_CACHE = Path(".loraship") / "cache"


def checkout_root() -> Path | None:
    """The source checkout this loraship package is imported from (its pyproject.toml names the project), or None
    for an installed copy (site-packages has no pyproject.toml beside the package)."""
    root = Path(__file__).resolve().parents[1]
    try:
        text = (root / "pyproject.toml").read_text(encoding="utf-8")
    except OSError:
        return None
    return root if re.search(r'^name\s*=\s*"loraship"\s*$', text, flags=re.M) else None


def cache_root() -> Path:
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit).expanduser()
    root = checkout_root()
    if root is not None:
        return root / CHECKOUT_CACHE
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "loraship"

"""Prefect settings for the embedded default: ephemeral API, state under the project, not $HOME."""

from __future__ import annotations

import os
from pathlib import Path


def configure_local_prefect(project_root: Path | None = None) -> None:
    """Must run before `import prefect`. Respects anything the user set explicitly."""
    root = Path(project_root or os.getcwd())
    os.environ.setdefault("PREFECT_HOME", str(root / ".prefect"))
    # First start of the ephemeral server took ~24 s here; CI machines can be slower (PITFALLS.md).
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_UI_ENABLED", "false")

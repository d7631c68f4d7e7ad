"""Prefect wiring of the stages in tasks/, installed as loraship.flows (pyproject's package-dir)."""

"""Pipeline stages: plain functions over files and manifests, no Prefect inside.

Each module has `run(config) -> manifest` and runs as `python -m loraship.stages.<stage> CONFIG.yaml`
(installed under that name, pyproject's package-dir; mapped in a checkout by loraship/__init__.py).
"""

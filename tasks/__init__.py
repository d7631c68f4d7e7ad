"""Pipeline stages: plain functions over files and manifests, no Prefect inside.

Each module has `run(config) -> manifest` and runs as `python -m tasks.<stage> CONFIG.yaml`.
"""

"""Prefect wiring of the stages in tasks/."""

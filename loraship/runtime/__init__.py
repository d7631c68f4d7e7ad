"""Run machinery: stage folders and manifests, locks, child processes, progress, status, Prefect and GitOps glue."""

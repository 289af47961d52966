"""Service configuration and the local stack (`python -m infra.stack`)."""

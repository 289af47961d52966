"""Dagster code location of the Sapiens2 platform (thin assets over `pipelines/`)."""

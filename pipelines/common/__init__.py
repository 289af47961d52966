"""What the steps share: config, launch, lineage and tracking, S3 and DVC, the registry lock,
service settings, serving, plots, dataset statistics and curation's per-shard scoring. Nothing
here is a step or a CLI verb."""

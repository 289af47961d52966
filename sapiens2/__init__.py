"""Sapiens2 ML library: backbone, pretraining objective, tasks, data, curation and training."""

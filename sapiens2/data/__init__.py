"""Data: synthetic generator, datasets and transforms."""

"""Pipeline steps: one plain function per stage, each also a CLI verb."""

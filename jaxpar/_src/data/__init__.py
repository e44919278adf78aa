"""Datasets in MindSpore's shape: sources, sharding, map/batch/shuffle, global arrays."""

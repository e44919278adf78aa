"""Distributed checkpoints and inference: sharded saves with their strategy, loads and offline
transforms onto other layouts (orbax underneath)."""

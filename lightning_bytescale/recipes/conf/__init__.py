"""The recipes' YAML config groups (package data, found by Hydra as ``pkg://lightning_bytescale.recipes.conf``)."""

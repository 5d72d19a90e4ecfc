"""Shared helper of the config tests: edit params.yaml the way ``dvc exp run -S`` does."""

from __future__ import annotations

from pathlib import Path

import yaml


def dvc_set(params: Path, **dotted: object) -> Path:
    """What ``dvc exp run -S key=value`` does: rewrite the values of keys already in params.yaml."""
    raw = yaml.safe_load(params.read_text(encoding="utf-8"))
    for key, value in dotted.items():
        *parents, leaf = key.split(".")
        node = raw
        for part in parents:
            node = node[part]
        assert leaf in node, f"-S {key}: DVC only sets keys params.yaml already has"
        node[leaf] = value
    params.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    return params

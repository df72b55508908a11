"""Griffe extension for the API reference: the subpackages that live in top-level folders.

``pyproject.toml`` installs ``adapters/``, ``kernels/``, ``eval/`` and ``demo/`` as
``vlm_prune.adapters``, ... (``[tool.setuptools.package-dir]``); griffe reads ``vlm_prune/`` alone, so
this loads each folder and attaches it to ``vlm_prune`` under its installed name.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import griffe

ROOT = Path(__file__).resolve().parents[1]
#: installed name under vlm_prune -> folder at the repository root
FOLDERS = {"adapters": "adapters", "kernels": "kernels", "eval": "eval", "demo": "demo"}


class MappedPackages(griffe.Extension):
    """Attach the top-level folders to the ``vlm_prune`` package griffe loaded."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        if pkg.name != "vlm_prune":
            return
        for name, folder in FOLDERS.items():
            module = loader.load(ROOT / folder)
            pkg.set_member(name, module)

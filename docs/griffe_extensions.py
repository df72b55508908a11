"""Griffe extensions for the API reference (mkdocs.yml: mkdocstrings' ``extensions``).

``MappedPackages``: the subpackages that live in top-level folders. ``pyproject.toml`` installs ``adapters/``, ``kernels/``, ``eval/`` and ``demo/`` as
``vlm_prune.adapters``, ... (``[tool.setuptools.package-dir]``); griffe reads ``vlm_prune/`` alone, so
this loads each folder and attaches it to ``vlm_prune`` under its installed name.

``SphinxRoles``: the docstrings cross-reference with Sphinx roles (``:class:`Reduction```), which
Markdown would print as they are; each becomes a code span.
"""
from __future__ import annotations

import re
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


#: a Sphinx cross-reference role and its target: :class:`Name`, :meth:`~mod.Class.name`, ...
SPHINX_ROLE = re.compile(r":(?:class|meth|func|data|attr|mod|exc|obj):`~?([^`]+)`")


class SphinxRoles(griffe.Extension):
    """Turn Sphinx roles in docstrings into code spans."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = SPHINX_ROLE.sub(r"`\1`", obj.docstring.value)

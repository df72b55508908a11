"""Keep the checkout's top-level folders from shadowing third-party packages of the same name.

The design puts ``adapters/``, ``kernels/``, ``eval/`` and ``demo/`` at the top of the checkout;
pyproject installs them as ``vlm_prune.adapters`` and so on. Python puts the checkout root on
``sys.path`` for ``python -c``, ``python -m pytest``, ``python -m vlm_prune.eval`` and an
interactive session started there, so a bare ``import kernels`` (Hugging Face's package, which
transformers imports) or ``import adapters`` (AdapterHub) would find these folders first.

Each of those folders' ``__init__.py`` calls :func:`hand_over` first when it is imported under
its bare name: the package of that name is loaded from the rest of ``sys.path`` in its place,
and where none is installed the name becomes an empty namespace package, which is what Python makes
of a folder without ``__init__.py`` (``importlib.util.find_spec`` still finds the folder, so
availability checks such as transformers' import the name and must get something they can
recognise as not installed: no ``__file__``, no ``__version__``, no submodules). The rest of such an
``__init__.py`` then runs in a discarded module, so it may use the standard library only
(``kernels/`` keeps its imports in an ``else`` branch). Only the standard library is used here, so
this works before anything is installed.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys


def _outside(checkout: str) -> list[str]:
    """``sys.path`` without the entries that point at ``checkout`` ('' is the working directory)."""
    return [entry for entry in sys.path if os.path.realpath(entry or os.curdir) != checkout]


def hand_over(name: str, init_file: str) -> None:
    """Replace the half-imported checkout folder ``name`` (whose ``__init__.py`` is ``init_file``)
    in ``sys.modules`` with the package of that name found outside the checkout, or with an empty
    namespace package when there is none. The import statement that is running then returns
    that package (the import system reads the module back from ``sys.modules``)."""
    checkout = os.path.realpath(os.path.dirname(os.path.dirname(os.path.abspath(init_file))))
    del sys.modules[name]
    spec = importlib.machinery.PathFinder.find_spec(name, _outside(checkout))
    if spec is None:  # nothing installed: what a folder without __init__.py would give
        spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
        spec.submodule_search_locations = []
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise

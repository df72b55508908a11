"""The checkout root is a place users run Python from (`python -m pytest`, `python -m
vlm_prune.eval`, the README's snippets): its top-level folders adapters/, kernels/, eval/ and demo/
must not stand in for the third-party packages of those names (Hugging Face's `kernels`, which
transformers imports; AdapterHub's `adapters`; PyPI's `eval` and `demo`). Each test starts a fresh
interpreter in the checkout root, which Python puts on sys.path (vlm_prune/_bare_names.py)."""
from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BARE_NAMES = ("adapters", "kernels", "eval", "demo")


def run_at_root(code: str, *args: str, env: dict[str, str] | None = None,
                timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args, *(["-c", code] if code else [])], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def installed(distribution: str) -> bool:
    try:
        importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.skipif(not installed("kernels"), reason="Hugging Face's kernels package is not installed")
def test_transformers_gets_hugging_faces_kernels_from_the_checkout_root():
    result = run_at_root("from transformers import LlavaForConditionalGeneration, Qwen2VLForConditionalGeneration\n"
                         "import kernels\nprint(kernels.__file__)")
    assert result.returncode == 0, result.stderr
    location = Path(result.stdout.strip()).resolve()
    assert location != ROOT / "kernels" / "__init__.py"  # (CI's venv lies inside the checkout: compare the file)
    assert location.parent.name == "kernels" and location.parent.parent.name == "site-packages", location


def test_third_party_packages_win_over_the_checkout_folders(tmp_path):
    """Stand-ins for the four third-party packages, installed behind the checkout root on the path
    (as site-packages is): a bare import finds them, submodules included."""
    for name in BARE_NAMES:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"ORIGIN = 'third-party {name}'\n")
        (tmp_path / name / "part.py").write_text("VALUE = 7\n")
    code = ("import importlib\n"
            f"for name in {BARE_NAMES!r}:\n"
            "    module = importlib.import_module(name)\n"
            "    assert module.ORIGIN == 'third-party ' + name, module\n"
            "    assert importlib.import_module(name + '.part').VALUE == 7\n"
            "import vlm_prune.kernels, vlm_prune.adapters, vlm_prune.eval, vlm_prune.demo\n"
            "assert callable(vlm_prune.kernels.attention_to_keys) and callable(vlm_prune.adapters.find_adapter)\n"
            "print('ok')")
    result = run_at_root(code, env={"PYTHONPATH": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


@pytest.mark.parametrize("name", [n for n in BARE_NAMES if not installed(n)])
def test_a_bare_name_with_nothing_installed_is_an_empty_namespace_package(name):
    """What Python makes of a folder without __init__.py: no file, no version, no submodules, so an
    availability check that imports the name (transformers' for `kernels`, since find_spec still
    finds the folder) reads it as not installed."""
    result = run_at_root(f"import importlib, {name}\n"
                         f"assert getattr({name}, '__file__', None) is None and not hasattr({name}, '__version__')\n"
                         f"assert list({name}.__path__) == []\n"
                         f"try:\n    importlib.import_module('{name}.part')\n"
                         f"except ModuleNotFoundError:\n    print('ok')")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_the_package_names_still_import_from_the_checkout_root():
    result = run_at_root("import vlm_prune.kernels as k, vlm_prune.adapters as a\n"
                         "from vlm_prune.eval.synthetic import model_path\n"
                         "print(k.__name__, a.__name__, k.euti_scores.__module__)")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["vlm_prune.kernels", "vlm_prune.adapters", "vlm_prune.kernels.euti"]


def test_python_m_entry_points_work_from_the_checkout_root():
    result = run_at_root("", "-m", "vlm_prune.eval", "--help")
    assert result.returncode == 0, result.stderr
    assert "usage: python -m vlm_prune.eval" in result.stdout
    result = run_at_root("", "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only", "tests/test_api.py")
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"\d+ tests? collected", result.stdout), result.stdout


def test_the_readme_first_snippet_runs_pasted_at_the_checkout_root():
    """What a newcomer does first: the README's quick start pasted into a fresh `python` started at the
    root, as written (it loads the shipped toy model by `model_path`, offline)."""
    block = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)[0]
    assert "model_path(" in block, "the README's first snippet changed: update this test"
    result = run_at_root(block, env={"HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr
    assert "[16]" in result.stdout, "the snippet prints the pruned answer and the tokens kept"

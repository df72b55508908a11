"""The documentation's generated parts and the README's front door.

The site itself is built with `python -m mkdocs build --strict` in `.ci/run` (a broken link or a page
missing from the nav fails there); here: the hook that generates the method pages from the registry,
and what a newcomer must find on the README's first screen.
"""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_models_page_gets_the_table_of_vlm_prune_methods_table(capsys):
    from vlm_prune.cli import main

    assert main(["methods", "--table"]) == 0
    table = capsys.readouterr().out
    page = (ROOT / "docs" / "models.md").read_text()
    assert "<!-- vlm-prune:methods-table -->" in page
    rendered = load_hooks().on_page_markdown(page, page=None, config=None, files=None)
    assert table in rendered and "<!-- vlm-prune:" not in rendered


def test_the_catalogue_has_a_section_for_every_registered_method():
    from vlm_prune.registry import describe_methods

    page = (ROOT / "docs" / "methods.md").read_text()
    assert "<!-- vlm-prune:methods-catalogue -->" in page
    rendered = load_hooks().on_page_markdown(page, page=None, config=None, files=None)
    for m in describe_methods():
        section = rendered.split(f"### `{m['name']}`\n", 1)[1].split("\n### ", 1)[0]
        assert f"- **stage**: {m['stage']}" in section and m["paper"] in section, m["name"]
        assert all(f"`{family}`" in section for family in m["supported"]), m["name"]


def test_the_readme_first_screen_has_install_the_two_commands_and_which_method():
    readme = (ROOT / "README.md").read_text()
    assert len(readme) <= 15_000, f"README.md is {len(readme)} characters; move detail to docs/"
    first = "\n".join(readme.splitlines()[:60])
    assert "pip install -e" in first
    assert "&& vlm-prune bench" in first and "&& pytest -n 2" in first
    assert "<!-- which-method:begin -->" in first
    table = readme.split("<!-- which-method:begin -->")[1].split("<!-- which-method:end -->")[0]
    assert re.search(r"^\| images .*\n\| video .*\n\| serving", table, flags=re.M), table


def test_every_relative_readme_link_exists():
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    assert links
    missing = [link for link in links if "://" not in link and not (ROOT / link).exists()]
    assert not missing, f"README links to files that do not exist: {missing}"


def test_no_page_points_outside_the_repository():
    """A path like `../shared/...` names a file a user of the repository does not have."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    outside = [str(p.relative_to(ROOT)) for p in pages if re.search(r"\.\./shared/|/work/", p.read_text())]
    assert not outside, f"pages naming paths outside the repository: {outside}"


def test_sphinx_roles_in_docstrings_become_code_spans():
    griffe = pytest.importorskip("griffe", reason="the docs extra: pip install -e '.[docs]'")

    spec = importlib.util.spec_from_file_location("docs_griffe", ROOT / "docs" / "griffe_extensions.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    obj = griffe.Function("f", docstring=griffe.Docstring("Returns one :class:`Reduction`; see :meth:`~a.B.n_keep`."))
    module.SphinxRoles().on_object(obj=obj, loader=None)
    assert obj.docstring.value == "Returns one `Reduction`; see `a.B.n_keep`."

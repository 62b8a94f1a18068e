"""The docs' generated reference tables (lab/report/reference_docs.py) match the code that declares them."""
import pytest

from lab.cli import main
from lab.report import reference_docs


def test_no_doc_is_stale():
    assert reference_docs.stale() == [], "run: python -m lab docs-tables"


def test_a_section_is_regenerated_and_an_unknown_one_named(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("before\n<!-- generated:fp8-amax-columns -->\nold\n<!-- generated:end -->\nafter\n")
    assert reference_docs.stale(tmp_path) == [doc]
    assert reference_docs.write(tmp_path) == [doc] and reference_docs.stale(tmp_path) == []
    text = doc.read_text()
    assert "\nold\n" not in text and "| `amax` |" in text and text.startswith("before\n") and text.endswith("after\n")
    with pytest.raises(KeyError, match="nope"):
        reference_docs.render("<!-- generated:nope -->\n<!-- generated:end -->")


def test_docs_tables_check_exits_1_on_a_stale_doc(monkeypatch, tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("<!-- generated:fp8-census-columns -->\n<!-- generated:end -->\n")
    monkeypatch.setattr(reference_docs.stale, "__defaults__", (tmp_path,))
    assert main(["docs-tables", "--check"]) == 1


def test_every_recipe_setting_says_what_it_does():
    """docs/fp8.md's settings table is read from the signatures: a setting without its description (the string in
    its Annotated annotation) would be a row a user cannot work from."""
    from lab.core.settings import declared_settings, doc
    from lab.fp8 import RECIPES, _load_recipe_files, common_settings
    _load_recipe_files()
    for name, fn in [*RECIPES.items(), ("every recipe", common_settings)]:
        for key, kind in declared_settings(fn)[0].items():
            assert doc(kind), f"{name}: setting {key} has no description"

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

"""`lab diagnose --json`'s schema (lab/diagnose/schema.py): generated from the Diagnosis record, committed as
docs/diagnose.schema.json for users; the catalogue's and the FP8 cases' diagnoses are validated against it where they
are made (tests/test_diagnose_catalogue.py `check`, tests/test_diagnose_fp8.py `record`)."""
import json
from pathlib import Path

import jsonschema

from lab.cli import main
from lab.diagnose import Diagnosis, Finding, Recommendation
from lab.diagnose.schema import json_schema

DOC = Path(__file__).parent.parent / "docs" / "diagnose.schema.json"


def test_the_committed_schema_is_the_generated_one(capsys):
    assert main(["diagnose", "--schema"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json_schema() == json.loads(DOC.read_text()), \
        "docs/diagnose.schema.json is stale: python -m lab diagnose --schema > docs/diagnose.schema.json"


def test_every_field_is_typed_and_described():
    s = json_schema()
    for obj in (s, *s["$defs"].values()):
        assert set(obj["required"]) == set(obj["properties"]), obj["description"]
        assert all(p.get("description") for p in obj["properties"].values()), obj["description"]


def _valid(d: dict) -> bool:
    try:
        jsonschema.Draft202012Validator(json_schema()).validate(d)
        return True
    except jsonschema.ValidationError:
        return False


def test_the_schema_refuses_what_the_record_never_prints():
    d = Diagnosis(run_dir="r", verdict="issues", headline="h", skip_rate=float("nan"),
                  findings=[Finding("overflow", "warning", "m", {"steps": 3})],
                  recommendations=[Recommendation("lower_lr", "a", "e", ["overflow"])])
    good = d.to_dict()
    assert good["skip_rate"] == "nan" and _valid(good)  # non-finite numbers as strings
    for broken in ({**good, "extra": 1}, {**good, "verdict": "fine"}, {**good, "steps": 1.5},
                   {**good, "findings": [{**good["findings"][0], "severity": "fatal"}]},
                   {k: v for k, v in good.items() if k != "notes"},
                   {**good, "findings": [{**good["findings"][0], "code": "made_up"}]}):  # not a rule's code
        assert not _valid(broken)


def test_diagnose_without_a_run_names_what_it_needs(capsys):
    assert main(["diagnose"]) == 2
    assert "run directory" in capsys.readouterr().err

"""lab diagnose on an RL run (lab/diagnose/rl.py): a mismatch problem told from a scale problem, and advice only where
the run's evidence supports it."""
import csv
import shutil

import pytest

from lab.cli import main
from lab.diagnose import diagnose, format_text
from lab.rl.grpo_run import STEP_FIELDS


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl")
    base = root / "base.pt"
    assert main(["rl-base", "--out", str(base), "--steps", "100"]) == 0
    cfg = root / "rl.yaml"
    cfg.write_text("study: rl\nmodes:\n"
                   "  bf16: {sampler: bf16, learner: bf16, scaler: null}\n"
                   "  fp16-huge: {sampler: fp16, learner: fp16, scaler: {policy: static, scale: 1.0e+30}}\n")
    for mode in ("bf16", "fp16-huge"):
        assert main(["rl-train", "--config", str(cfg), "--mode", mode, "--base", str(base),
                     "--out", str(root / mode), "--steps", "6"]) == 0
    return root


def with_mismatch(src, dest, out_of_band, ess):
    """The same run with its rl_steps.csv rewritten: pi / mu outside the band for ``out_of_band`` of the tokens."""
    shutil.copytree(src, dest)
    with open(dest / "rl_steps.csv") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        r.update(out_of_band=out_of_band, ess=ess)
    with open(dest / "rl_steps.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=STEP_FIELDS, lineterminator="\n")
        w.writeheader()
        w.writerows(rows)
    return dest


def test_a_small_mismatch_is_not_called_a_cause(runs):
    d = diagnose(runs / "bf16")
    codes = [f.code for f in d.findings]
    assert "rl_mismatch_small" in codes and "rl_mismatch" not in codes
    assert d.rl["sampler"] == "bf16" and 0 < d.rl["mismatch_abs_mean"] < 0.1
    assert not {"fp16_both_paths", "truncated_is"} & {r.code for r in d.recommendations}
    assert any("neither the mismatch nor the loss scale" in n for n in d.notes), format_text(d)


def test_a_mismatch_problem_is_named_with_the_advice_it_supports(runs, tmp_path):
    d = diagnose(with_mismatch(runs / "bf16", tmp_path / "mismatched", 0.08, 0.7))
    text = format_text(d)
    found = {f.code: f for f in d.findings}
    assert found["rl_mismatch"].severity == "problem", text
    recs = [r.code for r in d.recommendations]
    assert "fp16_both_paths" in recs and "truncated_is" in recs, text  # a bf16 path; the grpo loss has no IS
    assert any("the mismatch, not the loss scale" in n for n in d.notes), text


def test_a_scale_problem_is_told_from_a_mismatch(runs, tmp_path):
    """A static scale of 1e30 overflows every step: the loss scale is the problem; the fp16 paths agree; FP16 in
    both paths is not advised (it is what the run does)."""
    d = diagnose(runs / "fp16-huge")
    text = format_text(d)
    assert d.skipped_steps == 6 and "rl_mismatch_small" in [f.code for f in d.findings], text
    assert any("the loss scale, not the mismatch" in n for n in d.notes), text
    d = diagnose(with_mismatch(runs / "fp16-huge", tmp_path / "both", 0.02, 0.95))
    assert any("both the mismatch and the loss scale" in n for n in d.notes)
    assert "fp16_both_paths" not in [r.code for r in d.recommendations]  # both paths are already FP16


def test_the_grpo_surrogate_loss_is_not_read_as_a_training_loss(runs, tmp_path):
    """GRPO's loss is about 0 by construction; a rising surrogate over 120 steps is not 'did not fall' (the reward,
    not the loss, says whether the policy learns); the same steps.csv outside an RL run is."""
    dest = shutil.copytree(runs / "bf16", tmp_path / "long")
    with open(dest / "steps.csv") as f:
        rows = list(csv.DictReader(f))
        fields = list(rows[0])
    rows = [{**rows[i % len(rows)], "step": i, "loss": -1e-3 + i * 1e-5} for i in range(120)]
    with open(dest / "steps.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, lineterminator="\n")
        w.writeheader()
        w.writerows(rows)
    d = diagnose(dest)
    assert "not_learning" not in {f.code for f in d.findings} and any("GRPO run" in n for n in d.notes), format_text(d)
    (dest / "rl_steps.csv").unlink()
    assert "not_learning" in {f.code for f in diagnose(dest).findings}

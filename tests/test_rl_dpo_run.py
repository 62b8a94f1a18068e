"""The RL study's DPO family (lab/rl/dpo_run.py, dpo_study.py, dpo_aggregate.py, lab/commands/rl_dpo.py): the corruption
replaces exactly k tokens of the continuation; a run's directory is a lab recording that lab diagnose reads, with the
DPO numbers; a crash leaves what was written; the ``dpo:`` block is refused with the key named; the table pairs each
mode with dpo-fp32 seed by seed."""
import csv
import json
import math

import pytest
import torch
import yaml

from lab.cli import main
from lab.core.errors import ConfigError
from lab.rl import dpo_run
from lab.rl.dpo import pairs, sequence_logprob, token_table
from lab.rl.dpo_study import dpo_run_folder, dpo_runs, parse_dpo
from lab.rl.study import load_rl_study
from lab.study.stats import t_interval

GRPO = {"fp32": {"sampler": "fp32", "learner": "fp32", "scaler": None}}
MODES = {"dpo-fp32": {"learner": "fp32", "sum": "fp32", "scaler": None},
         "dpo-fp16-sum16": {"learner": "fp16", "sum": "fp16", "scaler": {"policy": "dynamic"}},
         "dpo-bf16-sum16": {"learner": "bf16", "sum": "bf16", "scaler": None}}


def config(tmp_path, dpo, name="rl.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump({"study": "rl", "results_dir": str(tmp_path / "results"), "modes": GRPO,
                                    "dpo": dpo}, sort_keys=False))
    return path


def tiny(seeds=(0,), modes=MODES):
    return {"base": {"steps": 5, "seed": 0}, "seeds": list(seeds), "modes": modes,
            "train": {"steps": 3, "pairs": 4, "lr": 1.0e-3, "beta": 0.1, "census_every": 2}}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    out = tmp_path_factory.mktemp("dpo") / "base.pt"
    assert main(["rl-dpo-base", "--out", str(out), "--steps", "5"]) == 0
    return out


def chain(n=3000, vocab=16, seed=0):
    """A stream where token t is followed only by t + 1 or t + 2 (mod vocab): its bigrams are known."""
    steps = 1 + torch.randint(0, 2, (n,), generator=torch.Generator().manual_seed(seed))
    return steps.cumsum(0) % vocab


@pytest.mark.parametrize("corruption", ["bigram", "unigram"])
@pytest.mark.parametrize("k", [1, 3, 48])
def test_the_corruption_replaces_exactly_k_tokens_of_the_continuation(corruption, k):
    stream = chain()
    p = pairs(stream, 64, 16, 48, torch.Generator().manual_seed(1), corruption, k)
    assert p["chosen"].shape == p["rejected"].shape == (64, 64) and p["prompt"] == 16
    assert torch.equal(p["chosen"][:, :16], p["rejected"][:, :16])  # the prompt kept
    changed = p["chosen"] != p["rejected"]
    assert changed.sum(dim=1).tolist() == [k] * 64  # exactly k tokens, all in the continuation
    if corruption == "bigram":  # each replacement follows the token before it as the corpus's text does
        rows, cols = changed.nonzero(as_tuple=True)
        step = (p["rejected"][rows, cols] - p["rejected"][rows, cols - 1]) % 16
        assert set(step.tolist()) <= {1, 2}


def test_the_bigram_corruption_draws_from_the_table_and_the_shuffle_is_kept():
    stream = chain()
    table = token_table(stream, 16, "bigram")
    assert table.shape == (16, 16) and float(table.sum()) == len(stream) - 1
    assert bool((table[torch.arange(16), (torch.arange(16) + 3) % 16] == 0).all())  # never seen: never drawn
    p = pairs(stream, 8, 16, 48, torch.Generator().manual_seed(0))  # the default: the shuffle
    assert torch.equal(p["chosen"][:, 16:].sort(dim=1).values, p["rejected"][:, 16:].sort(dim=1).values)
    with pytest.raises(ValueError, match="k must be between 1 and the continuation's 48 tokens, got 49"):
        pairs(stream, 8, 16, 48, torch.Generator(), "bigram", 49)
    with pytest.raises(ValueError, match="corruption must be one of bigram, unigram, shuffle"):
        pairs(stream, 8, 16, 48, torch.Generator(), "swap")


def test_a_dpo_run_is_a_recording_that_diagnose_reads(tmp_path, base, capsys):
    cfg = config(tmp_path, tiny())
    out = tmp_path / "run"
    assert main(["rl-dpo-train", "--config", str(cfg), "--mode", "dpo-fp16-sum16", "--seed", "0", "--base", str(base),
                 "--out", str(out)]) == 0
    m = json.loads((out / "metrics.json").read_text())
    assert m["status"] == "ok" and m["steps"] == 3 and m["precision"] == "fp16" and m["scaler"] == "dynamic"
    assert m["learner"] == "fp16" and m["sum_dtype"] == "fp16" and m["nonfinite_steps"] == 0
    assert 0 <= m["accuracy_start"] <= 1 and 0 <= m["accuracy_end"] <= 1 and math.isfinite(m["margin_end"])
    assert m["census_fp32_replays"] == 2  # steps 0 and 2: the step's pairs replayed in FP32
    with open(out / "dpo_steps.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [0, 1, 2] and list(rows[0]) == dpo_run.STEP_FIELDS
    assert all(r["finite"] == "1" and 0 <= float(r["accuracy"]) <= 1 for r in rows)
    capsys.readouterr()
    assert main(["diagnose", str(out)]) == 0
    assert "3 steps, status ok" in capsys.readouterr().out
    assert main(["rl-dpo-train", "--config", str(cfg), "--mode", "dpo-fp32", "--base", str(base),
                 "--out", str(out)]) == 2  # a finished run is not overwritten
    assert "holds a finished run" in capsys.readouterr().err


def test_the_held_out_accuracy_is_the_policys(tmp_path, base):
    """At the start the policy is its reference: the start accuracy is the base's own preference; a policy that does
    not move (lr 0) ends where it started, with no implicit reward margin; one that trains moves the margin."""
    modes = parse_dpo(tiny())["modes"]
    model = dpo_run.dpo_model()
    model.load_state_dict(torch.load(base, weights_only=True)["model"])
    held = dpo_run.held_out_pairs()
    with torch.no_grad():  # an FP32 forward summed in FP32, whatever the run's formats
        c, r = (sequence_logprob(model, held[side], 16, "fp32", "fp32") for side in ("chosen", "rejected"))
    still = dpo_run.train_dpo(dpo_run.DPORun(modes["dpo-bf16-sum16"], steps=2, pairs=4, lr=0.0), base, tmp_path / "a")
    assert still["accuracy_start"] == still["accuracy_end"] == float((c > r).float().mean())
    assert still["margin_end"] == 0 and still["reward_accuracy_end"] == 0
    moved = dpo_run.train_dpo(dpo_run.DPORun(modes["dpo-fp32"], steps=2, pairs=4), base, tmp_path / "b")
    assert moved["accuracy_start"] == still["accuracy_start"] and moved["margin_end"] != 0


def test_a_crash_leaves_what_was_written(tmp_path, base, monkeypatch):
    real, calls = dpo_run.dpo_step, []

    def failing(*args, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("killed at step 2")
        return real(*args, **kw)
    monkeypatch.setattr(dpo_run, "dpo_step", failing)
    run = dpo_run.DPORun(parse_dpo(tiny())["modes"]["dpo-fp32"], steps=5, pairs=4, log_every=10)
    with pytest.raises(RuntimeError, match="killed at step 2"):
        dpo_run.train_dpo(run, base, tmp_path / "run")
    m = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert m["status"] == "failed" and "killed at step 2" in m["error"] and m["steps"] == 2
    with open(tmp_path / "run" / "dpo_steps.csv") as f:
        assert [r["step"] for r in csv.DictReader(f)] == ["0", "1"]


@pytest.mark.parametrize("change, said", [
    ({"epochs": 3}, "dpo: unknown key(s) ['epochs']; expected base, seeds, train, modes"),
    ({"train": {"steps": 3, "batch": 4}}, "dpo.train: unknown key(s) ['batch']"),
    ({"train": {"steps": 2.5}}, "dpo.train.steps: expected an int >= 1, got 2.5"),
    ({"train": {"lr": 0}}, "dpo.train.lr: expected a number > 0, got 0"),
    ({"train": {"corruption": "swap"}}, "dpo.train.corruption: expected one of bigram, unigram, shuffle, got 'swap'"),
    ({"train": {"k": 49}}, "dpo.train.k: expected at most the continuation's 48 tokens, got 49"),
    ({"base": {"steps": -1}}, "dpo.base.steps: expected an int >= 1, got -1"),
    ({"seeds": [1, 1]}, "dpo.seeds: expected a list of distinct ints >= 0, got [1, 1]"),
    ({"modes": {}}, "dpo.modes: expected a mapping {name: {learner, sum, scaler}}"),
    ({"modes": {"m": {"learner": "fp8"}}}, "dpo.modes.m.learner: expected one of fp32, bf16, fp16, got 'fp8'"),
    ({"modes": {"m": {"learner": "bf16", "sum": "fp16"}}},
     "dpo.modes.m.sum: expected fp32 or the learner's own format (bf16), got 'fp16'"),
    ({"modes": {"m": {"learner": "bf16", "scaler": {"policy": "dynamic"}}}},
     "dpo.modes.m.scaler: a loss scaler needs an fp16 learner, got learner bf16"),
    ({"modes": {"m": {"learner": "fp16", "scaler": "dynamic"}}},
     "dpo.modes.m.scaler: expected null or {policy: NAME, ...}, got 'dynamic'"),
    ({"modes": {"m": {"learner": "fp16", "temperature": 2}}}, "dpo.modes.m: unknown key(s) ['temperature']"),
])
def test_a_bad_dpo_block_is_refused_with_its_key_named(tmp_path, base, capsys, change, said):
    with pytest.raises(ConfigError) as e:
        parse_dpo({**tiny(), **change})
    assert said in str(e.value)
    cfg = config(tmp_path, {**tiny(), **change})
    assert main(["rl-dpo-train", "--config", str(cfg), "--mode", "m", "--base", str(base),
                 "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{cfg}: {said}" in err and len(err.splitlines()) == 1, err


def test_the_commands_refuse_a_config_without_the_block_an_unknown_mode_and_a_missing_base(tmp_path, base, capsys):
    path = tmp_path / "plain.yaml"
    path.write_text(yaml.safe_dump({"study": "rl", "modes": GRPO}))
    assert load_rl_study(path)["dpo"] is None
    assert main(["rl-dpo-aggregate", "--config", str(path), "--csv", "a.csv", "--md", "a.md"]) == 2
    assert "no `dpo:` block" in capsys.readouterr().err
    cfg = config(tmp_path, tiny())
    assert main(["rl-dpo-train", "--config", str(cfg), "--mode", "nonesuch", "--base", str(base), "--out", "x"]) == 2
    assert "--mode nonesuch: not in" in capsys.readouterr().err
    assert main(["rl-dpo-train", "--config", str(cfg), "--mode", "dpo-fp32", "--base", str(tmp_path / "none.pt"),
                 "--out", "x"]) == 2
    assert "no such file" in capsys.readouterr().err


def test_the_study_config_holds_the_family():
    dpo = load_rl_study("configs/rl.yaml")["dpo"]
    assert "dpo-fp32" in dpo["modes"] and len(dpo_runs(dpo)) == len(dpo["modes"]) * len(dpo["seeds"])
    assert all(m.scaler is None or m.learner == "fp16" for m in dpo["modes"].values())


def test_the_table_pairs_each_mode_with_dpo_fp32_by_seed(tmp_path, base):
    table_modes = {k: MODES[k] for k in ("dpo-fp32", "dpo-fp16-sum16", "dpo-bf16-sum16")}  # the reference, both sums
    cfg = config(tmp_path, tiny(seeds=(0, 1), modes=table_modes))
    study = load_rl_study(cfg)
    for mode, seed in dpo_runs(study["dpo"]):
        assert main(["rl-dpo-train", "--config", str(cfg), "--mode", mode, "--seed", str(seed), "--base", str(base),
                     "--out", str(dpo_run_folder(study["results_dir"], mode, seed)), "--steps", "2"]) == 0
    assert main(["rl-dpo-aggregate", "--config", str(cfg), "--csv", str(tmp_path / "t.csv"),
                 "--md", str(tmp_path / "t.md")]) == 0
    with open(tmp_path / "t.csv") as f:
        rows = {r["mode"]: r for r in csv.DictReader(f)}
    assert list(rows) == list(table_modes) and all(r["seeds"] == "2" for r in rows.values())
    ends = {(m, s): json.loads((dpo_run_folder(study["results_dir"], m, s) / "metrics.json").read_text())
            ["accuracy_end"] for m, s in dpo_runs(study["dpo"])}
    assert rows["dpo-fp32"]["delta_vs_fp32"] in ("", "nan")
    for mode in ("dpo-fp16-sum16", "dpo-bf16-sum16"):
        diffs = [ends[(mode, s)] - ends[("dpo-fp32", s)] for s in (0, 1)]
        assert float(rows[mode]["delta_vs_fp32"]) == pytest.approx(sum(diffs) / 2)
        assert float(rows[mode]["delta_half_width"]) == pytest.approx(t_interval(diffs)[1], nan_ok=True)
        assert float(rows[mode]["accuracy_end"]) == pytest.approx((ends[(mode, 0)] + ends[(mode, 1)]) / 2)
        assert rows[mode]["sum"] == MODES[mode]["sum"] and float(rows[mode]["nonfinite_steps"]) == 0
    assert float(rows["dpo-fp16-sum16"]["final_scale"]) > 1 and rows["dpo-fp16-sum16"]["policy"] == "dynamic"
    md = (tmp_path / "t.md").read_text()
    assert all(f"| {mode} |" in md for mode in table_modes) and "2 seeds per mode" in md


def test_a_zero_width_interval_is_shown_as_not_resolved(tmp_path):
    """Every seed the same difference: an interval of zero width, which decides nothing."""
    cfg = config(tmp_path, tiny(seeds=(0, 1), modes={k: MODES[k] for k in ("dpo-fp32", "dpo-bf16-sum16")}))
    study = load_rl_study(cfg)
    for (mode, seed), end in zip(dpo_runs(study["dpo"]), (0.5, 0.75, 0.625, 0.875)):
        folder = dpo_run_folder(study["results_dir"], mode, seed)
        folder.mkdir(parents=True)
        (folder / "metrics.json").write_text(json.dumps(
            {"accuracy_start": 0.5, "accuracy_end": end, "margin_end": 0.1, "reward_accuracy_end": 0.6,
             "nonfinite_steps": 0, "skipped_steps": 0, "overflow_steps": 0, "final_scale": 1.0}))
    assert main(["rl-dpo-aggregate", "--config", str(cfg), "--csv", str(tmp_path / "t.csv"),
                 "--md", str(tmp_path / "t.md")]) == 0
    assert "| +12.5 ± n.r. (zero width) |" in (tmp_path / "t.md").read_text()


def test_the_per_run_table_joins_the_grpo_runs_for_the_claims(tmp_path, capsys):
    """rl-dpo-aggregate --runs writes one row per run; rl-claims --dpo-runs decides a DPO claim on those rows beside
    the GRPO runs table (configs/claims_rl_long.yaml's DPO claim); a DPO mode also in the GRPO table is refused."""
    fp16 = {"learner": "fp16", "sum": "fp32"}
    modes = {"dpo-fp16": {**fp16, "scaler": {"policy": "dynamic"}},
             "dpo-fp16-smooth-capped": {**fp16, "scaler": {"policy": "smooth-capped"}}}
    seeds = tuple(range(8))
    cfg = config(tmp_path, tiny(seeds=seeds, modes=modes))
    study = load_rl_study(cfg)
    for mode, seed in dpo_runs(study["dpo"]):
        folder = dpo_run_folder(study["results_dir"], mode, seed)
        folder.mkdir(parents=True)
        capped = mode == "dpo-fp16-smooth-capped"
        (folder / "metrics.json").write_text(json.dumps(
            {"accuracy_start": 0.7, "accuracy_end": 0.8 + 0.001 * ((seed * (3 if capped else 5)) % 7),
             "margin_end": 0.1, "reward_accuracy_end": 0.6, "nonfinite_steps": 0,
             "skipped_steps": 0 if capped else 2 + seed % 3, "overflow_steps": 0, "final_scale": 65536.0}))
    dpo_csv = tmp_path / "dpo_runs.csv"
    assert main(["rl-dpo-aggregate", "--config", str(cfg), "--csv", str(tmp_path / "t.csv"),
                 "--md", str(tmp_path / "t.md"), "--runs", str(dpo_csv)]) == 0
    with open(dpo_csv) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 16 and {r["steps"] for r in rows} == {"3"} and rows[0]["mode"] == "dpo-fp16"
    grpo = tmp_path / "runs.csv"
    grpo.write_text("mode,seed,steps,solved_end,skipped_steps\nfp32,0,60,0.4,0\n")
    claims = tmp_path / "claims.yaml"
    claims.write_text(yaml.safe_dump({"claims": [{"id": "dpo", "text": "t", "source": "s", "all": [
        {"fewer_skips": {"left": "dpo-fp16-smooth-capped", "right": "dpo-fp16"}},
        {"equivalent": {"column": "accuracy_end", "left": "dpo-fp16-smooth-capped", "right": "dpo-fp16",
                        "margin": 0.03}}]}]}))
    md = tmp_path / "claims.md"
    assert main(["rl-claims", "--claims", str(claims), "--runs", str(grpo), "--dpo-runs", str(dpo_csv),
                 "--md", str(md)]) == 0
    assert "| **dpo**: t | **supported** |" in md.read_text()
    grpo.write_text("mode,seed,steps,solved_end,skipped_steps\ndpo-fp16,0,60,0.4,0\n")
    assert main(["rl-claims", "--claims", str(claims), "--runs", str(grpo), "--dpo-runs", str(dpo_csv),
                 "--md", str(md)]) != 0
    assert "mode(s) ['dpo-fp16'] are in the GRPO runs table too" in capsys.readouterr().err


def test_the_long_study_declares_its_dpo_claim_on_its_own_modes():
    study = load_rl_study("configs/rl-long.yaml")
    declared = load_file_modes("configs/claims_rl_long.yaml")
    assert declared <= set(study["modes"]) | set(study["dpo"]["modes"])
    assert study["dpo"]["train"]["steps"] >= 6000 and study["modes"]["fp16-gradscaler-6k"].train["steps"] >= 6000


def load_file_modes(path):
    modes = set()
    for claim in yaml.safe_load(open(path))["claims"]:
        for part in claim.get("all", [claim]):
            body = next(v for k, v in part.items() if k not in ("id", "text", "source"))
            modes |= {body[k] for k in ("left", "right") if k in body}
    return modes

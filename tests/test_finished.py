"""lab/run/finished.py: the copy a finished run keeps until the workflow has recorded it (the workflow case is in
tests/test_study_kill.py)."""
import json

from lab.run import finished


def finished_run(run_dir, config_hash="abc", status="ok"):
    run_dir.mkdir(parents=True, exist_ok=True)
    for name in finished.RUN_FILES:
        (run_dir / name).write_text(f"{name} of the run\n")
    (run_dir / "metrics.json").write_text(json.dumps({"config_hash": config_hash, "status": status, "steps": 7}))
    return run_dir


def outputs_deleted(run_dir):  # what Snakemake does before it runs a job again
    for name in finished.RUN_FILES:
        (run_dir / name).unlink()


def test_a_kept_run_is_restored_byte_for_byte(tmp_path):
    run = finished_run(tmp_path / "run")
    before = {n: (run / n).read_bytes() for n in finished.RUN_FILES}
    finished.keep(run)
    outputs_deleted(run)
    metrics = finished.restore(run, "abc")
    assert metrics["steps"] == 7
    assert {n: (run / n).read_bytes() for n in finished.RUN_FILES} == before
    assert (run / finished.FOLDER).is_dir()  # kept: under torchrun every rank looks at it


def test_no_restore_for_another_config_a_failed_run_or_a_partial_copy(tmp_path):
    other = finished_run(tmp_path / "other", config_hash="xyz")
    failed = finished_run(tmp_path / "failed", status="failed")
    partial = finished_run(tmp_path / "partial")
    for run in (other, failed, partial):
        finished.keep(run)
        outputs_deleted(run)
    (partial / finished.FOLDER / "census.csv").unlink()
    (tmp_path / "none").mkdir()
    for run in (other, failed, partial, tmp_path / "none"):
        assert finished.restore(run, "abc") is None
        assert not (run / "metrics.json").exists(), run  # nothing written


def test_restore_without_write_reads_only(tmp_path):
    run = finished_run(tmp_path / "run")
    finished.keep(run)
    outputs_deleted(run)
    assert finished.restore(run, "abc", write=False)["steps"] == 7
    assert not (run / "metrics.json").exists()


def test_keep_replaces_an_older_copy_whole_and_drop_removes_every_copy(tmp_path):
    a, b = finished_run(tmp_path / "runs" / "a"), finished_run(tmp_path / "runs" / "m" / "b")
    finished.keep(a)
    (a / "steps.csv").write_text("a newer run\n")
    finished.keep(a)
    assert (a / finished.FOLDER / "steps.csv").read_text() == "a newer run\n"
    assert not (a / (finished.FOLDER + ".tmp")).exists()
    finished.keep(b)
    assert finished.drop(tmp_path / "runs") == 2
    assert not list((tmp_path / "runs").rglob(finished.FOLDER))
    assert finished.drop(tmp_path / "absent") == 0

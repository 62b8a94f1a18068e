"""The CPU guard of tests/conftest.py: a test not marked `cuda` whose runs recorded a GPU fails, whether the run
was made in its own tmp_path or by a module-scoped fixture, and whatever depth the device field sits at; a test
marked `cuda` may. Shown on an inner pytest session that uses this suite's conftest."""
import json

import pytest

from conftest import REPO, recorded_devices

pytest_plugins = ["pytester"]

INNER = '''
import json
import pytest


def write(folder, device):
    (folder / "metrics.json").write_text(json.dumps({"model": "m", "device": device}))


def write_nested(folder, device):
    (folder / "provenance.json").write_text(json.dumps({"host": {"accelerator": {"device": device}}}))


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    d = tmp_path_factory.mktemp("shared_runs")
    write(d, DEVICE_SHARED)
    return d


def test_own_run(tmp_path):
    write(tmp_path, DEVICE_OWN)


def test_nested_field(tmp_path):
    write_nested(tmp_path, DEVICE_NESTED)


def test_uses_shared(shared):
    assert shared.is_dir()


@pytest.mark.cuda
def test_marked_recorded_cuda(tmp_path):
    write(tmp_path, "cuda")
'''


def run_inner(pytester, own="cpu", nested="cpu", shared="cpu"):
    pytester.makeconftest((REPO / "tests" / "conftest.py").read_text())
    pytester.makeini("[pytest]\nmarkers =\n    cuda: asks for CUDA\n")
    pytester.makepyfile(test_inner=f"DEVICE_OWN, DEVICE_NESTED, DEVICE_SHARED = {own!r}, {nested!r}, {shared!r}\n"
                        + INNER)
    return pytester.runpytest_subprocess("-p", "no:xdist", "-p", "no:cacheprovider")


@pytest.mark.cuda  # its inner session writes GPU records into this test's folder on purpose
def test_the_guard_passes_cpu_runs_and_a_marked_cuda_test(pytester):
    res = run_inner(pytester)
    res.assert_outcomes(passed=4)


@pytest.mark.cuda  # its inner session writes GPU records into this test's folder on purpose
def test_the_guard_fails_a_cpu_test_whose_run_landed_on_a_gpu(pytester):
    res = run_inner(pytester, own="cuda:0", nested="cuda")
    res.assert_outcomes(passed=4, errors=2)  # the two runs' tests fail at teardown (their calls passed)
    assert "landed on ['cuda:0']" in res.stdout.str() and "landed on ['cuda']" in res.stdout.str()


@pytest.mark.cuda  # its inner session writes GPU records into this test's folder on purpose
def test_the_guard_sees_runs_made_by_module_scoped_fixtures(pytester):
    res = run_inner(pytester, shared="cuda")
    res.assert_outcomes(passed=4, errors=1)  # the module's teardown
    assert "shared_runs" in res.stdout.str() and "landed on ['cuda']" in res.stdout.str()


@pytest.mark.cuda  # it writes GPU records on purpose
def test_recorded_devices_reads_every_device_field(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "metrics.json").write_text(json.dumps({"device": "cpu", "x": [{"device": {"type": "cuda"}}]}))
    (tmp_path / "a" / "config.yaml").write_text("device: cuda:1\ntrain: {}\n")
    (tmp_path / "b.json").write_text(json.dumps({"loader_device": "mps"}))
    assert recorded_devices(tmp_path) == {"cpu", "cuda", "cuda:1", "mps"}

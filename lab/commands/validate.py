"""`python -m lab validate`: a study config checked, and its runs counted (an RL study's too)."""
from __future__ import annotations

from lab.core.config import load_study


def add_parser(sub) -> None:
    v = sub.add_parser("validate", help="check a study config and list its runs")
    v.add_argument("--config", action="append", default=None, metavar="FILE")
    v.set_defaults(handler=main)


def main(args) -> int:
    from lab.diagnose.alerts import is_alerts_file, load_alerts
    from lab.rl.grpo_study import rl_runs
    from lab.rl.study import is_rl_file, load_rl_study
    if args.config and len(args.config) == 1 and is_alerts_file(args.config[0]):  # configs/alerts.yaml: no runs
        a = load_alerts(args.config[0])
        print(f"config OK: alert-threshold study, {len(a['runs'])} run patterns read (nothing trained), results in "
              f"{a['results_dir']}/")
        return 0
    if args.config and len(args.config) == 1 and is_rl_file(args.config[0]):  # configs/rl.yaml
        rl = load_rl_study(args.config[0])
        dpo = (f"; DPO: {len(rl['dpo']['modes'])} modes x {len(rl['dpo']['seeds'])} seeds from its own base"
               if rl["dpo"] else "")
        print(f"config OK: RL study, {len(rl['modes'])} modes, {len(rl_runs(rl))} GRPO runs "
              f"(seeds and steps per mode) from one base{dpo}")
        print(f"runs on: cpu (the sampler's and learner's FP16/BF16 under the tensor-core contract); results in "
              f"{rl['results_dir']}/")
        return 0
    from lab.core.run_checks import check_study
    from lab.core.study import family_modes, family_seeds, study_runs
    study = load_study(args.config)
    check_study(study)  # what `lab train` would refuse in a run, in its words (lab/core/run_checks.py)
    runs = study_runs(study)
    seeds = sorted({len(family_seeds(study, m)) for m in study["models"]})
    modes = sorted({len(family_modes(study, m)) for m in study["models"]})
    print(f"config OK: {len(study['models'])} models x {'/'.join(map(str, modes))} modes x "
          f"{'/'.join(map(str, seeds))} seeds = {len(runs)} runs")
    print(_runs_on(study))
    return 0


def _runs_on(study: dict) -> str:
    """Where a study's runs train and whose numerics its results hold (make study prints it first)."""
    import torch
    device = study["device"]
    on = "cuda" if device == "cuda" or (device == "auto" and torch.cuda.is_available()) else "cpu"
    what = ("CUDA's own FP16/BF16 kernels (a GPU study)" if on == "cuda"
            else "the CPU's FP32 kernels, FP16/BF16 under the tensor-core contract (a CPU study)")
    why = " (device: auto, on this machine)" if device == "auto" else ""
    return f"runs on: {on}{why}: {what}; results in {study['results_dir']}/"

"""What the replay an adapter builds costs a framework run: the transformers Trainer with `use_lab_trainer(...,
out=)`, replay on (the default) and off, side by side.

A GPT-2 (4 layers, width 128, context 64, vocabulary 1024, random weights), FP16 on the CPU under the tensor-core
contract, batch 8, gradient accumulation 4, the lab's `dynamic` scaler from 2^16 (a healthy run: no overflow step, so
the only replays are the census's FP32 ones). The two settings alternate, ``--rounds`` times each, the order flipped
every round; each time is a whole `train()`. Reported: the median time per optimizer step of each setting, their
ratio, and the replay's cost per census step ((on - off) x steps / census steps), against one micro-batch's step time.

    python benchmarks/speed/bench_adapter_replay.py --out results/benchmarks/adapter_replay.json
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lab.core import files  # noqa: E402


def trainer(out: Path, steps: int, replay: bool, census_every: int):
    from accelerate.state import AcceleratorState
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from lab.integrations.hf import use_lab_trainer
    AcceleratorState._reset_state(True)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=1024, n_positions=64, n_embd=128, n_layer=4, n_head=4))
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": r, "labels": r} for r in torch.randint(0, 1024, (8 * 4 * steps, 64), generator=g)]
    args = TrainingArguments(output_dir=str(out / "trainer"), fp16=True, use_cpu=True, max_steps=steps,
                             per_device_train_batch_size=8, gradient_accumulation_steps=4, learning_rate=1e-4,
                             report_to=[], disable_tqdm=True, save_strategy="no", logging_strategy="no")
    t = Trainer(model=model, args=args, train_dataset=rows)
    use_lab_trainer(t, "dynamic", out=out / "rec", census_every=census_every, replay=replay)
    return t


def timed(steps: int, replay: bool, census_every: int) -> float:
    with tempfile.TemporaryDirectory() as d:
        t = trainer(Path(d), steps, replay, census_every)
        start = time.perf_counter()
        t.train()
        return (time.perf_counter() - start) / steps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--census-every", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    times = {True: [], False: []}
    for r in range(a.rounds):
        for replay in ((True, False) if r % 2 == 0 else (False, True)):
            times[replay].append(timed(a.steps, replay, a.census_every))
            print(f"round {r} replay={replay}: {1000 * times[replay][-1]:.1f} ms/step", flush=True)
    on, off = statistics.median(times[True]), statistics.median(times[False])
    census_steps = -(-a.steps // a.census_every)
    per_census = (on - off) * a.steps / census_steps
    result = {"steps": a.steps, "census_every": a.census_every, "rounds": a.rounds, "ms_per_step_replay": 1000 * on,
              "ms_per_step_no_replay": 1000 * off, "ratio": on / off, "ms_per_census_step": 1000 * per_census,
              "per_census_step_over_step": per_census / off, "times": {str(k): v for k, v in times.items()},
              "torch": torch.__version__, "threads": 1}
    print(f"replay on / off: {on / off:.3f} ({1000 * on:.1f} vs {1000 * off:.1f} ms/step); each census step's replay "
          f"{1000 * per_census:.1f} ms = {per_census / off:.2f} of a step (4 micro-batches)")
    if a.out:
        files.atomic_write_json(a.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Which kernels computed a run's reduced-precision ops (metrics.json's ``fp16_path``), torch-free so that the
tables and figures can read it without importing torch: the tensor-core contract in software on a CPU
(lab/numerics/contract.py) or CUDA's own kernels."""
import math

FP16_PATH_CONTRACT = "cpu-tensor-core-contract"
FP16_PATH_CUDA = "cuda-native"


def speed_cell(speed, fp16_path) -> str:
    """A speed ratio against FP32 as a reader should take it: on a CPU the 16-bit and FP8 modes run the tensor-core
    contract in software, so their ratio is the emulation's cost (in runs sharing the machine), never the
    precision's speed: marked so where it is shown (the overview's table, summary.md)."""
    try:
        speed = float(speed)
    except (TypeError, ValueError):
        return "—"
    if not math.isfinite(speed):
        return "—"
    return f"{speed:.2f}x" + (" (emulated)" if fp16_path == FP16_PATH_CONTRACT else "")

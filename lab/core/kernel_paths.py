"""Which kernels computed a run's reduced-precision ops (metrics.json's ``fp16_path``), torch-free so that the
tables and figures can read it without importing torch: the tensor-core contract in software on a CPU
(lab/numerics/contract.py) or CUDA's own kernels."""
FP16_PATH_CONTRACT = "cpu-tensor-core-contract"
FP16_PATH_CUDA = "cuda-native"

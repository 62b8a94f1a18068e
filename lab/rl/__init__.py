"""Reinforcement-learning fine-tuning in FP16: the sampler and the learner as two paths that round at different
points (paths.py), a sampler quantized below 16 bits as a registered declaration (samplers/), the mismatch between
their log-probabilities (mismatch.py).

Since 2025 FP16 is back where language models are fine-tuned with RL (Qi et al., arXiv:2510.26788): the inference
engine that samples rollouts and reports their log-probabilities (mu) and the trainer that recomputes them (pi)
round at different points; BF16's 8 bits of mantissa make them disagree about 8x more than FP16's 11. docs/rl.md.
"""

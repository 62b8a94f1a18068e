"""Loss-Scale Lab: measure what each FP16 loss-scaling policy costs."""

__version__ = "0.1.0"

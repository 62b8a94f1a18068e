"""FP16 facts: census.py (what an FP16 cast makes of gradient values: census, log2 histograms), monitor.py (the
census and overflow attribution during training), contract.py (the GPU tensor core's FP16/BF16 contract on CPU) and
contract_reference.py (its FP64 reference), precision.py (a precision's forward context: lab.autocast, autocast_for,
autocast_off), recompute.py (gradient checkpointing recomputed under the forward's precision: lab.checkpoint).
Imports only lab.core."""

"""What the learned predictor reads of a history: scale-free features of its log2 amaxes, so that one model serves
tensors of any magnitude (an FP8 layer's weight at 2^-3, its output gradient at 2^-20; FP16's gradients).

The model predicts the change from the most recent amax, ``log2 a[t+1] - log2 a[t]``, as a linear function of
these features (an intercept first); fitting (fit.py) and predicting (predictors/learned.py) both call
``features``, the one place they are computed. A history is most recent first, with a mask of the observed steps.
"""
from __future__ import annotations

#: how many of the most recent steps the features read (a longer history is cut to these)
WINDOW = 16
#: the features, in the model's order: its artefact records them and a model fitted on others is refused
FEATURES = ("intercept", "last_change", "above_mean4", "above_mean16", "below_max16", "sd16", "largest_jump16",
            "one_over_count")


def _masked_mean(x, seen, n):  # torch is imported by the functions: the names above serve a torch-free check
    w = seen[..., :n]
    return (x[..., :n] * w).sum(-1) / w.sum(-1).clamp(min=1)


def features(amax, observed):
    """(features (..., len(FEATURES)), log2 of the most recent observed amax (...)) of histories ``amax`` (..., n):
    most recent first, finite and positive where ``observed`` (other entries any finite positive value). A history
    whose latest steps are unobserved (an all-zero or overflowed operand, a frozen layer) is read from its latest
    observed step on, as if the steps after it had not happened: the model learned from histories whose latest step
    is observed (``windows``), and a fully observed history is read as it stands."""
    import torch
    from lab.scaling.predictors import latest_observed
    if amax.shape[-1] < WINDOW:
        pad = WINDOW - amax.shape[-1]
        amax = torch.nn.functional.pad(amax, (0, pad), value=1.0)
        observed = torch.nn.functional.pad(observed, (0, pad), value=False)
    length = amax.shape[-1]
    pos = latest_observed(observed) + torch.arange(WINDOW, device=amax.device)
    inside = pos < length
    pos = pos.clamp(max=length - 1)
    amax, seen = amax.gather(-1, pos), (observed.gather(-1, pos) & inside).to(amax.dtype)
    log2 = torch.log2(amax) * seen  # 0 where unobserved: every sum below is masked
    last = log2[..., 0]
    mean16 = _masked_mean(log2, seen, WINDOW)
    sd16 = (((log2 - mean16.unsqueeze(-1)) ** 2 * seen).sum(-1) / seen.sum(-1).clamp(min=1)).sqrt()
    below = torch.where(seen > 0, log2, torch.full_like(log2, -torch.inf)).amax(-1) - last
    both = seen[..., 1:] * seen[..., :-1]
    jump = ((log2[..., :-1] - log2[..., 1:]).abs() * both).amax(-1)
    out = torch.stack([torch.ones_like(last), (last - log2[..., 1]) * seen[..., 1], last - _masked_mean(log2, seen, 4),
                       last - mean16, below, sd16, jump, 1.0 / seen.sum(-1).clamp(min=1)], -1)
    return out, last


def windows(sequence):
    """A recorded amax sequence (steps, oldest first) as learning samples: for each step t >= 1 with a finite,
    positive amax at t and t-1, the history before t (most recent first, WINDOW long, masked where absent or not
    finite) and the target log2 a[t] - log2 a[t-1]. Returns (amax (N, WINDOW), observed (N, WINDOW), target (N,))."""
    import torch
    seq = sequence.to(torch.float64)
    ok = torch.isfinite(seq) & (seq > 0)
    padded = torch.cat([torch.ones(WINDOW - 1, dtype=seq.dtype), torch.where(ok, seq, torch.ones_like(seq))])
    okp = torch.cat([torch.zeros(WINDOW - 1, dtype=torch.bool), ok])
    idx = torch.arange(1, len(seq))  # predict step t from steps < t
    cols = (idx.unsqueeze(1) - 1 - torch.arange(WINDOW).unsqueeze(0)) + WINDOW - 1  # most recent first
    amax, observed = padded[cols], okp[cols]
    keep = ok[idx] & ok[idx - 1]
    target = torch.log2(seq[idx]) - torch.log2(seq[idx - 1])
    return amax[keep], observed[keep], target[keep]

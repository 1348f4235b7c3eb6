"""Confidence calibration of block drafters (design §5b): sequential temperature scaling of the
confidence head's survival products, and the calibration errors it reports (`train.block` runs it
after training and stores the temperatures in the drafter's config)."""
from __future__ import annotations

import numpy as np

def ece(prob_N, label_N, bins: int = 10) -> float:
    """Expected calibration error of probabilities against 0/1 labels (equal-width bins)."""
    prob_N, label_N = np.asarray(prob_N, np.float64), np.asarray(label_N, np.float64)
    idx = np.minimum((prob_N * bins).astype(int), bins - 1)
    err = 0.0
    for b in range(bins):
        sel = idx == b
        if sel.any():
            err += sel.mean() * abs(prob_N[sel].mean() - label_N[sel].mean())
    return float(err)


def survival_ece(conf_logits_NxW, accepted_NxW, temperatures=None) -> list[float]:
    """Per position k, the ECE of the cumulative product prod_{j<=k} sigmoid(z_j / T_j) against the
    label "positions 0..k all accepted" (T = 1 without temperatures)."""
    z = np.asarray(conf_logits_NxW, np.float64)
    t = np.ones(z.shape[1]) if temperatures is None else np.asarray(temperatures, np.float64)
    surv = np.cumprod(1.0 / (1.0 + np.exp(-z / t)), axis=1)
    return [ece(surv[:, k], np.asarray(accepted_NxW)[:, k]) for k in range(z.shape[1])]


def log_loss(prob_N, label_N, eps: float = 1e-7) -> float:
    """Mean binary cross-entropy of probabilities against 0/1 labels."""
    p = np.clip(np.asarray(prob_N, np.float64), eps, 1 - eps)
    y = np.asarray(label_N, np.float64)
    return float(-(y * np.log(p) + (1 - y) * np.log1p(-p)).mean())


def calibrate_temperatures(conf_logits_NxW, accepted_NxW, grid=None) -> tuple[tuple[float, ...], list[float], list[float]]:
    """Sequential temperature scaling: for k = 0..W-1 in order, the temperature T_k (from `grid`)
    minimising the log loss of the cumulative product prod_{j<=k} sigmoid(z_j / T_j) against the
    cumulative acceptance label (positions 0..k all accepted), T_0..T_{k-1} fixed.
    The fit minimises the log loss, a proper score (Guo et al.'s temperature scaling), not the ECE:
    the binned ECE is near zero for a near-constant probability at the base rate too, so minimising
    it drifted on noise, up to the grid's bound (8.0). A temperature only rescales a logit: a head
    that is off by an offset (trained on other text than it is validated on) stays off.
    Returns (temperatures, ECE before, ECE after) per position."""
    z = np.asarray(conf_logits_NxW, np.float64)
    y = np.asarray(accepted_NxW, np.float64)
    grid = np.asarray(grid if grid is not None else np.exp(np.linspace(np.log(0.25), np.log(8.0), 49)))
    sig = lambda a: 1.0 / (1.0 + np.exp(-a))  # noqa: E731
    temps, before, after = [], [], []
    surv_raw, surv = np.ones(len(z)), np.ones(len(z))
    for k in range(z.shape[1]):
        surv_raw = surv_raw * sig(z[:, k])
        before.append(ece(surv_raw, y[:, k]))
        errs = [log_loss(surv * sig(z[:, k] / t), y[:, k]) for t in grid]
        t = float(grid[int(np.argmin(errs))])
        temps.append(round(t, 4))
        surv = surv * sig(z[:, k] / t)
        after.append(ece(surv, y[:, k]))
    return tuple(temps), before, after

"""Calibration metrics for stated confidences (pure numpy).

Inputs are ``confidence[N]`` in [0, 1] and ``correct[N]`` in {0, 1}:

- Brier score: ``mean((confidence - correct)^2)`` (0 is perfect; constant 0.5 scores 0.25).
- Reliability bins: ``n_bins`` equal-width bins over [0, 1]. Our convention (``right_closed=False``):
  bin ``b`` holds confidences in ``[b/n, (b+1)/n)``, the last bin also holds 1.0. The other common
  one (``right_closed=True``): ``(b/n, (b+1)/n]``, as in Guo et al. 2017's reference ECE code
  (``conf > lo and conf <= hi``), with 0.0 put in the first bin (that code drops it). Confidences
  stated on the 0.1 grid (RLCR's, and the warm start's 0.0, 0.1, ..., 1.0) sit exactly on edges, so
  the two conventions can give different ECEs (by up to ~0.06 in one check). Per bin: count, mean
  confidence, accuracy (``None`` for an empty bin).
- ECE: ``sum_b (count_b / N) * |accuracy_b - mean_confidence_b|`` over those bins.
- AUROC of confidence as a score for correctness: the probability that a random correct answer has
  a higher confidence than a random wrong one, ties counting one half (Mann-Whitney U). NaN when
  all answers are right or all are wrong (undefined).
"""

from __future__ import annotations

import numpy as np

DEFAULT_BINS = 10


def _arrays(confidence, correct) -> tuple[np.ndarray, np.ndarray]:
    c = np.asarray(confidence, dtype=np.float64).reshape(-1)
    y = np.asarray(correct, dtype=np.float64).reshape(-1)
    if c.shape != y.shape:
        raise ValueError(f"confidence has {c.size} values but correct has {y.size}")
    if c.size and (c.min() < 0 or c.max() > 1):
        raise ValueError("confidences must lie in [0, 1]")
    return c, y


def brier_score(confidence, correct) -> float:
    """``mean((c - y)^2)`` over ``[N]``; NaN for N = 0."""
    c, y = _arrays(confidence, correct)
    return float(np.mean((c - y) ** 2)) if c.size else float("nan")


def bin_index(confidence, n_bins: int = DEFAULT_BINS, right_closed: bool = False) -> np.ndarray:
    """Bin of each confidence ``[N] -> int [N]``: ``floor(c * n_bins)``, 1.0 in the last bin;
    ``right_closed``: ``ceil(c * n_bins) - 1``, 0.0 in the first bin.

    A tiny tolerance puts decimal edges such as 0.3 (stored as 0.29999...) on the edge they name.
    """
    c = np.asarray(confidence, dtype=np.float64)
    raw = np.ceil(c * n_bins - 1e-9) - 1 if right_closed else np.floor(c * n_bins + 1e-9)
    return np.clip(raw, 0, n_bins - 1).astype(np.int64)


def reliability_bins(confidence, correct, n_bins: int = DEFAULT_BINS, right_closed: bool = False) -> list[dict]:
    """Reliability-diagram data: one dict per bin with ``lo``, ``hi``, ``count``, ``confidence``
    (mean stated confidence) and ``accuracy`` (``None`` for an empty bin)."""
    c, y = _arrays(confidence, correct)
    idx = bin_index(c, n_bins, right_closed)
    out = []
    for b in range(n_bins):
        sel = idx == b
        n = int(sel.sum())
        out.append(
            {
                "lo": b / n_bins,
                "hi": (b + 1) / n_bins,
                "count": n,
                "confidence": float(c[sel].mean()) if n else None,
                "accuracy": float(y[sel].mean()) if n else None,
            }
        )
    return out


def expected_calibration_error(confidence, correct, n_bins: int = DEFAULT_BINS, right_closed: bool = False) -> float:
    """ECE over ``n_bins`` equal-width bins (edges as in the module doc); NaN for N = 0."""
    c, _ = _arrays(confidence, correct)
    if not c.size:
        return float("nan")
    bins = reliability_bins(confidence, correct, n_bins, right_closed)
    return float(sum(b["count"] / c.size * abs(b["accuracy"] - b["confidence"]) for b in bins if b["count"]))


def auroc(confidence, correct) -> float:
    """Area under the ROC curve of confidence for correctness (ties count 1/2); NaN if one class."""
    c, y = _arrays(confidence, correct)
    pos, neg = c[y > 0.5], c[y <= 0.5]
    if not pos.size or not neg.size:
        return float("nan")
    greater = (pos[:, None] > neg[None, :]).sum()
    ties = (pos[:, None] == neg[None, :]).sum()
    return float((greater + 0.5 * ties) / (pos.size * neg.size))


def calibration_report(confidence, correct, n_bins: int = DEFAULT_BINS, right_closed: bool = False) -> dict:
    """Accuracy, Brier, ECE, AUROC, mean confidence, size and the reliability bins in one dict."""
    c, y = _arrays(confidence, correct)
    return {
        "accuracy": float(y.mean()) if y.size else float("nan"),
        "brier": brier_score(c, y),
        "ece": expected_calibration_error(c, y, n_bins, right_closed),
        "auroc": auroc(c, y),
        "confidence_mean": float(c.mean()) if c.size else float("nan"),
        "size": int(c.size),
        "reliability": reliability_bins(c, y, n_bins, right_closed),
    }

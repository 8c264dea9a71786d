"""Pearson's chi-square, as the sampling tests use it."""

from __future__ import annotations

import numpy as np


def chi_square_fits(counts: np.ndarray, expected: np.ndarray) -> tuple[float, float]:
    """(chi-square, its 99.9th percentile) of `counts` against `expected` counts, the
    cells expected fewer than 5 times merged into one. The percentile is Wilson and
    Hilferty's for the degrees of freedom left: a sampler off by a percent at a likely
    cell exceeds it."""
    order = np.argsort(expected)[::-1]
    keep = order[expected[order] >= 5]
    rest = order[expected[order] < 5]
    observed = np.append(counts[keep], counts[rest].sum())
    wanted = np.append(expected[keep], expected[rest].sum())
    chi2 = float(((observed - wanted) ** 2 / np.maximum(wanted, 1e-12)).sum())
    dof = len(observed) - 1
    bound = dof * (1 - 2 / (9 * dof) + 3.09 * np.sqrt(2 / (9 * dof))) ** 3
    return chi2, bound

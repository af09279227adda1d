"""The fit both cost models share: least squares on relative error, every coefficient >= 0."""
from __future__ import annotations

import numpy as np


def nonnegative_relative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin_c sum(((x c - y) / y)^2) subject to c >= 0: scipy's NNLS (Lawson and Hanson's active set) on the
    rows divided by y. Columns are scaled to unit norm first: the features differ by orders of magnitude, and the
    active-set test compares their gradients."""
    from scipy.optimize import nnls  # scipy comes with the simulate extra (statsmodels needs it too)

    a = x / y[:, None]
    norms = np.linalg.norm(a, axis=0)
    norms[norms == 0] = 1.0  # a feature no step exercised keeps coefficient 0
    coef, _residual = nnls(a / norms, np.ones_like(y))
    return coef / norms

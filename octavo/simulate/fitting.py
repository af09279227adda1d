"""The fit both cost models share: least squares on relative error, every coefficient >= a floor (0 by default)."""
from __future__ import annotations

from typing import Optional

import numpy as np


def nonnegative_relative_lstsq(x: np.ndarray, y: np.ndarray, lower: Optional[np.ndarray] = None,
                               weights: Optional[np.ndarray] = None) -> np.ndarray:
    """argmin_c sum((w (x c - y) / y)^2) subject to c >= 0 (or c >= ``lower``), w = ``weights`` (1 by default):
    scipy's NNLS (Lawson and Hanson's active set) on the rows divided by y / w, fitting c - lower. Columns are
    scaled to unit norm first: the features differ by orders of magnitude, and the active-set test compares
    their gradients."""
    from scipy.optimize import nnls  # scipy comes with the simulate extra (statsmodels needs it too)

    lower = np.zeros(x.shape[1]) if lower is None else lower
    w = np.ones(len(y)) if weights is None else weights
    a = x * (w / y)[:, None]
    norms = np.linalg.norm(a, axis=0)
    norms[norms == 0] = 1.0  # a feature no step exercised keeps coefficient 0
    coef, _residual = nnls(a / norms, w - a @ lower)
    return coef / norms + lower

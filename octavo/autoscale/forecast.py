"""The predictive half's forecaster: the request rate's history in fixed
buckets, and a Holt-Winters (statsmodels ``ExponentialSmoothing``) fit that
forecasts it.

Holt-Winters carries one season, so the model takes the longest season the
history covers twice (weekly after two weeks, daily after two days: the
heuristic initialisation needs two full cycles to separate level, trend and
season); with less history it is Holt's damped trend alone. Seasonality is
additive because request rates reach zero at night, where a multiplicative
season is undefined. statsmodels is imported on the first fit only, so the
reactive policy works without it (extra ``octavo[autoscale]``).
"""
from __future__ import annotations

import math
import warnings
from collections import deque
from dataclasses import dataclass
from typing import Optional, Sequence

# Holt's trend model needs a few points to fit its level, trend and damping.
MIN_TREND_POINTS = 10


class RateHistory:
    """Mean request rate per ``bucket_s`` bucket, for the last ``max_age_s``."""

    def __init__(self, bucket_s: float, max_age_s: float) -> None:
        self.bucket_s = bucket_s
        self.max_buckets = max(1, math.ceil(max_age_s / bucket_s))
        self._buckets: deque[list[float]] = deque()  # [index, rate sum, count]

    def add(self, time: float, rate: float) -> None:
        index = math.floor(time / self.bucket_s)
        if self._buckets and index < self._buckets[-1][0]:
            return  # out of order: the bucket is already closed
        if self._buckets and self._buckets[-1][0] == index:
            self._buckets[-1][1] += rate
            self._buckets[-1][2] += 1
        else:
            self._buckets.append([index, rate, 1])
        while self._buckets[-1][0] - self._buckets[0][0] >= self.max_buckets:
            self._buckets.popleft()

    def complete(self, now: float) -> tuple[int, list[float]]:
        """(first bucket index, mean rate of every closed bucket before ``now``);
        empty buckets between filled ones take the previous value (no samples
        means no scrape, not no traffic)."""
        current = math.floor(now / self.bucket_s)
        closed = [b for b in self._buckets if b[0] < current]
        if not closed:
            return current, []
        values: list[float] = []
        expected = closed[0][0]
        for index, total, count in closed:
            while expected < index:
                values.append(values[-1])
                expected += 1
            values.append(total / count)
            expected += 1
        return closed[0][0], values


@dataclass(frozen=True)
class Forecast:
    """Forecast rates for the buckets starting at ``start``, one per ``bucket_s``."""

    start: float
    bucket_s: float
    values: tuple[float, ...]
    model: str

    def peak(self, t0: float, t1: float) -> Optional[float]:
        """The highest forecast rate of the buckets overlapping [t0, t1]; None
        when the forecast does not reach t1 (time to refit)."""
        first = math.floor((t0 - self.start) / self.bucket_s)
        last = math.floor((t1 - self.start) / self.bucket_s)
        if last >= len(self.values):
            return None
        return max(self.values[max(first, 0): last + 1])


def season_buckets(n_points: int, bucket_s: float, seasonal_periods_s: Sequence[float]) -> Optional[int]:
    """The longest season (in buckets) that ``n_points`` covers twice, if any."""
    fitting = [round(p / bucket_s) for p in seasonal_periods_s if n_points >= 2 * round(p / bucket_s) >= 4]
    return max(fitting) if fitting else None


def fit_forecast(
    first_index: int, values: Sequence[float], bucket_s: float, seasonal_periods_s: Sequence[float], steps: int
) -> Optional[Forecast]:
    """Holt-Winters on the bucket series, ``steps`` buckets ahead; None with
    too little history for even the trend model."""
    if len(values) < MIN_TREND_POINTS:
        return None
    import numpy as np
    from statsmodels.tsa.holtwinters import ExponentialSmoothing

    season = season_buckets(len(values), bucket_s, seasonal_periods_s)
    series = np.asarray(values, dtype=float)
    if season is not None:
        model = ExponentialSmoothing(series, trend="add", damped_trend=True, seasonal="add",
                                     seasonal_periods=season, initialization_method="heuristic")
        name = f"holt-winters season {season * bucket_s:g}s"
    elif float(series.max() - series.min()) == 0.0:
        # A constant series: the optimiser has nothing to fit (and warns); the forecast is the constant.
        return Forecast((first_index + len(values)) * bucket_s, bucket_s, (float(series[-1]),) * steps, "constant")
    else:
        model = ExponentialSmoothing(series, trend="add", damped_trend=True, initialization_method="estimated")
        name = "holt damped trend"
    with warnings.catch_warnings():
        # Convergence chatter from the optimiser on short or flat series: the fit is still usable.
        warnings.simplefilter("ignore")
        predicted = model.fit().forecast(steps)
    # Additive seasons can dip below zero at a trough; a rate cannot.
    clipped = tuple(max(0.0, float(v)) for v in predicted)
    return Forecast((first_index + len(values)) * bucket_s, bucket_s, clipped, name)

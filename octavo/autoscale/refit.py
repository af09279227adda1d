"""Where the forecaster's fits run: on the caller's thread, or on a thread of
their own so the control loop keeps its interval.

A Holt-Winters fit (and statsmodels' first import) takes seconds; run inline
in ``octavo autoscale``'s loop it delays the round it lands in and the next
two decisions run back to back. The simulator keeps fitting inline: its
clock is simulated, and its decisions must not depend on thread timing.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

from octavo.autoscale.forecast import Forecast, fit_forecast

logger = logging.getLogger("octavo.autoscale")


@dataclass(frozen=True)
class FitJob:
    """What ``fit_forecast`` is given: the history and how far to forecast."""

    first_index: int
    values: Sequence[float]
    bucket_s: float
    seasonal_periods_s: Sequence[float]
    steps: int

    def run(self) -> Optional[Forecast]:
        return fit_forecast(self.first_index, self.values, self.bucket_s, self.seasonal_periods_s, self.steps)


class Fitter(Protocol):
    busy: bool  # a fit is running: ``latest`` is older than the last ``refit``

    def refit(self, job: FitJob) -> None:
        """Start (or run) a fit of ``job``."""

    def latest(self) -> Optional[Forecast]:
        """The forecast of the last fit that finished; None before the first."""


class InlineFitter:
    """Fits on the caller's thread: ``latest`` is the fit of the last ``refit``."""

    busy = False

    def __init__(self) -> None:
        self._forecast: Optional[Forecast] = None

    def refit(self, job: FitJob) -> None:
        self._forecast = job.run()

    def latest(self) -> Optional[Forecast]:
        return self._forecast


class BackgroundFitter:
    """Fits on a daemon thread, one at a time: a ``refit`` while a fit runs is
    dropped (the next due refit brings newer history anyway), and ``latest``
    returns the previous forecast until the new one is ready."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._forecast: Optional[Forecast] = None
        self._running: Optional[threading.Thread] = None

    @property
    def busy(self) -> bool:
        with self._lock:
            return self._running is not None

    def refit(self, job: FitJob) -> None:
        with self._lock:
            if self._running is not None:
                return
            self._running = threading.Thread(target=self._fit, args=(job,), name="octavo-forecast", daemon=True)
            self._running.start()

    def _fit(self, job: FitJob) -> None:
        try:
            forecast = job.run()
        except Exception:  # noqa: BLE001 - a failed fit keeps the last forecast; the next refit retries
            logger.exception("forecaster fit failed")
            forecast = self.latest()
        with self._lock:
            self._forecast = forecast
            self._running = None

    def latest(self) -> Optional[Forecast]:
        with self._lock:
            return self._forecast

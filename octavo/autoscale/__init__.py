"""Autoscaling: a clock-free policy (``policy.py``), where its metrics come
from (``signals.py``) and what carries out its decisions (``actuators/``).
See docs/AUTOSCALING.md."""

"""The actuator seam: how many replicas there are, and making it N."""
from __future__ import annotations

from abc import ABC, abstractmethod


class Actuator(ABC):
    @abstractmethod
    def replicas(self) -> int:
        """The replica count the fleet is heading for: ready ones plus those
        starting, less those draining (HPA's ``spec.replicas``). The policy
        compares its decision with this, so a replica still starting is not
        started twice."""

    @abstractmethod
    def scale(self, replicas: int) -> None:
        """Head for ``replicas``; returns without waiting for replicas to be
        ready or gone (the next decisions see the fleet as it comes)."""

    def replica_urls(self) -> list[str]:
        """Base URLs of the ready replicas, for scraping their /metrics
        (empty when the actuator cannot know them, e.g. pods behind a Service)."""
        return []

    def close(self) -> None:
        """Release what the actuator holds (clients; local: stop its replicas)."""

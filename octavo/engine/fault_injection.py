"""A test-only hook: make the engine's steps slow or hung on demand.

Off unless the environment names a file in ``OCTAVO_FAULT_STEP_DELAY_FILE``
(tests set it for the server they start; the engine process inherits it).
While that file exists, every step sleeps for the seconds it holds, after
the scheduler chose the step and before the forward, as a stuck kernel would.
Deleting the file makes the next steps normal again."""
from __future__ import annotations

import os
import time
from typing import Optional

ENV = "OCTAVO_FAULT_STEP_DELAY_FILE"


class StepDelay:
    def __init__(self, path: str) -> None:
        self.path = path

    @classmethod
    def from_env(cls) -> Optional[StepDelay]:
        path = os.environ.get(ENV)
        return cls(path) if path else None

    def sleep(self) -> None:
        try:
            with open(self.path) as f:
                seconds = float(f.read().strip() or 0)
        except (OSError, ValueError):  # no file (or one being written): no delay
            return
        time.sleep(seconds)

"""One logging setup for every process of a run: the CLI's, the engine
process's (spawned: a fresh interpreter without handlers, whose INFO lines
such as the KV cache sizing would otherwise be dropped) and the ranks'."""
from __future__ import annotations

import logging
import os

LOG_FORMAT = "%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s"
# Child processes started as plain subprocesses (the ranks) read their level here.
LOG_LEVEL_ENV = "OCTAVO_LOG_LEVEL"
QUIET_LIBRARIES = ("httpx", "httpcore")


def configure_logging(level: int | str) -> None:
    """Root handler on stderr at ``level`` (a name such as "info" or a number)."""
    if isinstance(level, str):
        level = logging.getLevelName(level.upper())
    logging.basicConfig(level=level, format=LOG_FORMAT)
    logging.getLogger().setLevel(level)
    # A line per HTTP request made (the gateway's upstream calls, the autoscaler's probes, run-batch's
    # in-process requests) drowns what Octavo itself says; their failures still show at WARNING.
    for name in QUIET_LIBRARIES:
        logging.getLogger(name).setLevel(max(level, logging.WARNING))


def current_level() -> int:
    """The level this process logs at, for the processes it starts."""
    return logging.getLogger().getEffectiveLevel()


def configure_from_env() -> None:
    level = os.environ.get(LOG_LEVEL_ENV)
    if level:
        configure_logging(int(level) if level.isdigit() else level)

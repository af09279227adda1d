"""Executor backends by name. Each is imported only when chosen: ``ray`` is
an optional extra, and ``mp`` pulls in ZMQ and torch.distributed."""
from __future__ import annotations

import importlib

from octavo.config import EngineConfig
from octavo.executor.base import Executor
from octavo.extras import require

_BACKENDS = {
    "uni": ("octavo.executor.uniproc", "UniProcExecutor"),
    "mp": ("octavo.executor.multiproc", "MultiprocExecutor"),
    "ray": ("octavo.executor.ray_executor", "RayExecutor"),
}


def create_executor(config: EngineConfig) -> Executor:
    """The executor ``config.parallel`` asks for, started."""
    backend = config.parallel.executor_backend
    module_name, class_name = _BACKENDS[backend]
    if backend == "ray":
        require("ray", "ray", "distributed_executor_backend 'ray'")
    return getattr(importlib.import_module(module_name), class_name)(config)

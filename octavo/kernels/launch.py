"""The one door into the native CPU kernels: every ctypes call into a kernel
library goes through ``launch``, so that a decode step can be recorded as the
list of calls it makes and replayed without the Python that made them
(octavo/worker/kernel_tape.py, the CPU's counterpart of a CUDA graph).

Outside a recording ``launch`` is the call itself, plus one global read."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional, Protocol


class KernelRecorder(Protocol):
    def kernel(self, fn: Callable[..., Any], args: tuple[Any, ...], result: Any) -> None:
        """``fn(*args)`` just ran and returned ``result``."""


_recorder: Optional[KernelRecorder] = None


def launch(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``: a ctypes kernel function and its (already converted) arguments."""
    result = fn(*args)
    if _recorder is not None:
        _recorder.kernel(fn, args, result)
    return result


@contextmanager
def recording(recorder: KernelRecorder) -> Iterator[None]:
    """Kernel calls made inside the block are also passed to ``recorder``."""
    global _recorder
    if _recorder is not None:
        raise RuntimeError("a kernel recording is already in progress")
    _recorder = recorder
    try:
        yield
    finally:
        _recorder = None

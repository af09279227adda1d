"""A CPU decode step recorded once and replayed as a list of kernel calls:
the CPU's counterpart of a CUDA graph.

On a CPU a decode step of a small model at small batch is ~110 native kernel
calls (products, norms, rotary, attention) driven by Python that costs a
quarter of the step: module calls, argument checks, ctypes conversions,
allocations (measured on llama-100m at batch 1: 8.9 ms a step, 6.5 ms of it in
the kernels). Replaying the recorded calls with the same pointers skips all of
it. As with a CUDA graph, every input lives in a static buffer (DecodeGraphs
owns them), Python control flow is frozen at recording, and every tensor the
step allocated is kept so that its address stays valid.

What a recording sees, and how each is replayed:

- a call through ``octavo.kernels.launch.launch``: the same ctypes function
  with the same converted arguments; a status other than the recorded one
  fails the step;
- a torch op that computes (embedding lookup, rotary tables, the last
  residual add, a oneDNN product): run again on the same input tensors, its
  result copied into the tensor the recording produced (in-place and ``out=``
  ops just run again);
- views and allocations: nothing (their addresses are the recording's);
- an op whose result Python reads (``.item()``), whose output shape depends on
  data, or that draws random numbers, and a tensor made from Python values
  (``torch.tensor``, which may hold this step's data): the recording is
  refused, and the step stays eager.
"""
from __future__ import annotations

import ctypes
import importlib
import threading
from typing import Any, Callable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from octavo.kernels.launch import recording
from octavo.worker.decode_graphs import Recording, ReplayFailed, StepRefused

# Decode batches recorded on CPU: past ~64 rows a step's kernels take long enough that the Python around
# them is a few percent of it (and products leave the native kernels for oneDNN's).
TAPE_MAX_BATCH = 64
# What all tapes together may hold (each keeps every tensor its step made): llama-100m's sizes 1-64 take ~80 MiB.
TAPE_MEMORY_BUDGET = 256 * 2**20

_ALLOCATIONS = {torch.ops.aten.empty, torch.ops.aten.empty_like, torch.ops.aten.new_empty,
                torch.ops.aten.empty_strided, torch.ops.aten.new_empty_strided}
_REFUSED_TAGS = {torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape, torch.Tag.nondeterministic_seeded}


class KernelReplayError(ReplayFailed):
    """A replayed kernel call failed (its status differs from the recording's)."""


# One entry: a callable, its arguments, and the result a correct run returns.
_Entry = tuple[Callable[..., Any], tuple[Any, ...], Any]


class KernelTape:
    """The calls of one recorded step, in order; ``replay()`` runs them again."""

    def __init__(self, entries: list[_Entry], keep: list[torch.Tensor], made: list[torch.Tensor]) -> None:
        self._entries = entries
        self._keep = keep  # every tensor the recording saw: the entries hold their addresses
        self._made = made  # ... of which the ones it allocated
        self.num_kernel_calls = sum(isinstance(fn, ctypes._CFuncPtr) for fn, _, _ in entries)
        self.num_torch_ops = len(entries) - self.num_kernel_calls

    @property
    def nbytes(self) -> int:
        """Memory the tensors the recorded step allocated hold (distinct storages)."""
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in self._made
                    if t.layout == torch.strided}
        return sum(storages.values())

    def replay(self) -> None:
        for fn, args, expected in self._entries:
            status = fn(*args)
            if status != expected:
                raise KernelReplayError(f"{getattr(fn, '__name__', fn)} returned {status}, recorded {expected}")


def record_tape(run: Callable[[], torch.Tensor]) -> tuple[KernelTape, torch.Tensor]:
    """Run ``run`` once, recording it: (the tape, ``run``'s output, which every
    replay rewrites in place). StepRefused when it cannot be replayed."""
    recorder = _Recorder()
    with recording(recorder), recorder:
        out = run()
    recorder.keep.append(out)
    return KernelTape(recorder.entries, recorder.keep, recorder.made), out


def import_recorder_dependencies() -> None:
    """Start importing torch._dynamo on a thread. Entering the first TorchDispatchMode imports it
    (1.8 s on a 2-core machine), which made the first request after every start wait that long;
    begun while the checkpoint loads, it is done by the first decode step."""
    threading.Thread(target=importlib.import_module, args=("torch._dynamo",), name="import torch._dynamo",
                     daemon=True).start()


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.entries: list[_Entry] = []
        self.keep: list[torch.Tensor] = []
        self.made: list[torch.Tensor] = []

    def kernel(self, fn: Callable[..., Any], args: tuple[Any, ...], result: Any) -> None:
        # Converted to their ctypes types once here rather than on every replay (ctypes
        # passes an instance of the declared type as it is).
        types = getattr(fn, "argtypes", None) or ()
        if len(types) == len(args):
            args = tuple(arg if isinstance(arg, kind) else kind(arg) for kind, arg in zip(types, args))
        self.entries.append((fn, args, result))

    def __torch_dispatch__(self, func: torch._ops.OpOverload, types: Any, args: tuple[Any, ...] = (),
                           kwargs: Optional[dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        if _REFUSED_TAGS.intersection(func.tags):
            raise StepRefused(f"the step runs {func}, which a replay cannot repeat")
        if func is torch.ops.aten.lift_fresh.default:
            # torch.tensor(...) of Python values, which may be this step's data: a replay would reuse them.
            raise StepRefused("the step makes a tensor from Python values (torch.tensor), which a replay would reuse")
        out = func(*args, **kwargs)
        produced = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        # Inputs are kept too: a temporary made outside this mode (a Python
        # float wrapped as a tensor) must outlive the recording.
        self.keep.extend(produced + inputs)
        if func.overloadpacket in _ALLOCATIONS:
            self.made.extend(produced)
            return out
        if func._schema.is_mutable:
            self.entries.append((_call_kwargs, (func, args, kwargs), None))
            return out
        # Whether an output is a view is decided by what it shares, not by the
        # schema: ``to`` and ``contiguous`` may alias their input or copy it.
        shared = {_storage(t) for t in inputs}
        fresh = [i for i, t in enumerate(produced) if _storage(t) not in shared]
        if fresh:
            self.made.extend(produced[i] for i in fresh)
            if isinstance(out, torch.Tensor):  # most ops: a lighter entry, without flattening the result
                self.entries.append((_recompute_one, (func._op, args, kwargs, out), None))
            else:
                self.entries.append((_recompute_into, (func, args, kwargs, fresh, produced), None))
        return out


def _storage(t: torch.Tensor) -> int:
    """An id of the memory ``t`` views (opaque oneDNN tensors have no storage: their own id)."""
    return t.untyped_storage().data_ptr() if t.layout == torch.strided else id(t)


def _call_kwargs(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    func(*args, **kwargs)


def _recompute_one(op: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], output: torch.Tensor
                   ) -> None:
    output.copy_(op(*args, **kwargs))


def _recompute_into(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], fresh: list[int],
                    outputs: list[torch.Tensor]) -> None:
    results = [t for t in tree_flatten(func(*args, **kwargs))[0] if isinstance(t, torch.Tensor)]
    for i in fresh:
        outputs[i].copy_(results[i])


class TapeRecorder:
    """DecodeGraphs' recorder on CPU. Tapes are recorded on a size's second step (``on_use``): the recorded
    run is that real step, so the first one, eager, has already built kernels, measured linear tables and
    made first-use allocations, none of which belongs in a tape."""

    name = "kernel tapes"
    on_use = True

    def record(self, run: Callable[[], torch.Tensor]) -> Recording:
        tape, output = record_tape(run)
        return Recording(tape.replay, output, tape.nbytes)

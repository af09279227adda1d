"""Octavo: an LLM inference and serving engine."""
from octavo.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputParams
from octavo.outputs import CompletionOutput, OutputAccumulator, RequestOutput
from octavo.pooling import PoolingParams

__version__ = "0.1.0"

__all__ = [
    "LLM", "SamplingParams", "StructuredOutputParams", "RequestOutputKind", "CompletionOutput", "RequestOutput",
    "OutputAccumulator", "PoolingParams", "__version__",
]


def __getattr__(name: str):
    # LLM pulls in torch and the model code; import it only when asked for.
    if name == "LLM":
        from octavo.entrypoints.llm import LLM

        return LLM
    raise AttributeError(name)

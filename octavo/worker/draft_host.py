"""The worker's side of a draft model (``spec_decode.model_host``): it loads
the model with the kernels the config picks, lays out its catch-up steps as
the target's, owns its KV cache, which the model runner sizes and allocates
with the target's pool and copies on write with it, and records its decode
steps as the target's are recorded (``recorded_decode.py``): a draft's
forward at batch 1 is mostly the Python around its kernels, and it runs k of
them per speculative step."""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from octavo.attention.base import AttentionMetadata
from octavo.attention.kv_quant import LayerKVCache
from octavo.attention.kv_spec import KVCacheSpec
from octavo.config import CacheConfig, ModelConfig
from octavo.core.step_state import ScheduledRow
from octavo.distributed.parallel_state import ParallelState, parallel_state
from octavo.model.backends import ModelBackends
from octavo.model.config import ArchConfig, load_arch_config
from octavo.checkpoint.paths import model_path
from octavo.model.dtypes import resolve_dtype
from octavo.model.layers.vocab_parallel import ParallelLMHead
from octavo.model.loader import default_dtype, load_model
from octavo.model.models.causal_lm import CausalLM
from octavo.worker.backends import model_backends
from octavo.worker.decode_graphs import DecodeGraphs
from octavo.worker.input_batch import prepare_inputs
from octavo.worker.kv_cache import allocate_kv_caches, copy_blocks
from octavo.worker.recorded_decode import can_record, record_decode_steps


class HostedDraftModel:
    """A draft model and its KV cache on the target's block ids (a ``DraftModel``): those of the first KV
    cache group's tables, which keep every block while a draft model runs. Its rows carry that one table,
    so its steps have one metadata for all its layers. ``record``: its decode steps (single tokens, and
    the few rows of a catch-up after a verification) replay recordings once its cache is allocated."""

    def __init__(self, model: CausalLM, arch: ArchConfig, backends: ModelBackends, block_size: int,
                 cache_dtype: torch.dtype, device: torch.device, record: bool) -> None:
        self.model, self.arch, self.device = model, arch, device
        self.attention = backends.attention
        self.argmax: Callable[[torch.Tensor], torch.Tensor] = backends.ops.argmax
        self.block_size = block_size
        self.kv_cache_specs = model.kv_cache_specs(block_size, cache_dtype)
        self.kv_caches: list[torch.Tensor] = []  # allocated once the pool is sized
        self.record = record
        self.graphs: Optional[DecodeGraphs] = None

    def run_rows(self, rows: list[ScheduledRow], sample: list[ScheduledRow]) -> torch.Tensor:
        inputs = prepare_inputs(rows, self.block_size, self.attention, self.device)
        # prepare_inputs reorders the rows (decodes first): find each one's last row.
        where = {id(s): first + s.num_tokens - 1 for s, first in zip(inputs.order, inputs.q_starts)}
        last = torch.tensor([where[id(s)] for s in sample], dtype=torch.int64, device=self.device)
        attn = inputs.attn[0]
        if self._recorded(attn):
            return self.graphs.run(inputs.input_ids, inputs.positions, [attn]).index_select(0, last)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, [attn] * len(self.kv_caches))
        return self.model.compute_logits(hidden.index_select(0, last))

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        if self._recorded(attn):
            return self.graphs.run(input_ids, positions, [attn])
        return self._logits(input_ids, positions, self.kv_caches, [attn] * len(self.kv_caches))

    def allocate(self, num_blocks: int, max_rows: int, longest_sequence: int) -> None:
        """The cache: as many blocks as the target's pool (one more, for the padding rows of recorded steps,
        when they are recorded); recorded steps of up to ``max_rows`` rows over sequences of up to
        ``longest_sequence`` tokens."""
        self.kv_caches = allocate_kv_caches(self.kv_cache_specs, self.attention, num_blocks, self.device,
                                            padding_blocks=int(self.record))
        if self.record:
            self.graphs = record_decode_steps(self._logits, self.kv_caches, num_blocks, self.block_size, max_rows,
                                              longest_sequence, self.attention, self.device)

    def _logits(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: Sequence[LayerKVCache],
                metas: Sequence[AttentionMetadata]) -> torch.Tensor:
        """Every row's logits: what a recorded step computes, the LM head included (its Python was a sixth of
        a batch-1 draft forward); a decode-shaped step has few rows, each of which proposes or is cheap."""
        return self.model.compute_logits(self.model(input_ids, positions, kv_caches, metas))

    def _recorded(self, attn: AttentionMetadata) -> bool:
        """Whether a step of this layout replays a recording: decode rows only, not too many of them."""
        return self.graphs is not None and not attn.prefills and attn.num_decodes <= self.graphs.max_batch


class DraftHost:
    """Loads draft models for a proposer (a ``DraftModelHost``) and keeps
    their caches in step with the target's pool."""

    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, max_model_len: int) -> None:
        self._model_config, self._cache_config, self._max_model_len = model_config, cache_config, max_model_len
        self.models: list[HostedDraftModel] = []

    def load_draft_model(self, folder: str, head_tokens: Optional[Sequence[int]] = None) -> HostedDraftModel:
        config = self._model_config
        device = torch.device(config.device)
        path = model_path(folder)
        # The kernels follow the draft's own dtypes and sliding windows.
        arch = load_arch_config(path)
        dtype = resolve_dtype(config.dtype, arch.dtype)
        cache_dtype = resolve_dtype(self._cache_config.cache_dtype, str(dtype).removeprefix("torch."))
        backends = model_backends(config, device, dtype, cache_dtype, arch.layer_windows)
        with parallel_state(ParallelState()):  # whole on this rank: no collective
            model, arch = load_model(path, config.dtype, device, self._max_model_len, backends)
            if head_tokens is not None:
                model.lm_head = _cut_head(model.lm_head, head_tokens, backends, dtype, device)
        # Whole on the driver rank, so recordable whatever the target's parallelism.
        record = can_record(model, backends.attention, device, config.enforce_eager)
        self.models.append(HostedDraftModel(model, arch, backends, self._cache_config.block_size, cache_dtype,
                                            device, record))
        return self.models[-1]

    @property
    def kv_cache_specs(self) -> list[KVCacheSpec]:
        """The draft layers' caches, which each block of the pool also costs."""
        return [spec for m in self.models for spec in m.kv_cache_specs]

    def allocate(self, num_blocks: int, max_rows: int, longest_sequence: int) -> None:
        """Each draft's cache: as many blocks as the target's pool; its recorded steps: up to ``max_rows``
        rows (a catch-up after verification has up to k + 1 per request) over up to ``longest_sequence``
        tokens (the target's)."""
        for m in self.models:
            m.allocate(num_blocks, max_rows, longest_sequence)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """The target's copy-on-write, applied to the drafts' K/V too."""
        for m in self.models:
            copy_blocks(m.kv_caches, copies)


def _cut_head(head: ParallelLMHead, tokens: Sequence[int], backends: ModelBackends, dtype: torch.dtype,
              device: torch.device) -> ParallelLMHead:
    """An LM head over ``tokens`` only (row i scores ``tokens[i]``), with the kernel the whole one has. Its rows
    are read back as the whole head's kernel holds them, by multiplying the identity (one nonzero term per
    output, so exact): a packed or quantized head keeps no plain weight to take them from."""
    with torch.no_grad(), default_dtype(dtype), torch.device(device):
        cut = ParallelLMHead(len(tokens), head.embedding_dim, backends.linear_method("lm_head"), "lm_head")
        rows = head(torch.eye(head.embedding_dim, dtype=dtype))  # [hidden, vocab]: the weight, transposed
        cut.weight.copy_(rows[:, torch.tensor(list(tokens), dtype=torch.int64)].t())
    cut.finish_loading()
    return cut

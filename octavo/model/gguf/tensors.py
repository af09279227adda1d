"""A GGUF file's tensors under Hugging Face names, in the layouts the
layers load.

Float tensors (F32, F16, BF16) are read as they are. Q8_0, Q4_0 and Q4_1
matrices of the layers ``quantized_modules`` keeps quantized are split
into their integers and block factors (``<module>.qweight``,
``<module>.scales``, Q4_1's ``<module>.mins``, see octavo/quant/formats/gguf.py): nothing is
dequantized. Every other type (K-quants, IQ types, and Q8_0/Q4_0/Q4_1 where the
layer runs in float) is dequantized by the ``gguf`` package to float32 and
converted to the model's dtype as it loads; a log line says which. A
layer's stacked expert tensors (experts.py) are read once each and handed
out one expert's slice at a time, under that expert's Hugging Face names;
deepseek2's split attn_k_b / attn_v_b pair is handed out as one kv_b_proj
(deepseek2.py).
"""
from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import torch

from octavo.checkpoint.gguf_file import GgufFile, gguf_package, open_gguf
from octavo.model.checkpoint_tensors import TensorSource
from octavo.model.gguf.config import FLOAT_TYPES, KERNEL_TYPES, quantized_modules
from octavo.model.gguf.deepseek2 import joined_kv_b, split_kv_b
from octavo.model.gguf.experts import expert_template
from octavo.model.gguf.names import hf_name, rotary_heads, unpermute_rows
from octavo.quant.formats.gguf import GGUF_BLOCK, WITH_MINS, GgufBlockFormat

logger = logging.getLogger(__name__)

_UNMAPPED = "gguf:"  # prefix of a tensor with no Hugging Face name: the loader names it as unexpected


class GgufSource(TensorSource):
    def __init__(self, path: Path) -> None:
        self.file: GgufFile = open_gguf(path)
        self.where = Path(path)
        self._quantized = quantized_modules(self.file)
        arch = self.file.architecture
        heads = int(self.file.arch_key("attention.head_count"))
        self._heads = (arch, heads, int(self.file.arch_key("attention.head_count_kv", heads)))
        # Hugging Face name(s) -> the GGUF record they come from (a pair for deepseek2's split kv_b_proj),
        # the part of a split block type ("": the float tensor) and the expert of a stacked tensor (None:
        # the whole tensor). One record's names are consecutive.
        self._records: dict[str, tuple[object, str, Optional[int]]] = {}
        by_name = {record.name: record for record in self.file.tensors}
        # attn_k_b's name -> (kv_b_proj's name, its attn_v_b record)
        halves = {record.name: (pair[0], by_name[pair[1]]) for record in self.file.tensors
                  if (pair := split_kv_b(record.name)) is not None and pair[1] in by_name}
        partners = {v_b.name for _, v_b in halves.values()}
        for record in self.file.tensors:
            template = expert_template(record.name, arch)
            if template is not None:
                for expert in range(int(record.shape[-1])):
                    self._add(template.format(expert), record, expert)
                continue
            if record.name in halves:
                name, v_b = halves[record.name]
                self._records[name] = ((record, v_b), "", None)
                continue
            if record.name in partners:
                continue  # read with its attn_k_b
            name = hf_name(record.name)
            if name is None:
                self._records[_UNMAPPED + record.name] = (record, "", None)
            else:
                self._add(name, record, None)

    def _add(self, name: str, record: object, expert: Optional[int]) -> None:
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module in self._quantized:
            for part in ("qweight", *GgufBlockFormat(self._quantized[module]).group_tensors()):
                self._records[f"{module}.{part}"] = (record, part, expert)
        else:
            self._records[name] = (record, "", expert)

    def names(self) -> set[str]:
        return set(self._records)

    def stored_bytes(self) -> int:
        return sum(record.data.nbytes for record in self.file.tensors)

    def tensors(self, wanted: set[str], device: str | torch.device) -> Iterator[tuple[str, torch.Tensor]]:
        dequantized: Counter[str] = Counter()
        # The record being handed out, read once: its float tensor ("") or its split blocks
        # (qweight, scales, mins). Records' names are consecutive, so one is held at a time.
        current: tuple[object, dict[str, torch.Tensor]] = (None, {})
        for name, (record, part, expert) in self._records.items():
            if name not in wanted:
                continue
            if current[0] is not record:
                if not part:
                    dequantized.update(r.tensor_type.name for r in _parts(record)
                                       if r.tensor_type.name not in FLOAT_TYPES)
                current = (record, _split_blocks(record) if part else {"": self._whole(record)})
            tensor = current[1][part] if expert is None else current[1][part][expert]
            heads = self._rotary_heads(name)
            if heads is not None:
                tensor = unpermute_rows(tensor, heads)
            yield name, tensor.to(device)
        if dequantized:
            logger.info("%s: dequantized while loading (no kernel runs these as stored): %s",
                        self.where.name, ", ".join(f"{n} tensors of {k}" for k, n in sorted(dequantized.items())))

    def _rotary_heads(self, name: str) -> Optional[int]:
        arch, heads, kv_heads = self._heads
        return rotary_heads(arch, name, heads, kv_heads)

    def _whole(self, record: object) -> torch.Tensor:
        """A float tensor: one record's, or kv_b_proj's from its two halves."""
        if isinstance(record, tuple):
            return joined_kv_b(*(self._float(half) for half in record))
        return self._float(record)

    def _float(self, record: object) -> torch.Tensor:
        kind = record.tensor_type.name
        shape = tuple(reversed(record.shape))
        data = np.asarray(record.data)
        if kind == "F32" or kind == "F16":
            return torch.from_numpy(data.copy()).reshape(shape)
        if kind == "BF16":
            return torch.from_numpy(data.copy().view(np.int16)).view(torch.bfloat16).reshape(shape)
        gguf = gguf_package()
        try:
            values = gguf.quants.dequantize(data, record.tensor_type)
        except NotImplementedError:
            raise ValueError(f"{self.where}: tensor {record.name} has type {kind}, which the gguf package "
                             "cannot dequantize") from None
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(shape)


def _parts(record: object) -> tuple[object, ...]:
    """The GGUF records a Hugging Face tensor is read from (two for a split kv_b_proj)."""
    return record if isinstance(record, tuple) else (record,)


def _split_blocks(record: object) -> dict[str, torch.Tensor]:
    """``qweight`` [..., N, K], ``scales`` [..., N, K / 32] float32 (and Q4_1's
    ``mins``, alike) of a Q8_0, Q4_0 or Q4_1 matrix (or stack of matrices:
    experts): int8 values for Q8_0, uint8 0..15 for the others (see
    octavo/quant/formats/gguf.py)."""
    kind = KERNEL_TYPES[record.tensor_type.name]
    rows, k = tuple(int(d) for d in reversed(record.shape[1:])), int(record.shape[0])
    n = int(np.prod(rows))
    raw = np.asarray(record.data).reshape(n, k // GGUF_BLOCK, -1)
    halves = 2 if kind in WITH_MINS else 1  # float16 d, then m for Q4_1
    factors = torch.from_numpy(raw[:, :, :2 * halves].copy().view(np.float16)).float()
    split = {"scales": factors[:, :, 0].reshape(*rows, -1).contiguous()}
    if halves == 2:
        split["mins"] = factors[:, :, 1].reshape(*rows, -1).contiguous()
    payload = torch.from_numpy(raw[:, :, 2 * halves:].copy())
    if kind == "q8_0":
        split["qweight"] = payload.view(torch.int8).reshape(*rows, k)
    else:  # byte j of a block holds input j (low nibble) and input j + 16 (high nibble)
        split["qweight"] = torch.cat([payload & 0x0F, payload >> 4], dim=-1).reshape(*rows, k)
    return split

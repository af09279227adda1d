"""Load a checkpoint into its family's model class (octavo/model/registry.py): a Hugging Face folder
(safetensors or pytorch_model.bin) or a GGUF file."""
from __future__ import annotations

import logging
from collections import Counter
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Iterator, Optional, Union

import torch

from octavo.checkpoint.gguf_file import is_gguf
from octavo.checkpoint.paths import model_path
from octavo.kernels import huge_pages
from octavo.model.backends import ModelBackends
from octavo.model.checkpoint_tensors import TensorSource, folder_source
from octavo.model.config import ArchConfig, load_arch_config
from octavo.model.dtypes import resolve_dtype
from octavo.model.gguf.tensors import GgufSource
from octavo.model.layers.linear import load_shard
from octavo.model.models.causal_lm import CausalLM
from octavo.model.registry import model_class_for
from octavo.quant.base import LinearWeightHolder
from octavo.quant.prequantized import CheckpointScheme
from octavo.quant.qweights import quantized_activations

logger = logging.getLogger(__name__)

# Checkpoints may carry tensors that are recomputed rather than loaded, and
# static K/V cache scales, which the worker reads for a quantized cache
# (octavo/model/kv_scales.py).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "self_attn.k_scale", "self_attn.v_scale")


def checkpoint_source(path: Path) -> TensorSource:
    """The tensors of the checkpoint at ``path`` (see ``model_path``)."""
    return GgufSource(path) if is_gguf(path) else folder_source(path)


ShardId = Union[int, str, None]
# The shard id of a checkpoint tensor that holds all of a fused module's
# parts (Phi-3's qkv_proj, gate_up_proj): split into them on load.
_ALL_PARTS = "all parts"


def _checkpoint_name_map(net: CausalLM, fused_stored: bool, stored: set[str]) -> dict[str, tuple[str, ShardId]]:
    """Checkpoint tensor name -> (parameter name, shard id) for every tensor
    the model needs: a fused module's parameter is expected once per part
    (``q_proj`` ... for ``qkv_proj``), as ``packed_modules_mapping`` says,
    or, where the checkpoint stores it fused (``fused_stored``), once whole. A module with a
    ``checkpoint_tensors(leaf, stored, prefix)`` method (the experts of a mixture) names its own,
    choosing by what the checkpoint holds (``stored``)."""
    parts: dict[str, list[tuple[str, Union[int, str]]]] = {}
    for part, (fused, shard_id) in net.packed_modules_mapping.items():
        parts.setdefault(fused, []).append((part, shard_id))
    names: dict[str, tuple[str, ShardId]] = {}
    # named_parameters lists a tied lm_head's weight once, as the embedding's.
    for param_name in dict(net.named_parameters()):
        module_path, _, leaf = param_name.rpartition(".")
        parent, _, module = module_path.rpartition(".")
        owner = net.get_submodule(module_path)
        if hasattr(owner, "checkpoint_tensors"):
            for relative, shard_id in owner.checkpoint_tensors(leaf, stored, module_path).items():
                names[f"{module_path}.{relative}"] = (param_name, shard_id)
        elif module in parts and fused_stored:
            names[param_name] = (param_name, _ALL_PARTS)
        elif module in parts:
            for part, shard_id in parts[module]:
                names[f"{parent}.{part}.{leaf}"] = (param_name, shard_id)
        else:
            names[param_name] = (param_name, None)
    return names


def _other_ranks_tensors(net: CausalLM) -> set[str]:
    """Checkpoint tensors that modules of this rank leave to other ranks (an ``other_ranks_tensors()``
    method: the experts other ranks hold under expert parallelism)."""
    return {f"{path}.{name}" for path, module in net.named_modules() if hasattr(module, "other_ranks_tensors")
            for name in module.other_ranks_tensors()}


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Layers create their parameters in torch's default dtype: ``dtype`` within the block."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _default_weight_loader(param: torch.nn.Parameter, loaded: torch.Tensor) -> None:
    load_shard(param.data, loaded, None, 0, 1)


def load_model(
    model: str | Path,
    dtype: str = "auto",
    device: str | torch.device = "cpu",
    max_model_len: Optional[int] = None,
    backends: Optional[ModelBackends] = None,
    lm_head: bool = True,
) -> tuple[CausalLM, ArchConfig]:
    """Build the model for ``model``'s config (config.json, or a GGUF file's
    metadata) with ``backends`` (default: torch ops throughout) and fill it
    from its tensors (octavo/model/checkpoint_tensors.py).

    A checkpoint with a ``quantization_config`` (GPTQ, AWQ,
    compressed-tensors; a GGUF file's Q8_0/Q4_0 layers) loads its quantized layers as stored
    (octavo/quant/prequantized.py). Parameters are created empty on
    ``device`` for this rank's shard; each
    checkpoint tensor is read once and its parameter's ``weight_loader``
    copies this rank's part of it. Missing or unexpected tensors raise
    ValueError naming them before any is read; then every linear layer's
    method prepares its weights for its kernel.

    ``lm_head`` False builds an embedding model (no output layer; a
    checkpoint's ``lm_head.weight`` is then not read). A checkpoint saved
    without its head (``Qwen3Model``) names its tensors without the
    ``model.`` prefix; they load all the same.
    """
    folder = model_path(model)
    arch = load_arch_config(folder)
    torch_dtype = resolve_dtype(dtype, arch.dtype)
    source = checkpoint_source(folder)
    _check_fits_tensors(arch, source)
    backends = backends or ModelBackends()
    model_class = model_class_for(arch.architecture)
    if arch.quantization is not None:
        # The checkpoint's quantized layers load as stored; the rest as ``backends`` says.
        backends = replace(backends, quantization=CheckpointScheme(
            arch.quantization, model_class.packed_modules_mapping, backends.quantization))
    with default_dtype(torch_dtype), torch.device(device):
        net = model_class(arch, arch.max_model_len(max_model_len), backends, lm_head=lm_head)
    fused_stored = model_class.fused_checkpoint
    if fused_stored and arch.quantization is not None:
        raise ValueError(f"{arch.architecture} stores qkv_proj / gate_up_proj fused; splitting them is supported "
                         f"for unquantized checkpoints only, not quantization_config {arch.quantization.method!r}")
    # Stored names as this model names its modules (Mixtral's block_sparse_moe is its mlp).
    stored_as = {_renamed(n, model_class.checkpoint_renames): n for n in _stored_names(source, arch)}
    if not lm_head:
        stored_as.pop("lm_head.weight", None)
    stored = set(stored_as)
    wanted = _checkpoint_name_map(net, fused_stored, stored)
    elsewhere = _other_ranks_tensors(net)
    if not any(n.startswith("model.") for n in stored):
        wanted = {n.removeprefix("model."): target for n, target in wanted.items()}
        elsewhere = {n.removeprefix("model.") for n in elsewhere}
    missing = sorted(set(wanted) - set(stored))
    # Layers of other pipeline stages, and experts of other ranks, are in the checkpoint but not here.
    here = net.model.layer_range
    unexpected = sorted(n for n in set(stored) - set(wanted) - elsewhere if _layer_index(n) in (None, *here))
    if missing or unexpected:
        raise ValueError(
            f"checkpoint in {folder} does not match {arch.architecture}: "
            f"missing tensors {missing[:10]}, unexpected tensors {unexpected[:10]}"
        )
    if torch.device(device).type == "cpu":
        _place_on_huge_pages(net, {param for param, _ in wanted.values()})
    with torch.no_grad(), quantized_activations(backends.quantized_activations):
        _load_tensors(net, source, {stored_as[n]: target for n, target in wanted.items()}, device)
        kernels = _process_weights_after_loading(net, backends.quantization.describe())
    net.eval()
    logger.info("loaded %s (%d tensors, %s on %s) from %s", arch.architecture, len(stored),
                str(torch_dtype).removeprefix("torch."), device, folder)
    logger.info("linear layers: %s", _kernel_summary(kernels))
    logger.debug("linear layers by kernel: %s", kernels)
    return net, arch


def _place_on_huge_pages(net: CausalLM, filled: set[str]) -> None:
    """Give each parameter the checkpoint fills (``filled``: their names) of half a huge page or more fresh
    memory that asks for 2 MiB pages (huge_pages.zeros), before it is written; the others keep what their layers
    put in them. A decode step at small batch streams every weight once, and with 4 KiB pages the stream takes a
    TLB miss every 4 KiB (a two-level page walk in a virtual machine): the bf16 kernel read llama-100m's 49
    matrices (200 MB) in 0.6-0.8x the CPU time on 2 MiB pages (Zen 4 EPYC VM, one thread, in turns)."""
    params = dict(net.named_parameters())
    for name in filled:
        param = params[name]
        if param.numel() * param.element_size() >= huge_pages.HUGE_PAGE // 2:
            param.data = huge_pages.zeros(tuple(param.shape), param.dtype, param.device)


def _check_fits_tensors(arch: ArchConfig, source: TensorSource) -> None:
    """Refuse a config the checkpoint's tensors cannot fill, before the model is built: its layer
    count against the layers stored, and the fewest parameters its shape implies against the bytes
    stored (at one bit a parameter, below any storage format), so that what is allocated is bounded
    by the size of the files and not by the numbers a config declares."""
    layers = {_layer_index(n) for n in source.names()} - {None}
    # More layers stored than declared is no risk (DeepSeek-V3 stores its next-token predictor as one more).
    if layers and max(layers) + 1 < arch.num_layers:
        raise ValueError(f"{source.where}: num_hidden_layers is {arch.num_layers}; the checkpoint holds tensors of "
                         f"{max(layers) + 1} layers")
    stored = source.stored_bytes()
    floor = _fewest_parameters(arch)
    if floor > 8 * stored:
        raise ValueError(f"{source.where}: the config's shape (hidden_size {arch.hidden_size}, intermediate_size "
                         f"{arch.intermediate_size}, vocab_size {arch.vocab_size}, {arch.num_layers} layers of "
                         f"{arch.num_heads} heads of {arch.head_dim}) needs at least {floor} parameters; the "
                         f"checkpoint's tensors hold {stored} bytes")


def _fewest_parameters(arch: ArchConfig) -> int:
    """A lower bound of the model's parameter count: the embedding, and per layer the attention's
    output projection and two of the MLP's matrices (or of the experts', where fewer)."""
    attention = arch.hidden_size * arch.num_heads * arch.head_dim
    mlp = 2 * arch.hidden_size * arch.intermediate_size
    if arch.experts is not None:
        mlp = min(mlp, 2 * arch.hidden_size * arch.experts.num_experts * arch.experts.intermediate_size)
    return arch.vocab_size * arch.hidden_size + arch.num_layers * (attention + mlp)


def _kernel_summary(kernels: dict[str, int], shown: int = 2, width: int = 60) -> str:
    """The most used kernels, one short phrase each: the whole table (a dozen kinds on some CPUs) is at DEBUG."""
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1])
    parts = [f"{n} on {name if len(name) <= width else name[:width - 3] + '...'}" for name, n in ranked[:shown]]
    if len(ranked) > shown:
        parts.append(f"{sum(n for _, n in ranked[shown:])} on {len(ranked) - shown} other kernels (--log-level debug)")
    return "; ".join(parts)


def _renamed(name: str, renames: dict[str, str]) -> str:
    for old, new in renames.items():
        name = name.replace(old, new)
    return name


def _layer_index(name: str) -> Optional[int]:
    """N for a tensor of ``model.layers.N`` (or ``layers.N``: a headless checkpoint), else None."""
    name = name.removeprefix("model.")
    prefix = "layers."
    if not name.startswith(prefix):
        return None
    index = name[len(prefix):].split(".", 1)[0]
    return int(index) if index.isdigit() else None


def _stored_names(source: TensorSource, arch: ArchConfig) -> set[str]:
    """The checkpoint's tensor names, less those recomputed or tied."""
    return {n for n in source.names() if not n.endswith(_IGNORED_SUFFIXES)
            and not (arch.tie_word_embeddings and n == "lm_head.weight")}


def _load_tensors(
    net: torch.nn.Module, source: TensorSource, wanted: dict[str, tuple[str, ShardId]], device: str | torch.device
) -> None:
    """Read each wanted tensor once and hand it to its parameter's loader."""
    params = dict(net.named_parameters())
    for name, tensor in source.tensors(set(wanted), device):
        param_name, shard_id = wanted[name]
        param = params[param_name]
        loader = getattr(param, "weight_loader", _default_weight_loader)
        try:
            if shard_id == _ALL_PARTS:
                module = net.get_submodule(param_name.rpartition(".")[0])
                _load_fused(param, tensor, module.checkpoint_parts())
            elif shard_id is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard_id)
        except ValueError as exc:
            raise ValueError(
                f"checkpoint in {source.where} has a tensor that does not fit: {name}: {exc}"
            ) from exc


def _load_fused(param: torch.nn.Parameter, tensor: torch.Tensor, parts: list[tuple[Union[int, str], int]]) -> None:
    """A fused checkpoint tensor cut into its parts along the outputs, each
    handed to the parameter's loader as if stored apart (so tensor
    parallelism shards each part as usual)."""
    sizes = [size for _, size in parts]
    if tensor.shape[0] != sum(sizes):
        raise ValueError(f"{tuple(tensor.shape[:1])} outputs, expected {sum(sizes)} (parts {sizes})")
    for (shard_id, _), piece in zip(parts, tensor.split(sizes, dim=0)):
        param.weight_loader(param, piece, shard_id)


def _process_weights_after_loading(net: torch.nn.Module, scheme: str) -> dict[str, int]:
    """Let every linear layer's method prepare its weights (and log the bytes
    before and after: quantization's saving); the count of layers per kernel."""
    kernels: Counter[str] = Counter()
    before = after = 0
    for module in net.modules():
        if isinstance(module, LinearWeightHolder):
            method = module.weight_method
            before += sum(p.numel() * p.element_size() for n, p in module.named_parameters(recurse=False)
                          if n != "bias")
            module.finish_loading()
            after += method.weight_bytes(module)
            kernels[method.kernel_name(module)] += 1
    logger.info("linear weights (%s): %.1f MiB as loaded, %.1f MiB as the kernels hold them (%.2fx)",
                scheme, before / 2**20, after / 2**20, before / max(after, 1))
    return dict(kernels)

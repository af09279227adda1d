"""The KV cache's buffers and a loaded model's weights on 2 MiB pages where Linux gives them."""
from __future__ import annotations

import ctypes
import mmap
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from octavo.attention.kv_quant import allocate_layer_cache
from octavo.kernels import huge_pages
from octavo.model.loader import load_model
from tests.model_factory import make_tiny_model

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_eligible(address: int) -> bool:
    """Whether the kernel marks the mapping holding ``address`` as eligible for huge pages."""
    mapping = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(x, 16) for x in head.split("-"))
            mapping = start <= address < end
        elif mapping and line.startswith("THPeligible:"):
            return line.split()[1] == "1"
    raise AssertionError(f"no mapping holds {address:#x}")


def test_zeros_is_torch_zeros():
    t = huge_pages.zeros((3, 5, 7), torch.bfloat16, torch.device("cpu"))
    assert t.dtype == torch.bfloat16 and t.shape == (3, 5, 7) and torch.equal(t, torch.zeros(3, 5, 7))


def test_a_buffer_without_a_whole_huge_page_is_left_alone():
    assert not huge_pages.advise_huge_pages(torch.empty(1000))


@pytest.mark.skipif(not sys.platform.startswith("linux") or not THP.exists() or "[never]" in THP.read_text(),
                    reason="needs Linux with transparent huge pages")
def test_the_kv_cache_is_eligible_for_huge_pages():
    cache = allocate_layer_cache(1024, 16, 4, 64, torch.bfloat16, torch.device("cpu"))  # 16 MiB
    assert torch.count_nonzero(cache.data) == 0
    middle = cache.data.data_ptr() + cache.data.numel() * cache.data.element_size() // 2
    assert _thp_eligible(middle)
    if "[madvise]" in THP.read_text():  # only what asked is eligible (with [always] everything is)
        # A fresh mapping of its own: a torch allocation may reuse memory an earlier test advised.
        plain = mmap.mmap(-1, 4 << 20)
        view = ctypes.c_char.from_buffer(plain)
        try:
            assert not _thp_eligible(ctypes.addressof(view) + (1 << 20))
        finally:
            del view
            plain.close()


def test_a_buffer_under_a_huge_page_gets_a_whole_one():
    t = huge_pages.zeros((3 << 18,), torch.bfloat16, torch.device("cpu"))  # 1.5 MiB
    assert t.data_ptr() % huge_pages.HUGE_PAGE == 0 and torch.count_nonzero(t) == 0


@pytest.mark.skipif(not sys.platform.startswith("linux") or not THP.exists() or "[never]" in THP.read_text(),
                    reason="needs Linux with transparent huge pages")
def test_the_weights_a_checkpoint_fills_are_on_huge_pages_and_hold_its_values(tmp_path):
    folder = make_tiny_model(tmp_path, "llama", dtype="bfloat16", hidden_size=512, intermediate_size=1024,
                             num_attention_heads=8, num_key_value_heads=4, head_dim=64, vocab_size=1536,
                             num_hidden_layers=1, tie_word_embeddings=True)
    model, _ = load_model(folder)
    embedding = model.model.embed_tokens.weight  # 1.5 MiB, the tied LM head's too
    assert model.lm_head.weight is embedding
    assert torch.equal(embedding, load_file(folder / "model.safetensors")["model.embed_tokens.weight"])
    large = [p for p in model.parameters() if p.numel() * p.element_size() >= huge_pages.HUGE_PAGE // 2]
    assert len(large) == 4  # the embedding, qkv_proj, gate_up_proj, down_proj
    for param in large:
        assert param.data_ptr() % huge_pages.HUGE_PAGE == 0 and _thp_eligible(param.data_ptr())


def test_a_large_buffer_is_mapped_not_written_and_returned_when_freed():
    def resident_kib() -> int:
        return int(next(line for line in Path("/proc/self/status").read_text().splitlines()
                        if line.startswith("VmRSS:")).split()[1])

    if not sys.platform.startswith("linux"):
        pytest.skip("needs Linux (/proc/self/status)")
    before = resident_kib()
    t = huge_pages.zeros((256, 1024, 1024), torch.float32, torch.device("cpu"))  # 1 GiB
    assert resident_kib() - before < 64 * 1024  # not touched yet: nothing resident
    t[-1, -1, -1] = 5.0
    assert t[-1, -1, -1].item() == 5.0 and t[0, 0, 0].item() == 0.0
    address = t.data_ptr()
    del t
    maps = Path("/proc/self/maps").read_text().splitlines()
    assert not any(int(m.split()[0].split("-")[0], 16) <= address < int(m.split()[0].split("-")[1], 16)
                   for m in maps)

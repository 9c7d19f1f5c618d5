"""Layers on several devices: each layer's K/V lives where the layer runs, sizing and stats are per device.

This machine has only a CPU, so placement is checked with the ``meta`` device standing in for a second device
(storage is created there, nothing is computed), and end to end with accelerate's disk offload, whose offloaded
layer keeps its weights on ``meta`` and runs on the CPU. tests/gpu/ repeats the end-to-end check on two GPUs.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

import astrai_hf
from astrai_hf import PagePool
from astrai_hf import pool as pool_module
from tiny_models import left_padded_batch, paged_and_reference, tiny_model

# 16 tokens x K,V x 2 KV heads x head_dim 16 x fp32, for one layer
LAYER_PAGE_BYTES = 16 * 2 * 2 * 16 * 4


def test_explicit_layer_devices_place_storage_and_report_bytes_per_device():
    config = tiny_model("qwen2").config  # 3 layers
    pool = PagePool(config, max_tokens=160, page_size=16, device=["cpu", "meta", "cpu"])
    assert [k.device.type for k in pool.storage.k] == ["cpu", "meta", "cpu"]
    assert [v.device.type for v in pool.storage.v] == ["cpu", "meta", "cpu"]
    s = pool.stats()
    assert s["kv_bytes_by_device"] == {"cpu": 10 * 2 * LAYER_PAGE_BYTES, "meta": 10 * LAYER_PAGE_BYTES}
    assert sum(s["kv_bytes_by_device"].values()) == s["kv_bytes_total"]


def test_from_model_follows_each_layer_to_its_device():
    model = tiny_model("llama")
    model.model.layers[1].to("meta")  # an explicit layer-to-device map: layer 0 on cpu, layer 1 on meta
    pool = PagePool.from_model(model, max_tokens=64, page_size=16)
    assert pool.config.layer_devices == (torch.device("cpu"), torch.device("meta"))
    assert pool.storage.k[0].device.type == "cpu" and pool.storage.k[1].device.type == "meta"
    assert pool.stats()["kv_bytes_by_device"] == {"cpu": 4 * LAYER_PAGE_BYTES, "meta": 4 * LAYER_PAGE_BYTES}
    astrai_hf.patch(model, pool=pool)  # the pool fits the model layer by layer
    astrai_hf.unpatch(model)
    cpu_pool = PagePool.from_model(model, max_tokens=64, device="cpu")
    with pytest.raises(ValueError, match="layer 1 of the model is on meta, but this PagePool keeps its K/V on cpu"):
        astrai_hf.patch(model, pool=cpu_pool)


def test_memory_fraction_applies_to_each_device(monkeypatch):
    config = tiny_model("qwen2").config  # 3 layers
    free = {"cpu": 100 * LAYER_PAGE_BYTES, "meta": 30 * LAYER_PAGE_BYTES}
    monkeypatch.setattr(pool_module, "_free_bytes", lambda device: free[device.type])
    # cpu holds 2 layers: 0.5 * 100 // 2 = 25 pages; meta holds 1: 0.5 * 30 // 1 = 15 pages; the tighter wins
    pool = PagePool(config, memory_fraction=0.5, page_size=16, device=["cpu", "meta", "cpu"])
    assert pool.stats()["num_pages"] == 15
    assert pool.stats()["kv_bytes_by_device"] == {"cpu": 15 * 2 * LAYER_PAGE_BYTES, "meta": 15 * LAYER_PAGE_BYTES}
    free["meta"] = 1000 * LAYER_PAGE_BYTES
    assert PagePool(config, memory_fraction=0.5, page_size=16, device=["cpu", "meta", "cpu"]).stats()["num_pages"] == 25


@pytest.mark.equivalence
def test_device_map_with_an_offloaded_layer_keeps_kv_where_the_layer_runs(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path / "llama")
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
                  "model.layers.1": "disk", "model.norm": "cpu", "lm_head": "cpu"}
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "llama", device_map=device_map,
                                                 offload_folder=str(tmp_path / "offload")).eval()
    assert next(model.model.layers[1].self_attn.parameters()).device.type == "meta"  # weights on disk
    pool = PagePool.from_model(model, max_tokens=256, page_size=4)
    assert pool.config.layer_devices == (torch.device("cpu"),) * 2  # accelerate's execution device, not meta
    ids, mask = left_padded_batch([4, 9, 6])
    out, ref = paged_and_reference(model, pool, ids, mask)
    assert torch.equal(out, ref)
    assert pool.stats()["num_used_pages"] == 0 and pool.stats()["num_cached_pages"] > 0
    # accelerate loads the offloaded layer afresh for every forward: that is no change of the weights, and the
    # next call is served from the prefix cache
    out, _ = paged_and_reference(model, pool, ids, mask)
    assert torch.equal(out, ref) and pool.stats()["prefix_hit_tokens"] > 0

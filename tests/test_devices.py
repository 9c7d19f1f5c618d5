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
    from types import SimpleNamespace

    model = tiny_model("llama")
    model.model.layers[1].to("meta")  # an explicit layer-to-device map: layer 0 on cpu, layer 1 on meta
    # (meta stands in for a second device; weights on meta that no accelerate hook runs elsewhere are refused)
    model.model.layers[1].self_attn._hf_hook = SimpleNamespace(execution_device="meta")
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
    # each device's budget holds the trash page too, and the first layer's device (cpu) the req_to_token tables
    # (2 rows of 16 int32 slots and ids: 256 bytes). cpu holds 2 layers: (0.5 * 100 - 2) // 2 = 24 pages, less the
    # table: 23; meta holds 1: 0.5 * 30 // 1 - 1 = 14 pages; the tighter wins
    sizes = dict(memory_fraction=0.5, page_size=16, device=["cpu", "meta", "cpu"], max_reqs=1, max_seq_len=16)
    pool = PagePool(config, **sizes)
    assert pool.stats()["num_pages"] == 14
    assert pool.stats()["kv_bytes_by_device"] == {"cpu": 14 * 2 * LAYER_PAGE_BYTES, "meta": 14 * LAYER_PAGE_BYTES}
    free["meta"] = 1000 * LAYER_PAGE_BYTES
    assert PagePool(config, **sizes).stats()["num_pages"] == 23


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


def _tiny_checkpoint(tmp_path, seed=0):
    folder = tmp_path / f"llama{seed}"
    tiny_model("llama", seed=seed).save_pretrained(folder)
    return folder


@pytest.mark.equivalence
@pytest.mark.parametrize("how", ["cpu_offload", "projections on disk"])
def test_hooks_on_the_attentions_submodules_tell_where_it_runs(how, tmp_path):
    # accelerate's cpu_offload, and a device_map naming the projections, hook the projections, not the attention
    # module: the pool had been put on meta (an autocast error patched, a device mismatch with a PagedCache)
    from accelerate import cpu_offload

    folder = _tiny_checkpoint(tmp_path)
    if how == "cpu_offload":
        model = cpu_offload(AutoModelForCausalLM.from_pretrained(folder).eval(), execution_device="cpu")
    else:
        device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
                      "model.norm": "cpu", "lm_head": "cpu", "model.layers.1.input_layernorm": "cpu",
                      "model.layers.1.post_attention_layernorm": "cpu", "model.layers.1.mlp": "cpu"}
        device_map.update({f"model.layers.1.self_attn.{p}_proj": "disk" for p in "qkvo"})
        model = AutoModelForCausalLM.from_pretrained(folder, device_map=device_map,
                                                     offload_folder=str(tmp_path / "offload")).eval()
    assert next(model.model.layers[1].self_attn.parameters()).device.type == "meta"
    ids, mask = left_padded_batch([4, 9, 6])
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False)
    ref = model.generate(ids, **kw)
    pool = PagePool.from_model(model, max_tokens=256, page_size=4)
    assert pool.config.layer_devices == (torch.device("cpu"),) * 2
    with astrai_hf.patched(model, pool=pool):
        assert torch.equal(model.generate(ids, **kw), ref)
        assert pool.stats()["num_used_pages"] == 0


def test_a_model_on_meta_with_no_hook_is_refused_naming_the_layers():
    model = tiny_model("llama").to("meta")
    with pytest.raises(ValueError, match=r"layers \[0, 1\] has its weights on the meta device"):
        PagePool.from_model(model, max_tokens=256)


@pytest.mark.equivalence
def test_the_weights_digest_reads_offloaded_layers(tmp_path):
    # offloaded tensors had counted by name, shape and dtype only: a prefix cache saved from one model loaded into
    # another of the same shapes, and served its K/V
    from astrai_hf.persist import weights_fingerprint

    offloaded = {"": "disk"}
    digests = [weights_fingerprint(AutoModelForCausalLM.from_pretrained(
        _tiny_checkpoint(tmp_path, seed), device_map=offloaded, offload_folder=str(tmp_path / f"off{seed}")))
        for seed in (0, 1, 0)]
    assert digests[0] != digests[1] and digests[0] == digests[2]


@pytest.mark.equivalence
def test_a_prefix_cache_loaded_before_patch_serves_a_dispatched_model(tmp_path):
    # accelerate puts a forward on the model instance; patch() wraps it, and the wrapped model had looked changed to
    # the pool (the instance forward compared as None), which dropped every loaded page
    folder = _tiny_checkpoint(tmp_path)
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
                  "model.layers.1": "disk", "model.norm": "cpu", "lm_head": "cpu"}

    def load():
        return AutoModelForCausalLM.from_pretrained(folder, device_map=device_map,
                                                    offload_folder=str(tmp_path / "offload")).eval()

    ids, mask = left_padded_batch([20, 13])
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False)
    model = load()
    ref = model.generate(ids, **kw)
    with astrai_hf.patched(model, max_tokens=256, page_size=4):
        model.generate(ids, **kw)
        astrai_hf.get_pool(model).save_prefix_cache(tmp_path / "prefix.safetensors")
    model = load()
    pool = PagePool.from_model(model, max_tokens=256, page_size=4)
    assert pool.load_prefix_cache(tmp_path / "prefix.safetensors") > 0
    with astrai_hf.patched(model, pool=pool):
        assert torch.equal(model.generate(ids, **kw), ref)
        assert pool.stats()["prefix_hit_tokens"] > 0
    plain = AutoModelForCausalLM.from_pretrained(folder).eval()  # the same model without a device_map
    plain_pool = PagePool.from_model(plain, max_tokens=256, page_size=4)
    assert plain_pool.load_prefix_cache(tmp_path / "prefix.safetensors") > 0
    with astrai_hf.patched(plain, pool=plain_pool):
        assert torch.equal(plain.generate(ids, **kw), ref)
        assert plain_pool.stats()["prefix_hit_tokens"] > 0


@pytest.mark.parametrize("change", ["hook removed", "hook added"])
def test_unpatch_leaves_an_accelerate_hook_changed_after_patch(change):
    # unpatch() put back the forward of patch() time: after remove_hook_from_module that forward called the deleted
    # hook (AttributeError); a hook added after patch() stopped running
    from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module

    class Count(ModelHook):
        calls = 0

        def pre_forward(self, module, *args, **kwargs):
            Count.calls += 1
            return args, kwargs

    model = tiny_model("llama")
    ids, mask = left_padded_batch([4, 9])
    kw = dict(attention_mask=mask, max_new_tokens=3, do_sample=False)
    ref = model.generate(ids, **kw)
    if change == "hook removed":
        add_hook_to_module(model, Count())
    astrai_hf.patch(model, max_tokens=256, page_size=4)
    if change == "hook removed":
        remove_hook_from_module(model, recurse=True)
    else:
        add_hook_to_module(model, Count())
    assert torch.equal(model.generate(ids, **kw), ref)
    astrai_hf.unpatch(model)
    Count.calls = 0
    assert torch.equal(model.generate(ids, **kw), ref)
    assert Count.calls == (3 if change == "hook added" else 0)
    with astrai_hf.patched(model, max_tokens=256, page_size=4):  # patched again over it
        assert torch.equal(model.generate(ids, **kw), ref)

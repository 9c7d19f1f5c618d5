"""A model split over two GPUs with ``device_map``: each layer's K/V on its own GPU, tokens as with DynamicCache.
Skipped on machines with fewer than two CUDA devices (the CPU stand-ins are in tests/test_devices.py)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from astrai_hf import PagePool
from tiny_models import left_padded_batch, paged_and_reference, tiny_model

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices"
)


def test_layers_split_over_two_gpus_keep_their_kv_on_their_gpu(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path / "llama")
    device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0,
                  "model.layers.1": 1, "model.norm": 1, "lm_head": 1}
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "llama", device_map=device_map).eval()
    pool = PagePool.from_model(model, memory_fraction=0.001, page_size=16)
    assert pool.config.layer_devices == (torch.device("cuda", 0), torch.device("cuda", 1))
    assert [k.device for k in pool.storage.k] == [torch.device("cuda", 0), torch.device("cuda", 1)]
    by_device = pool.stats()["kv_bytes_by_device"]
    assert set(by_device) == {"cuda:0", "cuda:1"} and by_device["cuda:0"] == by_device["cuda:1"]
    out, ref = paged_and_reference(model, pool, *(t.to("cuda:0") for t in left_padded_batch([4, 9, 6])))
    assert torch.equal(out, ref)


def test_a_model_on_the_second_gpu_while_the_first_is_current_decodes_there():
    """Triton launches on the current device and a graph is captured on the current device's stream: the kernels,
    the K/V store and the captured graphs of a model on cuda:1 must run on cuda:1 while cuda:0 stays current."""
    import astrai_hf

    model = tiny_model("llama").to("cuda:1")
    ids, mask = (t.to("cuda:1") for t in left_padded_batch([4, 9, 6]))
    kw = dict(attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert torch.cuda.current_device() == 0
    ref = model.generate(ids, **kw)
    first = tiny_model("llama").to("cuda:0")  # a capture on cuda:0 first: torch's default capture stream is there
    with astrai_hf.patched(first, max_tokens=1024, cuda_graphs=True):
        first.generate(ids.to("cuda:0"), attention_mask=mask.to("cuda:0"), max_new_tokens=2)
    for graphs in (False, True):
        with astrai_hf.patched(model, max_tokens=1024, cuda_graphs=graphs):
            assert torch.equal(model.generate(ids, **kw), ref)
            assert torch.cuda.current_device() == 0
            if graphs:  # captured on cuda:1 and replayed (not declined, not an empty graph replaying nothing)
                (runner,) = model._astrai_patch_state.runners.values()
                assert runner.uncapturable is None and runner.captured and runner.replays > 0

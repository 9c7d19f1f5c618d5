"""Decode steps through the Triton split-KV kernel, as on CUDA, here under ``TRITON_INTERPRET=1``: eager decode and
the decode runner run the same kernel (so ``cuda_graphs`` on or off gives the same tokens), and both equal stock
transformers token for token. On CPU the route is off by default; these tests switch it on."""

import pytest
import torch

import astrai_hf
from astrai_hf import PagePool, attention
from astrai_hf.attention import triton_kernels
from tiny_models import left_padded_batch, tiny_model

pytestmark = pytest.mark.equivalence

NEW = 5


@pytest.fixture
def store_calls(monkeypatch):
    """Tokens of each launch of the Triton K/V store (with the route switched on by ``kernel_calls``)."""
    calls = []
    store = triton_kernels.store_kv

    def counted(key, *args, **kwargs):
        calls.append(key.shape[0])
        return store(key, *args, **kwargs)

    monkeypatch.setattr(triton_kernels, "store_kv", counted)
    return calls


@pytest.fixture
def kernel_calls(monkeypatch):
    """Route decode steps and K/V stores on any device through the Triton kernels; count the decode launches."""
    calls = []
    decode = triton_kernels.decode_attention

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])
        return decode(*args, **kwargs)

    monkeypatch.setattr(attention, "triton_on", lambda device: True)
    monkeypatch.setattr(triton_kernels, "decode_attention", counted)
    return calls


def _generate(model, ids, mask, graphs, **kwargs):
    pool = PagePool.from_model(model, max_tokens=1024, page_size=4, prefix_cache=False)
    astrai_hf.patch(model, pool=pool, cuda_graphs=graphs)
    try:
        return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                              output_logits=True, return_dict_in_generate=True, **kwargs)
    finally:
        astrai_hf.unpatch(model)
        assert pool.stats()["num_used_pages"] == 0


def test_the_route_is_on_for_cuda_only_by_default():
    assert not attention.triton_on(torch.device("cpu"))
    assert attention.triton_on(torch.device("cuda", 0))  # (the module imports: triton is installed here)


# GQA (llama), MQA with a window (mistral), a window on some layers (qwen2), softcap with a window (gemma2)
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "gemma2"])
def test_eager_decode_through_the_kernel_equals_stock_and_the_runner(arch, kernel_calls, store_calls):
    model = tiny_model(arch)
    ids, mask = left_padded_batch([3, 9, 6], seed=2)
    stock = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                           output_logits=True, return_dict_in_generate=True)
    eager = _generate(model, ids, mask, graphs=False)
    layers = model.config.num_hidden_layers
    assert kernel_calls == [3] * (NEW - 1) * layers  # every decode step of every layer, at the batch's size
    # one store launch (K and V) per layer and forward: the prompt's 18 real tokens, then a token per row and step
    assert sum(store_calls) == 18 * layers + 3 * (NEW - 1) * layers and store_calls[-layers:] == [3] * layers
    kernel_calls.clear()
    store_calls.clear()
    runner = _generate(model, ids, mask, graphs=True)
    assert kernel_calls == [4] * (NEW - 1) * layers  # the runner's steps, padded to bucket 4
    assert store_calls[-(NEW - 1) * layers:] == [4] * (NEW - 1) * layers  # (the padded row writes the trash slot)
    assert torch.equal(eager.sequences, stock.sequences)
    assert torch.equal(runner.sequences, eager.sequences)
    for got, want in zip(eager.logits, stock.logits):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)  # fp32: the kernel against torch's attention
    for got, want in zip(runner.logits, eager.logits):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)  # one kernel; only the padded rows differ


def test_a_float64_model_decodes_through_the_kernel(kernel_calls):
    """The kernel writes float32, float16 and bfloat16 outputs itself; a float64 model's comes out in float32 and is
    cast back (it had raised ValueError for the output dtype)."""
    model = tiny_model("llama").double()
    ids, mask = left_padded_batch([3, 6], seed=5)
    stock = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                           output_logits=True, return_dict_in_generate=True)
    for graphs in (False, True):
        got = _generate(model, ids, mask, graphs=graphs)
        assert torch.equal(got.sequences, stock.sequences)
        for a, b in zip(got.logits, stock.logits):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)  # (the kernel accumulates in float32)
    assert len(kernel_calls) == 2 * (NEW - 1) * model.config.num_hidden_layers


def test_steps_the_kernel_does_not_take_stay_on_the_reference(kernel_calls):
    """``num_return_sequences`` stores each prompt once for its samples (group > 1 at the prefill only); beam search
    reorders rows; the kernel serves their one-token steps, and a multi-token step never reaches it."""
    model = tiny_model("llama")
    ids, mask = left_padded_batch([4, 7], seed=3)
    kw = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    want = model.generate(ids, attention_mask=mask, num_beams=3, num_return_sequences=2, **kw)
    pool = PagePool.from_model(model, max_tokens=1024, page_size=4, prefix_cache=False)
    with astrai_hf.patched(model, pool=pool, cuda_graphs=False):
        got = model.generate(ids, attention_mask=mask, num_beams=3, num_return_sequences=2, **kw)
    assert torch.equal(got, want)
    assert kernel_calls and all(b == 6 for b in kernel_calls)  # 2 prompts x 3 beams, one token each
    assert pool.stats()["num_used_pages"] == 0


def test_kernels_launch_on_the_device_of_their_tensors(monkeypatch):
    """Triton launches on the current CUDA device, whatever device the tensors are on: a model on cuda:1 while
    cuda:0 is current gets cuda:1 made current around its launches (and its graph captures); nothing changes
    where the device is already current, or off CUDA."""
    import contextlib

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert isinstance(attention.on_device(torch.device("cpu")), contextlib.nullcontext)
    assert isinstance(attention.on_device(torch.device("cuda", 0)), contextlib.nullcontext)
    switch = attention.on_device(torch.device("cuda", 1))
    assert isinstance(switch, torch.cuda.device) and switch.idx == 1

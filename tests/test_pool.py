"""PagePool construction: sizing, validation errors, statistics, model checks."""

import copy

import pytest
import torch

import astrai_hf
from astrai_hf import CacheFullError, PagedCache, PagePool
from astrai_hf.storage import TRASH_PAGE
from tiny_models import left_padded_batch, tiny_model


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def test_sizing_and_stats(llama):
    pool = PagePool.from_model(llama, max_tokens=100, page_size=16)
    s = pool.stats()
    assert s["num_pages"] == 6 and s["num_free_pages"] == 6 and s["num_used_pages"] == 0
    for key in ("num_cached_pages", "prefix_query_tokens", "prefix_hit_tokens", "kv_bytes_used"):
        assert s[key] == 0
    per_page = 16 * 2 * 2 * 2 * 16 * 4  # tokens x K,V x layers x kv heads x head_dim x fp32
    assert s["kv_bytes_total"] == 6 * per_page
    assert pool.storage.k[0].shape == (7 * 16, 2, 16)
    assert pool.req_to_token.table.dtype == torch.int32
    assert pool.max_seq_len == 96  # capped by capacity (max_position_embeddings is 256)


def test_the_slot_table_of_a_large_max_seq_len_is_no_wider_than_the_pool(llama):
    # no row can hold more tokens than the pool has slots; max_seq_len=10**6 on a 64-token pool had taken a 1 GB
    # req_to_token table (10**9: an allocation error from torch). A row past the capacity still gets CacheFullError.
    for asked in (10**6, 10**9):
        pool = PagePool.from_model(llama, max_tokens=64, page_size=16, max_seq_len=asked)
        assert pool.max_seq_len == asked and pool.req_to_token.table.shape[1] == 64
        ids, mask = left_padded_batch([30, 20])
        with astrai_hf.patched(llama, pool=pool):
            with pytest.raises(CacheFullError, match="free"):
                llama.generate(ids, attention_mask=mask, max_new_tokens=60, min_new_tokens=60)
            assert pool.stats()["num_used_pages"] == 0
            out = llama.generate(ids[1:, 10:], max_new_tokens=40, min_new_tokens=40)  # 60 tokens: fits
        assert out.shape == (1, 60)
    assert PagePool.from_model(llama, max_tokens=64, page_size=16, max_seq_len=40).req_to_token.table.shape[1] == 40


@pytest.mark.parametrize("device", ["cpu:0", torch.device("cpu", 0), ["cpu:0", "cpu"]])
def test_a_device_spelled_with_an_index_is_the_device_the_model_reports(llama, device):
    # tensors report "cpu" (and "cuda:0" where "cuda" was asked for): the pool's device had compared unequal to the
    # model's layers, and both patch() and a PagedCache refused the pool
    ids, mask = left_padded_batch([6, 4])
    kw = dict(attention_mask=mask, max_new_tokens=3, do_sample=False)
    ref = llama.generate(ids, **kw)
    devices = device if isinstance(device, list) else [device]
    pool = PagePool.from_model(llama, max_tokens=256, device=device)
    assert all(d == torch.device("cpu") for d in pool.config.layer_devices)
    assert torch.equal(llama.generate(ids, **kw, past_key_values=PagedCache(pool, ids, mask)), ref)
    with astrai_hf.patched(llama, pool=pool):
        assert torch.equal(llama.generate(ids, **kw), ref)
    with astrai_hf.patched(llama, device=devices[0], max_tokens=256):
        assert torch.equal(llama.generate(ids, **kw), ref)


def test_a_pool_too_large_to_allocate_names_its_size(llama, monkeypatch):
    import astrai_hf.pool as pool_module

    def refuse(config):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 128000002048 bytes")

    monkeypatch.setattr(pool_module, "KVStorage", refuse)
    with pytest.raises(RuntimeError, match=r"cannot allocate the pool's K/V: 62500 pages of 16 tokens "
                                           r"\(max_tokens=1000000\) take 0\.5 GiB in torch.float32 on cpu; pass a "
                                           r"smaller max_tokens.*can't allocate memory"):
        PagePool.from_model(llama, max_tokens=10**6, page_size=16)

    def missing_backend(config):
        raise NotImplementedError("Could not run 'aten::empty.memory_format' with arguments from the 'MPS' backend")

    monkeypatch.setattr(pool_module, "KVStorage", missing_backend)  # not a shortage of memory: raised as it is
    with pytest.raises(NotImplementedError, match="^Could not run"):
        PagePool.from_model(llama, max_tokens=64, page_size=16)


def test_a_req_to_token_table_too_large_to_allocate_names_max_reqs(llama, monkeypatch):
    # (it had raised the allocator's own message, naming neither the table nor max_reqs)
    import astrai_hf.pool as pool_module

    def refuse(max_reqs, max_seq_len, device):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 256000000000256 bytes")

    monkeypatch.setattr(pool_module, "ReqToTokenPool", refuse)
    with pytest.raises(RuntimeError, match=r"cannot allocate the pool's req_to_token table: max_reqs=1000000000000 "
                                           r"rows of 64 slots take 476837\.2 GiB \(two int32 tables\) on cpu; pass a "
                                           r"smaller max_reqs.*can't allocate memory"):
        PagePool.from_model(llama, max_tokens=64, page_size=16, max_reqs=10**12)


def test_a_pool_from_a_config_without_a_dtype_logs_nothing():
    # reading config.torch_dtype made transformers log "`torch_dtype` is deprecated!" (once per process: hence a
    # fresh one); astrai-hf prints nothing
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys; sys.path.insert(0, %r)\nfrom tiny_models import tiny_model\nfrom astrai_hf import PagePool\n"
            "config = tiny_model('llama').config\nconfig.dtype = None\nprint(PagePool(config, max_tokens=64).dtype)\n"
            % str(Path(__file__).parent))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "torch.float32\n" and "deprecated" not in done.stderr, done.stderr


def test_memory_fraction_sizing(llama):
    pool = PagePool.from_model(llama, memory_fraction=1e-5, page_size=16)
    assert pool.stats()["num_pages"] >= 1


@pytest.mark.parametrize("fraction", [0.5, 1.0])
@pytest.mark.parametrize("sizes", [{}, dict(max_seq_len=40, max_reqs=3), dict(max_reqs=1000)])
def test_memory_fraction_holds_every_tensor_the_pool_allocates_within_the_fraction(llama, monkeypatch, fraction,
                                                                                    sizes):
    # the budget had held the usable pages only: the trash page and the req_to_token tables came on top, so
    # memory_fraction=1.0 always asked for more than the free memory
    import astrai_hf.pool as pool_module

    free = 1_000_000
    monkeypatch.setattr(pool_module, "_free_bytes", lambda device: free)
    pool = PagePool(llama.config, memory_fraction=fraction, page_size=16, **sizes)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in pool.storage.k + pool.storage.v}
    tables = pool.req_to_token.table, pool.req_to_token.token_ids
    held = sum(storages.values()) + sum(t.numel() * t.element_size() for t in tables)
    assert held <= fraction * free
    # and not far below it: one page more would not fit
    per_page = pool.config.bytes_per_page + (pool.config.max_reqs + 1) * 8 * 16
    assert held + per_page > fraction * free or pool.req_to_token.max_seq_len < pool.stats()["num_pages"] * 16


@pytest.mark.parametrize(
    "kwargs, error, text",
    [
        (dict(page_size=0), ValueError, "page_size must be >= 1, got 0"),
        (dict(page_size=2.5), TypeError, "page_size"),
        (dict(max_tokens=8, page_size=16), ValueError, "max_tokens=8 is smaller than one page"),
        (dict(memory_fraction=0.0), ValueError, r"memory_fraction must be in \(0, 1\], got 0.0"),
        (dict(memory_fraction=1.5), ValueError, "got 1.5"),
        (dict(memory_fraction=0.5, max_tokens=64), ValueError, "not both"),
        (dict(max_reqs=0), ValueError, "max_reqs must be >= 1, got 0"),
        (dict(max_seq_len=0), ValueError, "max_seq_len must be >= 1, got 0"),
        (dict(dtype=torch.int8), TypeError, "dtype must be a floating"),
        (dict(device="nowhere"), ValueError, "'nowhere' is not a torch device"),
        (dict(process_group="x"), TypeError, "process_group must be a torch.distributed ProcessGroup or None, got str"),
        (dict(num_kv_heads=0), ValueError, "num_kv_heads must be a positive int, got 0"),
        (dict(max_reqs=True), TypeError, "max_reqs must be an int, got True"),
        (dict(max_tokens="4096"), TypeError, "max_tokens must be an int, got '4096'"),
        (dict(num_kv_heads=torch.tensor(2.0)), ValueError, r"num_kv_heads must be a positive int, got tensor\(2.\)"),
        (dict(max_tokens=10**30), ValueError, "max_tokens=1000000000000000000000000000000 makes .* int32 entries"),
        pytest.param(dict(device="cuda:7"), ValueError, "'cuda:7': this process sees [0-7] CUDA devices",
                     marks=pytest.mark.skipif(torch.cuda.device_count() > 7, reason="a machine with 8 GPUs")),
    ],
)
def test_bad_arguments_name_the_value(llama, kwargs, error, text):
    with pytest.raises(error, match=text):
        PagePool(llama.config, **{"max_tokens": kwargs.pop("max_tokens", 256) if "memory_fraction" not in kwargs
                                  else kwargs.pop("max_tokens", None), **kwargs})


def test_a_batch_of_exactly_max_reqs_rows_runs(llama):
    ids, mask = left_padded_batch([5, 7])
    want = llama.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    pool = PagePool.from_model(llama, max_tokens=512, page_size=4, max_reqs=2)
    with astrai_hf.patched(llama, pool=pool):
        assert torch.equal(llama.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False), want)
    assert pool.stats()["num_reqs_used"] == 0
    with pytest.raises(CacheFullError, match="request rows"), PagedCache(pool, *left_padded_batch([5, 7, 6])):
        pass


def test_freed_rows_and_cropped_columns_point_at_the_trash_slot(llama):
    # a padded gather (a decode graph's bucket, a kernel reading a row's table) must never read a freed slot
    pool = PagePool.from_model(llama, max_tokens=512, page_size=4, max_reqs=4)
    table = pool.req_to_token.table
    with astrai_hf.patched(llama, pool=pool):
        ids, mask = left_padded_batch([5, 9])
        llama.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert int((table != TRASH_PAGE).sum()) == 0
    ids, mask = left_padded_batch([6, 9])
    with PagedCache(pool, ids, mask, prefix_cache=False) as cache:
        llama(ids, attention_mask=mask, **{astrai_hf.cache_kwarg(llama): cache})
        cache.crop(-4)  # 5 columns kept: the first row keeps 2 of its 6 tokens, the second 5 of 9
        rows = cache._rows.req_rows
        assert [int((table[r] != TRASH_PAGE).sum()) for r in rows] == [2, 5]
    assert int((table != TRASH_PAGE).sum()) == 0


@pytest.mark.parametrize("family", ["gpt_neox", "opt"])
def test_a_head_dim_in_the_config_that_the_family_ignores_takes_the_attentions_head_size(family):
    # GPT-NeoX and OPT divide hidden_size by the heads, whatever a config's head_dim says: the pool took the
    # config's, and every call failed, advising the PagePool.from_model(model) that built that pool
    import transformers as T

    common = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, head_dim=8,
                  pad_token_id=0)
    if family == "gpt_neox":
        model = T.GPTNeoXForCausalLM(T.GPTNeoXConfig(**common, intermediate_size=128)).eval()
    else:
        model = T.OPTForCausalLM(T.OPTConfig(**common, ffn_dim=128, word_embed_proj_dim=64)).eval()
    ids, mask = left_padded_batch([3, 5])
    want = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert PagePool.from_model(model, max_tokens=64).config.spec.head_dim == 16
    with pytest.raises(ValueError, match="head_dim=8 given, but .* stores 16 as the size of a K/V head"):
        PagePool.from_model(model, max_tokens=64, head_dim=8)
    with astrai_hf.patched(model, max_tokens=256):
        assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False), want)
    with pytest.raises(ValueError, match=r"head_dim 16, but the pool stores 4 x 8; .*reads the head size from the "
                                         r"attention"):
        with PagedCache(PagePool(model.config, max_tokens=64)) as cache:
            model(ids, attention_mask=mask, **{astrai_hf.cache_kwarg(model): cache})


@pytest.mark.parametrize("config", [None, {"num_hidden_layers": 2}, "llama"])
def test_a_config_that_is_not_a_pretrained_config_is_named(config):
    # it had failed inside with "vars() argument must have __dict__ attribute"
    with pytest.raises(TypeError, match=rf"PagePool needs the model's transformers PretrainedConfig .*got "
                                        rf"{type(config).__name__}"):
        PagePool(config, max_tokens=64)


def test_from_model_refuses_num_kv_heads_the_model_does_not_have(llama):
    # the pool had been built, then refused at patch() or the first update()
    for given in (3, torch.tensor(3)):
        with pytest.raises(ValueError, match="num_kv_heads=3 given, but LlamaForCausalLM's attention stores 2 KV "
                                             "heads per layer; leave"):
            PagePool.from_model(llama, max_tokens=64, num_kv_heads=given)
    assert PagePool.from_model(llama, max_tokens=64, num_kv_heads=2).config.spec.num_kv_heads == 2


def test_prefix_cache_files_name_a_model_that_is_not_a_module(llama, tmp_path):
    pool = PagePool.from_model(llama, max_tokens=64, page_size=4)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module .* got str"):
        pool.save_prefix_cache(tmp_path / "p.safetensors", model="x")
    pool.save_prefix_cache(tmp_path / "p.safetensors")
    with pytest.raises(TypeError, match="model must be a torch.nn.Module .* got str"):
        pool.load_prefix_cache(tmp_path / "p.safetensors", model="x")


def test_pool_for_another_model_is_refused(llama):
    pool = PagePool.from_model(tiny_model("mistral"), max_tokens=64)  # 1 KV head
    with pytest.raises(ValueError, match="num_kv_heads=1.*num_kv_heads=2"):
        astrai_hf.patch(llama, pool=pool)
    with pytest.raises(ValueError, match="heads"):
        llama.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=2, past_key_values=PagedCache(pool))
    assert pool.stats()["num_used_pages"] == 0
    assert not astrai_hf.is_patched(llama)


@pytest.mark.parametrize("missing", ["num_attention_heads", "num_hidden_layers", "both"])
def test_a_config_without_layer_or_head_counts_gets_a_clear_error(missing):
    from transformers import PretrainedConfig

    counts = {"num_hidden_layers": 2, "num_attention_heads": 4}
    for name in list(counts) if missing == "both" else [missing]:
        counts.pop(name)
    config = PretrainedConfig(hidden_size=64, vocab_size=96, **counts)
    with pytest.raises(ValueError, match="cannot read num_hidden_layers / num_attention_heads from Pre[Tt]rainedConfig; a "
                                         "decoder-only language model config is expected"):
        PagePool(config, max_tokens=64)


def test_pool_of_another_head_size_is_refused_at_patch_time(llama):
    # refused by patch() itself, before a call stores anything (the cache would only see it at the first step)
    head_dim = llama.config.head_dim
    pool = PagePool(llama.config, max_tokens=64, page_size=4, head_dim=2 * head_dim)
    with pytest.raises(ValueError, match=f"built for a model with head_dim={2 * head_dim}, but LlamaForCausalLM has "
                                         f"head_dim={head_dim}"):
        astrai_hf.patch(llama, pool=pool)
    assert not astrai_hf.is_patched(llama) and pool.stats()["num_used_pages"] == 0


def test_cache_full_names_the_pages_wanted_and_the_pages_free(llama):
    # the pages the step needed, not what it lacked: "needed 2 pages, 8 free" would contradict itself
    pool = PagePool.from_model(llama, max_tokens=8 * 4, page_size=4, prefix_cache=False)  # 8 pages
    with pytest.raises(CacheFullError, match="needed 10 pages, 8 free, 0 evictable") as err:
        pool.reserve(10)
    assert (err.value.needed, err.value.free, err.value.evictable) == (10, 8, 0)
    pool = PagePool.from_model(llama, max_tokens=6 * 4, page_size=4, prefix_cache=False)  # 6 pages
    ids = torch.randint(3, 60, (3, 9), generator=torch.Generator().manual_seed(0))  # 3 rows x 3 pages to prefill
    with astrai_hf.patched(llama, pool=pool), pytest.raises(CacheFullError) as err:
        llama.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False)
    assert (err.value.needed, err.value.free, err.value.evictable) == (9, 6, 0)
    assert pool.stats()["num_used_pages"] == 0


def test_dtype_mismatch_is_a_type_error(llama):
    pool = PagePool.from_model(llama, max_tokens=64, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="float32.*bfloat16"):
        astrai_hf.patch(llama, pool=pool)
    with pytest.raises(TypeError, match="bfloat16"):
        llama.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=2, past_key_values=PagedCache(pool))
    assert pool.stats()["num_used_pages"] == 0


def test_a_model_whose_layers_compute_in_several_dtypes_is_refused_naming_them():
    # a layer kept in float32 in a bfloat16 model: from_model had built a bfloat16 pool, patch() took it, and the
    # first generate() refused with advice to build the very pool it had
    model = tiny_model("llama", dtype=torch.bfloat16)
    model.model.layers[1].float()
    message = (r"LlamaForCausalLM's attention layers compute K/V in several dtypes \(layers \[0\] in torch.bfloat16; "
               r"layers \[1\] in torch.float32\), and a PagePool holds one; cast them to one dtype")
    with pytest.raises(TypeError, match=message):
        PagePool.from_model(model, max_tokens=64)
    with pytest.raises(TypeError, match=message):
        astrai_hf.patch(model, max_tokens=64)
    assert not astrai_hf.is_patched(model)
    pool = PagePool.from_model(model, max_tokens=64, dtype=torch.bfloat16)  # a dtype given: the check names them
    with pytest.raises(TypeError, match=message):
        astrai_hf.patch(model, pool=pool)
    with pytest.raises(TypeError, match=r"layer 1 produced K in torch.float32 .* stores torch.bfloat16; .* "
                       r"PagePool.from_model\(model, dtype=torch.float32\) \(a pool holds one dtype: a model whose "
                       "layers compute K/V in several, a layer kept in float32, is cast to one first"):
        model.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=2, past_key_values=PagedCache(pool))
    assert pool.stats()["num_used_pages"] == 0
    model.to(torch.bfloat16)
    astrai_hf.patch(model, pool=pool)
    astrai_hf.unpatch(model)


class _WeightOnlyInt8(torch.nn.Module):
    """A projection quantized weight-only: int8 weights, a scale per output in a buffer; it computes in the dtype
    it is fed."""

    def __init__(self, linear):
        super().__init__()
        w = linear.weight.detach().float()
        scale = w.abs().amax(1, keepdim=True).clamp(min=1e-8) / 127
        self.weight = torch.nn.Parameter((w / scale).round().to(torch.int8), requires_grad=False)
        self.register_buffer("scale", scale)

    def forward(self, x):
        return x @ (self.weight.to(x.dtype) * self.scale.to(x.dtype)).t()


@pytest.mark.parametrize("layers", [[1], [0, 1]], ids=["one layer", "every layer"])
def test_attention_with_no_floating_weights_computes_in_the_dtype_it_is_fed(layers):
    # an attention module with no floating parameter had been taken to compute in float32: a bfloat16 model with a
    # layer quantized weight-only was refused as mixed, and one with every layer so got a float32 pool
    stock = tiny_model("llama", dtype=torch.bfloat16)
    for i in layers:
        attn = stock.model.layers[i].self_attn
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(attn, name, _WeightOnlyInt8(getattr(attn, name)))
    model = copy.deepcopy(stock)
    assert PagePool.from_model(model, max_tokens=64).dtype == torch.bfloat16
    ids, mask = left_padded_batch([5, 9], seed=2)
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False)
    want = stock.generate(ids, **kw)
    with astrai_hf.patched(model, max_tokens=256, page_size=4):
        assert torch.equal(model.generate(ids, **kw), want)
        assert astrai_hf.get_pool(model).dtype == torch.bfloat16
        stock.float(), model.float()  # the pool patch() built follows (it had kept bfloat16: the first K refused)
        assert torch.equal(model.generate(ids, **kw), stock.generate(ids, **kw))
        assert astrai_hf.get_pool(model).dtype == torch.float32


def test_device_mismatch_is_a_value_error(llama):
    pool = PagePool.from_model(llama, max_tokens=64, device="meta")
    with pytest.raises(ValueError, match="layer 0 of the model is on cpu.*meta"):
        astrai_hf.patch(llama, pool=pool)


def test_paged_cache_needs_a_pool():
    with pytest.raises(TypeError, match="PagePool"):
        PagedCache(object())


def test_integer_scalars_of_numpy_and_torch_are_sizes(llama):
    import numpy as np

    pool = PagePool(llama.config, max_tokens=np.int64(256), page_size=np.int32(4), max_reqs=torch.tensor(3),
                    max_seq_len=np.uint16(64), memory_fraction=None)
    assert (pool.page_size, pool.max_seq_len, pool.stats()["num_pages"]) == (4, 64, 64)
    assert type(pool.page_size) is int and type(pool.config.max_reqs) is int
    assert PagePool(llama.config, max_tokens=64, num_kv_heads=np.int64(1)).config.spec.num_kv_heads == 1

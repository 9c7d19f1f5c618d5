"""patch() / unpatch(): the one-line entry point."""

import copy
import re

import pytest
import torch
from transformers import DynamicCache

import astrai_hf
from astrai_hf import CacheFullError, PagedCache, PagePool
from tiny_models import left_padded_batch, tiny_model


def test_falcon_is_refused_with_the_class_name_where_its_attention_bypasses_the_interface():
    from transformers.models.falcon.modeling_falcon import FalconAttention

    from astrai_hf.patch import _uses_attention_interface

    if _uses_attention_interface(FalconAttention):
        pytest.skip("Falcon's attention goes through AttentionInterface in this transformers release")
    model = tiny_model("falcon")
    with pytest.raises(NotImplementedError, match="FalconAttention"):
        astrai_hf.patch(model)
    assert not astrai_hf.is_patched(model)


def test_alibi_falcon_is_refused_on_every_release():
    # transformers 5.25 adds ALiBi's bias to the attention mask the model builds, which paged attention does not
    # read: patched, the model's forward failed on the mask paged attention leaves out
    model = tiny_model("falcon", new_decoder_architecture=False, multi_query=False, num_kv_heads=4, alibi=True)
    with pytest.raises(NotImplementedError, match="ALiBi"):
        astrai_hf.patch(model)
    assert not astrai_hf.is_patched(model)


def test_unpatch_restores_the_model_exactly():
    model = tiny_model("qwen2")
    before = dict(model.__dict__)
    impl = model.config._attn_implementation
    ids, mask = left_padded_batch([4, 6])
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    assert astrai_hf.patch(model) is model
    assert astrai_hf.get_pool(model).stats()["num_pages"] > 0
    model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    astrai_hf.unpatch(model)
    assert set(model.__dict__) == set(before) and model.forward.__func__ is type(model).forward
    assert model.config._attn_implementation == impl
    assert not any(hasattr(m, "_astrai_patch_state") for m in model.modules())
    assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False), ref)
    with pytest.raises(ValueError, match="not patched"):
        astrai_hf.get_pool(model)


def test_patched_model_keeps_stock_behaviour_without_a_paged_cache():
    model = tiny_model("llama")
    ids, mask = left_padded_batch([4, 7])
    logits = model(input_ids=ids, attention_mask=mask).logits
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, past_key_values=DynamicCache())
    astrai_hf.patch(model)
    try:
        torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits, logits, rtol=0, atol=0)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                             past_key_values=DynamicCache())
        assert torch.equal(out, ref)
        assert model.config._attn_implementation == "sdpa"
    finally:
        astrai_hf.unpatch(model)


def test_patch_with_pool_and_repatch_swaps_pool():
    model = tiny_model("llama")
    a = PagePool.from_model(model, max_tokens=64)
    b = PagePool.from_model(model, max_tokens=128)
    astrai_hf.patch(model, pool=a)
    assert astrai_hf.get_pool(model) is a
    astrai_hf.patch(model, pool=b)
    assert astrai_hf.get_pool(model) is b
    with pytest.raises(ValueError, match="not both"):
        astrai_hf.unpatch(model)
        astrai_hf.patch(model, pool=a, max_tokens=64)
    astrai_hf.unpatch(model)


def test_import_registers_nothing():
    import subprocess
    import sys

    code = ("import astrai_hf; from transformers import AttentionInterface; "
            "print('astrai_paged' in AttentionInterface._global_mapping)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "7"])
def test_prefill_chunk_tokens_is_checked(bad):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="prefill_chunk_tokens must be a positive int, got"):
        astrai_hf.patch(model, prefill_chunk_tokens=bad)
    assert not astrai_hf.is_patched(model)


def test_prefill_chunk_tokens_takes_a_numpy_int():
    import numpy as np

    model = tiny_model("llama")
    ids, mask = left_padded_batch([4, 9])
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    with astrai_hf.patched(model, prefill_chunk_tokens=np.int64(3)):
        assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False), ref)


def test_patching_a_patched_model_with_sizing_makes_that_pool_and_patched_restores_every_setting():
    model = tiny_model("llama")
    astrai_hf.patch(model, max_tokens=256, page_size=4, pack_prefill=False, prefill_chunk_tokens=7)
    try:
        first, state = astrai_hf.get_pool(model), model._astrai_patch_state
        with astrai_hf.patched(model, max_tokens=512, page_size=8):
            inner = astrai_hf.get_pool(model)
            assert inner is not first and inner.page_size == 8 and inner.stats()["num_pages"] == 512 // 8
            assert state.pack_prefill and state.prefill_chunk_tokens is None
        assert astrai_hf.get_pool(model) is first
        assert not state.pack_prefill and state.prefill_chunk_tokens == 7
        with pytest.raises(ValueError, match="either a pool or pool sizing"):
            astrai_hf.patch(model, first, max_tokens=64)
        # the sizing patch() built the first pool with is back too: the model moved, its pool is built again so
        with astrai_hf.patched(model, PagePool.from_model(model, max_tokens=128)):
            pass
        ids, mask = left_padded_batch([5, 3])
        for dtype in (torch.bfloat16, torch.float32):
            model.to(dtype)
            model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
            pool = astrai_hf.get_pool(model)
            assert (pool.dtype, pool.page_size, pool.stats()["num_pages"]) == (dtype, 4, 256 // 4)
    finally:
        astrai_hf.unpatch(model)


def test_bad_arguments_are_named():
    model = tiny_model("llama")
    ids, mask = left_padded_batch([5, 3])
    with pytest.raises(TypeError, match="pool must be a PagePool, got str"):
        astrai_hf.patch(model, pool="x")
    with pytest.raises(TypeError, match="pack_prefill must be True or False, got 'no'"):
        astrai_hf.patch(model, max_tokens=256, pack_prefill="no")
    with pytest.raises(TypeError, match="cuda_graphs must be True or False, got 1"):
        astrai_hf.patch(model, max_tokens=256, cuda_graphs=1)
    with pytest.raises(TypeError, match="prefix_cache must be True or False, got 'no'"):
        PagePool.from_model(model, max_tokens=256, prefix_cache="no")
    with pytest.raises(TypeError, match=r"^patch\(\) got an unexpected keyword argument 'max_token'; .* max_tokens"):
        astrai_hf.patch(model, max_token=256)  # had been named an argument of PagePool.__init__()
    pool = PagePool.from_model(model, max_tokens=256)
    with pytest.raises(TypeError, match="prefix_cache must be True or False"):
        astrai_hf.PagedCache(pool, prefix_cache=0)
    with pytest.raises(TypeError, match="integer token ids, got dtype torch.float32"):
        astrai_hf.PagedCache(pool, ids.float(), mask)
    assert not astrai_hf.is_patched(model) and pool.stats()["num_used_pages"] == 0
    import numpy as np

    astrai_hf.unpatch(astrai_hf.patch(model, max_tokens=256, pack_prefill=np.True_, cuda_graphs=np.False_))
    assert PagePool.from_model(model, max_tokens=256, prefix_cache=np.False_).prefix_cache is None


class _Wrapper(torch.nn.Module):
    """A module of one's own around a model, with a generate() of its own and no config."""

    def __init__(self, model):
        super().__init__()
        self.inner = model

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs)

    def generate(self, *args, **kwargs):
        return self.inner.generate(*args, **kwargs)


@pytest.mark.parametrize("what", ["bare decoder", "not a model", "a wrapper without a config"])
def test_what_patch_cannot_take_is_refused_before_anything_is_installed(what):
    # patch(LlamaModel) had installed its forward wrapper and module state, then failed on the missing generate():
    # the model was left half patched (and torch.save of it failed)
    import pickle

    model = tiny_model("llama")
    target, error = {
        "bare decoder": (model.model, "LlamaModel has no generate\\(\\)"),
        "not a model": (model.config, "takes a transformers model .* got LlamaConfig"),
        "a wrapper without a config": (_Wrapper(model), "_Wrapper has no config: .* patch the model it wraps"),
    }[what]
    before = dict(vars(target)) if what != "not a model" else None
    with pytest.raises(TypeError, match=error):
        astrai_hf.patch(target)
    if what != "not a model":
        assert vars(target).keys() == before.keys()
        assert all("_astrai" not in k for m in target.modules() for k in vars(m))
        pickle.dumps(target)
    for call in (astrai_hf.unpatch, astrai_hf.get_pool, PagePool.from_model, astrai_hf.cache_kwarg,
                 astrai_hf.capture_graphs):
        with pytest.raises(TypeError, match="takes a transformers model"):
            call(None)
    with astrai_hf.patched(model, max_tokens=256, cuda_graphs=True):
        with pytest.raises(TypeError, match="pool must be a PagePool, got str"):
            astrai_hf.capture_graphs(model, pool="x")
    pool = PagePool.from_model(model, max_tokens=256)
    ids, mask = left_padded_batch([5, 3])
    with pytest.raises(TypeError, match="input_ids must be a torch.Tensor, got list"):
        astrai_hf.PagedCache(pool, ids.tolist())
    with pytest.raises(TypeError, match="model must be a torch.nn.Module or None, got str"):
        astrai_hf.PagedCache(pool, ids, mask, model="x")


def test_a_patch_that_fails_midway_leaves_the_model_as_it_was(monkeypatch):
    import importlib

    patch_module = importlib.import_module("astrai_hf.patch")

    model = tiny_model("llama")
    before = {m: dict(vars(m)) for m in model.modules()}

    def broken(*args):
        raise RuntimeError("boom")

    monkeypatch.setattr(patch_module, "_wrap_generate", broken)
    with pytest.raises(RuntimeError, match="boom"):
        astrai_hf.patch(model, max_tokens=256)
    assert not astrai_hf.is_patched(model)
    assert all(vars(m).keys() == before[m].keys() for m in model.modules())


@pytest.mark.parametrize("sizing", [{}, {"max_tokens": 512, "page_size": 8}])
def test_a_model_moved_to_another_dtype_after_patch_gets_a_new_pool(sizing):
    # patch(model) then model.to(...): the pool patch() built follows the model, with the same sizing
    model = tiny_model("llama")
    ids, mask = left_padded_batch([5, 9])
    kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False)
    astrai_hf.patch(model, **sizing)
    first = astrai_hf.get_pool(model)
    model.generate(ids, **kw)
    model.to(torch.bfloat16)
    try:
        out = model.generate(ids, **kw)
        pool = astrai_hf.get_pool(model)
        assert pool is not first and pool.dtype == torch.bfloat16
        assert pool.page_size == first.page_size
        if "max_tokens" in sizing:
            assert pool.stats()["num_pages"] == first.stats()["num_pages"]
        assert pool.stats()["num_used_pages"] == 0
        assert model.generate(ids, **kw).equal(out) and astrai_hf.get_pool(model) is pool  # built once
    finally:
        astrai_hf.unpatch(model)
    assert torch.equal(out, model.generate(ids, **kw))


def test_the_cuda_graphs_default_is_decided_again_when_the_model_moves(monkeypatch):
    # patch(model) on the CPU, then model.to("cuda"): the default had been decided once, at patch(), so the model
    # decoded eagerly on its GPU (and a model moved off its GPU ran the graph runner's eager stand-in). Here float64
    # stands in for "wholly on one CUDA device", the one thing the default reads
    import importlib

    patch_module = importlib.import_module("astrai_hf.patch")
    monkeypatch.setattr(patch_module, "_wants_graphs", lambda model, given: given if given is not None else
                        next(model.parameters()).dtype == torch.float64)
    model, stock = tiny_model("llama"), tiny_model("llama")
    ids, mask = left_padded_batch([5, 9])
    kw = dict(attention_mask=mask, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    astrai_hf.patch(model, max_tokens=512)
    state = model._astrai_patch_state
    try:
        model.generate(ids, **kw)
        assert not state.cuda_graphs and not state.runners
        model.to(torch.float64)
        stock.to(torch.float64)
        assert astrai_hf.capture_graphs(model)  # before any call: it had refused, naming cuda_graphs=False
        assert torch.equal(model.generate(ids, **kw), stock.generate(ids, **kw))
        assert state.cuda_graphs and next(iter(state.runners.values())).replays == 4
        model.float()
        model.generate(ids, **kw)
        assert not state.cuda_graphs and not state.runners
        astrai_hf.patch(model, cuda_graphs=False, max_tokens=512)  # as given, wherever the model goes
        model.to(torch.float64)
        model.generate(ids, **kw)
        assert not state.cuda_graphs and not state.runners
    finally:
        astrai_hf.unpatch(model)


def test_a_pool_the_caller_gave_is_not_replaced_when_the_model_moves():
    model = tiny_model("llama")
    ids, mask = left_padded_batch([5, 9])
    pool = PagePool.from_model(model, max_tokens=512)
    astrai_hf.patch(model, pool=pool)
    model.to(torch.bfloat16)
    try:
        with pytest.raises(TypeError, match="build the pool with PagePool.from_model"):
            model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
        assert astrai_hf.get_pool(model) is pool and pool.stats()["num_used_pages"] == 0
    finally:
        astrai_hf.unpatch(model)


@pytest.mark.parametrize("pool_from", ["patch()", "the caller"])
def test_a_layer_appended_after_patch_gets_a_pool_that_holds_it_or_a_clear_error(pool_from):
    # growing a model by a layer (its layer_idx and num_hidden_layers set) had raised an IndexError from the pool's
    # placement check at every later call
    import copy

    def grow(model):
        layer = copy.deepcopy(model.model.layers[-1])
        layer.self_attn.layer_idx = len(model.model.layers)
        model.model.layers.append(layer)
        model.config.num_hidden_layers = len(model.model.layers)
        return model

    model = tiny_model("llama")
    ids, mask = left_padded_batch([5, 9])
    kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False)
    if pool_from == "patch()":
        astrai_hf.patch(model, max_tokens=512)
    else:
        astrai_hf.patch(model, PagePool.from_model(model, max_tokens=512))
    first = astrai_hf.get_pool(model)
    try:
        model.generate(ids, **kw)
        grow(model)
        if pool_from == "patch()":  # the pool patch() built follows the model
            assert torch.equal(model.generate(ids, **kw), grow(tiny_model("llama")).generate(ids, **kw))
            assert astrai_hf.get_pool(model).config.spec.num_layers == 3
        else:
            with pytest.raises(ValueError, match=r"built for a model with num_layers=2, but LlamaForCausalLM has "
                                                 r"num_layers=3; build the pool with PagePool.from_model\(model\)"):
                model.generate(ids, **kw)
            assert astrai_hf.get_pool(model) is first
        assert astrai_hf.get_pool(model).stats()["num_used_pages"] == first.stats()["num_used_pages"] == 0
    finally:
        astrai_hf.unpatch(model)


def test_torch_save_and_pickle_of_a_patched_model_store_it_unpatched():
    import io
    import pickle

    model = tiny_model("llama")
    ids, mask = left_padded_batch([5, 9])
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    attrs = set(model.__dict__)
    astrai_hf.patch(model, max_tokens=256)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = [torch.load(buf, weights_only=False), pickle.loads(pickle.dumps(model))]
    for twin in loaded:
        assert not astrai_hf.is_patched(twin) and set(twin.__dict__) == attrs
        assert all("_astrai_patch_state" not in m.__dict__ for m in twin.modules())
        assert torch.equal(twin.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False), ref)
        astrai_hf.patch(twin, max_tokens=256)
        assert torch.equal(twin.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False), ref)
    assert astrai_hf.is_patched(model)  # the saved model itself stays patched
    assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False), ref)
    astrai_hf.unpatch(model)
    assert set(model.__dict__) == attrs


def test_copies_of_a_patched_model():
    import copy

    model = tiny_model("llama")
    ids, mask = left_padded_batch([5, 9])
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False)
    ref = model.generate(ids, **kw)
    astrai_hf.patch(model, max_tokens=512)
    shallow = copy.copy(model)  # shares the patched modules, so it is patched with them
    assert astrai_hf.is_patched(shallow)
    astrai_hf.patch(shallow, max_tokens=512)
    assert torch.equal(shallow.generate(ids, **kw), ref) and torch.equal(model.generate(ids, **kw), ref)
    twin = copy.deepcopy(model)  # its own weights on the same pool; moved, it gets a pool of its own
    assert astrai_hf.get_pool(twin) is astrai_hf.get_pool(model)
    twin.to(torch.bfloat16)
    bf16 = astrai_hf.unpatch(copy.deepcopy(twin)).generate(ids, **kw)
    assert torch.equal(twin.generate(ids, **kw), bf16) and astrai_hf.get_pool(twin).dtype == torch.bfloat16
    assert torch.equal(model.generate(ids, **kw), ref)


@pytest.mark.parametrize("pinned", [dict(dtype=torch.float32), dict(device="cpu"),
                                    dict(dtype=torch.float32, device="cpu")])
def test_a_pool_pinned_to_a_dtype_is_not_rebuilt_when_the_model_moves(pinned):
    model = tiny_model("llama")
    ids, mask = left_padded_batch([5, 9])
    kw = dict(attention_mask=mask, max_new_tokens=3, do_sample=False)
    bf16 = copy.deepcopy(model).to(torch.bfloat16).generate(ids, **kw)
    astrai_hf.patch(model, max_tokens=512, **pinned)
    pool = astrai_hf.get_pool(model)
    model.to(torch.bfloat16)
    try:
        # the error names what was pinned and the patch() call that fixes it (not a pool the caller never built);
        # the dtype moved, a pinned device did not
        fix = ", ".join("dtype=<the model's dtype now>" if name == "dtype" else "device='cpu'" for name in sorted(pinned))
        with pytest.raises(TypeError, match=r"pool stores torch.float32; patch\(\) built the pool with .*"
                                            + re.escape(f"astrai_hf.patch(model, {fix}) again")) as raised:
            model.generate(ids, **kw)
        assert "PagePool.from_model" not in str(raised.value)
        assert astrai_hf.get_pool(model) is pool
        astrai_hf.patch(model, **{name: model.dtype if name == "dtype" else "cpu" for name in pinned})
        assert astrai_hf.get_pool(model).dtype == torch.bfloat16
        assert torch.equal(model.generate(ids, **kw), bf16)
    finally:
        astrai_hf.unpatch(model)


@pytest.mark.parametrize("setup", ["default pool", "own pool", "graph runner", "deep copy"])
def test_a_deleted_patched_model_frees_its_pool_without_the_garbage_collector(setup):
    # nothing patch() puts on the model or its modules holds them strongly: a reference cycle through them would
    # keep the model and the pool's K/V memory until the garbage collector runs
    import copy
    import gc
    import weakref

    ids, mask = left_padded_batch([5, 9])
    gc.collect()
    gc.disable()
    try:
        model = tiny_model("llama")
        pool = PagePool.from_model(model, max_tokens=256, page_size=4) if setup == "own pool" else None
        astrai_hf.patch(model, pool=pool, max_tokens=256, cuda_graphs=setup == "graph runner") if pool is None \
            else astrai_hf.patch(model, pool=pool)
        if setup == "deep copy":
            model = copy.deepcopy(model)
        for _ in range(2):  # the second call hits the prefix cache
            model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
        refs = [weakref.ref(model), weakref.ref(astrai_hf.get_pool(model)),
                weakref.ref(astrai_hf.get_pool(model).storage.k[0])]
        del model, pool
        assert [ref() is None for ref in refs] == [True, True, True]
    finally:
        gc.enable()


@pytest.mark.parametrize("failure", ["past max_seq_len", "pool full", "pool full, own cache", "a hand loop"])
def test_a_deleted_patched_model_frees_its_pool_without_the_garbage_collector_after_a_call_that_failed(failure):
    # the error was kept in a local of the frames it was raised through (to be raised on every tensor-parallel
    # rank), which the traceback holds: a cycle that kept the model and the pool's K/V until the garbage collector
    # ran, though the caller kept nothing of the error
    import gc
    import weakref

    ids, mask = left_padded_batch([5, 3])
    kw = dict(attention_mask=mask, do_sample=False, max_new_tokens=60, min_new_tokens=60)
    if failure == "past max_seq_len":
        kw.update(max_new_tokens=300, min_new_tokens=300)
    gc.collect()
    gc.disable()
    try:
        model = tiny_model("llama")
        astrai_hf.patch(model, max_tokens=32, page_size=4, max_seq_len=256)
        pool = astrai_hf.get_pool(model)
        with pytest.raises(ValueError if failure == "past max_seq_len" else CacheFullError):
            if failure == "pool full, own cache":
                with PagedCache(pool) as cache:
                    model.generate(ids, **kw, **{astrai_hf.cache_kwarg(model): cache})
            elif failure == "a hand loop":
                with PagedCache(pool, prefix_cache=False) as cache:
                    model(torch.randint(3, 90, (2, 40)), **{astrai_hf.cache_kwarg(model): cache})
            else:
                model.generate(ids, **kw)
        refs = [weakref.ref(model), weakref.ref(pool), weakref.ref(pool.storage.k[0])]
        del model, pool
        if failure in ("pool full, own cache", "a hand loop"):
            del cache
        assert [ref() is None for ref in refs] == [True, True, True]
    finally:
        gc.enable()


@pytest.mark.equivalence
@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_a_call_that_failed_mid_generation_returns_its_pages_while_the_caller_keeps_the_error(error):
    # the error's traceback holds the call's frames and so its cache: kept (`except ... as e: err = e`, a notebook's
    # sys.last_value), only the call's own release returns the pages, not the cache's finaliser
    import gc

    from transformers import LogitsProcessor, LogitsProcessorList

    class FailsAtStep3(LogitsProcessor):
        def __init__(self):
            self.steps = 0

        def __call__(self, input_ids, scores):
            self.steps += 1
            if self.steps == 3:
                raise error("the caller's processor failed")
            return scores

    model = tiny_model("llama")
    ids, mask = left_padded_batch([5, 9, 3])
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False)
    stock = model.generate(ids, **kw)
    gc.collect()
    gc.disable()
    try:
        with astrai_hf.patched(model, max_tokens=1024, page_size=4):
            pool = astrai_hf.get_pool(model)
            with pytest.raises(error) as err:
                model.generate(ids, **kw, logits_processor=LogitsProcessorList([FailsAtStep3()]))
            assert err.value.__traceback__ is not None
            s = pool.stats()
            assert (s["num_used_pages"], s["num_reqs_used"]) == (0, 0), s
            assert torch.equal(model.generate(ids, **kw), stock)
    finally:
        gc.enable()


def test_pools_a_patched_model_checked_are_not_remembered_past_their_life():
    # they were remembered by id(): the set grew by every temporary pool, and a later pool at a freed one's address
    # skipped the check against the model (its own geometry, window, chunking)
    import gc

    from astrai_hf.patch import _STATE_ATTR

    model = tiny_model("llama")
    ids, mask = left_padded_batch([5, 9])
    astrai_hf.patch(model, max_tokens=256)
    for _ in range(3):
        pool = PagePool.from_model(model, max_tokens=64, page_size=4)
        with PagedCache(pool) as cache:
            model.generate(ids, attention_mask=mask, max_new_tokens=2, **{astrai_hf.cache_kwarg(model): cache})
        del pool, cache
    gc.collect()
    assert list(vars(model)[_STATE_ATTR].checked_pools) == [astrai_hf.get_pool(model)]


def test_an_attention_subclass_of_the_callers_is_patched_when_it_calls_the_parents_forward():
    from transformers.models.llama.modeling_llama import LlamaAttention

    class ProbedAttention(LlamaAttention):  # research code: a subclass in the caller's own script
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    class HandWrittenAttention(LlamaAttention):  # attention computed by hand: nothing to route paged attention into
        def forward(self, hidden_states, *args, **kwargs):
            return torch.zeros_like(hidden_states), None

    model = tiny_model("llama")
    ids, mask = left_padded_batch([5, 9], seed=1)
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False)
    ref = model.generate(ids, **kw)
    for layer in model.model.layers:
        layer.self_attn.__class__ = ProbedAttention
    with astrai_hf.patched(model, max_tokens=1024):
        assert torch.equal(model.generate(ids, **kw), ref)
    for layer in model.model.layers:
        layer.self_attn.__class__ = HandWrittenAttention
    with pytest.raises(NotImplementedError, match="HandWrittenAttention computes attention without"):
        astrai_hf.patch(model)


def test_a_method_saved_from_a_freed_patched_model_says_what_happened():
    # patch() holds the model weakly (so that deleting it frees its pool at once)
    ids, mask = left_padded_batch([5, 9])
    model = astrai_hf.patch(tiny_model("llama"), max_tokens=256)
    generate = model.generate
    del model
    with pytest.raises(ReferenceError, match="keep a reference to the patched model"):
        generate(ids, attention_mask=mask, max_new_tokens=2)


def test_a_call_chained_on_a_patched_model_no_variable_holds_says_what_happened():
    # the message had named saved methods and shallow copies only, and pointed to copy.deepcopy, itself such a call
    import copy

    ids, mask = left_padded_batch([5, 9])
    model = astrai_hf.patch(tiny_model("llama"), max_tokens=256)
    for chained in (lambda: astrai_hf.patch(tiny_model("llama"), max_tokens=256), lambda: copy.deepcopy(model)):
        with pytest.raises(ReferenceError, match=r"a call on a model no variable holds .*keep a reference"):
            chained().generate(ids, attention_mask=mask, max_new_tokens=2)
    assert model.generate(ids, attention_mask=mask, max_new_tokens=2).shape == (2, 11)


@pytest.mark.parametrize("when", ["before patch", "after patch"])
def test_a_model_sharing_attention_modules_with_a_patched_model_is_refused_and_the_first_keeps_working(when):
    # a reference model sharing its first layer with the policy (TRL's create_reference_model shares layers so):
    # patching the second took the shared module's patch from the first, whose next generate() raised "ran
    # astrai-hf paged attention outside a paged forward", also after unpatch() of the second
    import copy

    ids, mask = left_padded_batch([5, 9, 3], seed=1)
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False)
    policy = tiny_model("llama")
    ref = copy.deepcopy(policy)
    stock = policy.generate(ids, **kw)
    if when == "before patch":
        ref.model.layers[0] = policy.model.layers[0]
    astrai_hf.patch(policy, max_tokens=1024)
    if when == "before patch":
        with pytest.raises(NotImplementedError, match=r"'model.layers.0.self_attn' is shared with another patched"):
            astrai_hf.patch(ref, max_tokens=1024)
        assert not astrai_hf.is_patched(ref)
    else:
        astrai_hf.patch(ref, max_tokens=1024)
        ref.model.layers[0] = policy.model.layers[0]
        with pytest.raises(NotImplementedError, match=r"\(it changed since patch\(\)\): its attention module"):
            ref.generate(ids, **kw)
        astrai_hf.unpatch(ref)  # (the shared module keeps the policy's patch)
    assert torch.equal(policy.generate(ids, **kw), stock)
    assert torch.equal(ref.generate(ids, **kw), stock)  # stock generate(), through the policy's module
    assert torch.equal(policy.generate(ids, **kw), stock)
    assert astrai_hf.get_pool(policy).stats()["num_used_pages"] == 0
    astrai_hf.unpatch(policy)
    assert not any("_astrai_patch_state" in m.__dict__ for m in ref.modules())


@pytest.mark.parametrize("version, warned", [("5.26.0", True), ("4.57.1", True), ("5.25.0", False),
                                             ("5.24.0", False), ("5.17.0", False), ("5.20.1.dev0", False)])
def test_patch_warns_once_on_a_transformers_release_the_suite_does_not_test(version, warned, monkeypatch, caplog):
    # the pin used to allow every 5.x: a release the suite had not run on (5.25, before it did) installed beside it
    # made prompt lookup raise and gave windowed models other tokens than stock, without a word
    import logging
    from pathlib import Path

    import transformers

    import importlib

    patch_module = importlib.import_module("astrai_hf.patch")

    low, high = patch_module.TESTED_TRANSFORMERS
    major, minor = high.split(".")
    pin = f'"transformers>={low},<{major}.{int(minor) + 1}"'
    assert pin in (Path(__file__).parents[1] / "pyproject.toml").read_text()  # (the pin and the warning agree)
    monkeypatch.setattr(transformers, "__version__", version)
    patch_module._warn_untested_transformers.cache_clear()
    model = tiny_model("llama")
    try:
        with caplog.at_level(logging.WARNING, logger="astrai_hf"):
            for _ in range(2):
                astrai_hf.patch(model, max_tokens=64)
                astrai_hf.unpatch(model)
    finally:
        patch_module._warn_untested_transformers.cache_clear()
    said = [r.getMessage() for r in caplog.records if "outside the releases" in r.getMessage()]
    assert said == ([f"transformers {version} is outside the releases astrai-hf is tested with (5.17 to 5.25): "
                     "outputs may differ from stock transformers'"] if warned else [])


# ------------------------------------------------------------------------- the walks of the model made at each call
def test_a_module_class_gaining_or_losing_an_attribute_between_calls_is_read_as_it_is_now(monkeypatch):
    # the walks once remembered what each class had: an attribute deleted from a class (a monkeypatch undone)
    # then raised AttributeError from the next generate(), and one added was not seen
    import importlib

    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    patch_module = importlib.import_module("astrai_hf.patch")  # (astrai_hf.patch is the function)

    model = tiny_model("llama")
    ids, mask = left_padded_batch([5, 7])
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    norms = sum(isinstance(m, LlamaRMSNorm) for m in model.modules())
    with astrai_hf.patched(model, max_tokens=512):
        assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False), ref)
        assert patch_module.watched_modules(model).checkpointing == []
        monkeypatch.setattr(LlamaRMSNorm, "gradient_checkpointing", True, raising=False)
        assert len(patch_module.watched_modules(model).checkpointing) == norms
        assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False), ref)
        monkeypatch.undo()
        assert patch_module.watched_modules(model).checkpointing == []
        assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False), ref)


def test_layer_idx_is_read_as_getattr_reads_it():
    # a property of a subclass (over a stale entry in the instance's dict) and a wrapper forwarding attributes by a
    # __getattr__ of its own give layer_idx as getattr gives it, and a class gaining layer_idx later is seen
    from transformers.models.llama.modeling_llama import LlamaAttention

    from astrai_hf.pool import attention_modules, attention_modules_in_place

    class Renumbered(LlamaAttention):
        @property
        def layer_idx(self):
            return self.place

    model = tiny_model("llama", num_hidden_layers=3)
    layers = model.model.layers
    model.model.layers = torch.nn.ModuleList([layers[2], layers[0], layers[1]])
    for place, layer in enumerate(model.model.layers):
        layer.self_attn.__class__ = Renumbered  # (its dict still holds layer_idx 2, 0, 1)
        layer.self_attn.place = place
    assert [m.layer_idx for m in attention_modules(model)] == [0, 1, 2]
    assert attention_modules_in_place(model)[1] is False

    class WrapAttention(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def __getattr__(self, name):
            try:
                return super().__getattr__(name)
            except AttributeError:
                return getattr(self.inner, name)

    model = tiny_model("llama")
    for layer in model.model.layers:
        layer.self_attn = WrapAttention(layer.self_attn)
    assert [type(m).__name__ for m in attention_modules(model, every_copy=True)] == ["WrapAttention",
                                                                                     "LlamaAttention"] * 2

    class Block(torch.nn.Module):
        pass

    class MyAttention(torch.nn.Module):
        pass

    net = torch.nn.ModuleList([Block(), MyAttention()])
    assert attention_modules(net) == []
    MyAttention.layer_idx = 0
    assert attention_modules(net) == [net[1]]


def test_a_model_moved_to_another_dtype_during_a_call_fails_that_call_and_the_next_follows():
    from transformers.generation.streamers import BaseStreamer

    model = tiny_model("llama")
    ids, mask = left_padded_batch([5, 9], seed=4)
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False)
    bf16 = copy.deepcopy(model).to(torch.bfloat16).generate(ids, **kw)
    astrai_hf.patch(model, max_tokens=1024)

    class MovesTheModel(BaseStreamer):  # another cell or thread moving the model while the call runs
        steps = 0

        def put(self, value):
            self.steps += 1
            if self.steps == 3:
                model.to(torch.bfloat16)

        def end(self):
            pass

    # the message had only said to build a PagePool, which the caller of patch() never built
    with pytest.raises(TypeError, match="moved to another dtype during a call .* follows the move at the next call"):
        model.generate(ids, streamer=MovesTheModel(), **kw)
    assert astrai_hf.get_pool(model).stats()["num_used_pages"] == 0
    assert torch.equal(model.generate(ids, **kw), bf16)
    astrai_hf.unpatch(model)

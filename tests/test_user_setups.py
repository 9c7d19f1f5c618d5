"""How users run models, from the field's bug reports: under torch.inference_mode() or torch.autocast, in a forward
that autograd records, deep-copied, with a hub generation_config that names another cache or passed
positionally. A patched model must behave as stock does there, and leave the pool clean."""

import contextlib
import copy
import gc
import re
import threading
import warnings
import weakref

import pytest
import torch
import transformers
from transformers import GenerationConfig

import astrai_hf
from astrai_hf import PagedCache, PagePool
from tiny_models import left_padded_batch, tiny_model

pytestmark = pytest.mark.equivalence

GREEDY = dict(max_new_tokens=6, do_sample=False)


def _used(pool):
    return pool.stats()["num_used_pages"]


def _assert_same_output(got, ref, tol=1e-5):
    """The same sequences, and scores within ``tol``, as stock's ``generate()`` output ``ref``."""
    assert torch.equal(got.sequences, ref.sequences)
    for a, b in zip(got.scores, ref.scores, strict=True):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_a_pool_made_under_inference_mode_serves_calls_outside_it():
    model = tiny_model("llama")
    ids, mask = left_padded_batch([7, 12], seed=1)
    ref = model.generate(ids, attention_mask=mask, **GREEDY)
    try:
        with torch.inference_mode():
            astrai_hf.patch(model, max_tokens=512, page_size=4, cuda_graphs=True)  # pool and graph workspace here
            assert torch.equal(model.generate(ids, attention_mask=mask, **GREEDY), ref)
        pool = astrai_hf.get_pool(model)
        assert not pool.storage.k[0].is_inference() and not pool.req_to_token.table.is_inference()
        for _ in range(2):  # outside inference_mode (generate() itself runs under no_grad)
            assert torch.equal(model.generate(ids, attention_mask=mask, **GREEDY), ref)
            assert _used(pool) == 0
    finally:
        astrai_hf.unpatch(model)


def test_autocast_gives_the_tokens_stock_gives():
    model = tiny_model("llama")
    ids, mask = left_padded_batch([7, 12], seed=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = model.generate(ids, attention_mask=mask, **GREEDY)
    with astrai_hf.patched(model, max_tokens=512, page_size=4):
        with torch.autocast("cpu", dtype=torch.bfloat16):  # K comes out of RoPE in float32, V in bfloat16
            assert torch.equal(model.generate(ids, attention_mask=mask, **GREEDY), ref)
        assert _used(astrai_hf.get_pool(model)) == 0


def test_kv_in_a_dtype_the_pool_does_not_store_is_a_clear_error():
    model = tiny_model("llama")
    pool = PagePool.from_model(model, max_tokens=256, page_size=4)
    model.to(torch.bfloat16)
    ids, mask = left_padded_batch([5], seed=2)
    with PagedCache(pool) as cache, pytest.raises(TypeError, match=r"K in torch.bfloat16 and V in torch.bfloat16.*"
                                                                    r"stores torch.float32"):
        model(ids, attention_mask=mask, past_key_values=cache)
    assert _used(pool) == 0


@pytest.mark.parametrize("patched", [False, True])
def test_a_training_forward_with_a_paged_cache_equals_stock_and_can_repeat(patched):
    model = tiny_model("llama")
    ids, _ = left_padded_batch([10, 10], seed=2)

    def loss_and_grads(make_cache):
        model.zero_grad()
        loss = model(ids, labels=ids, past_key_values=make_cache()).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    want_loss, want_grads = loss_and_grads(transformers.DynamicCache)
    pool = PagePool.from_model(model, max_tokens=256, page_size=4)
    if patched:
        astrai_hf.patch(model, pool=pool)
    try:
        for _ in range(2):  # the second backward once failed: the pool had joined the first step's graph
            caches = []
            loss, grads = loss_and_grads(lambda: caches.append(PagedCache(pool, prefix_cache=False)) or caches[-1])
            caches[0].release()
            torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-6)
            for got, want in zip(grads, want_grads):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            assert pool.storage.k[0].grad_fn is None and not pool.storage.k[0].requires_grad
            assert _used(pool) == 0
    finally:
        astrai_hf.unpatch(model)


def test_deepcopy_of_a_patched_model_is_a_patched_model_of_its_own():
    model = tiny_model("llama")
    ids, mask = left_padded_batch([6, 9], seed=3)
    with astrai_hf.patched(model, max_tokens=512, page_size=4):
        twin = copy.deepcopy(model)
        assert astrai_hf.is_patched(model) and astrai_hf.is_patched(twin)
        assert astrai_hf.get_pool(twin) is astrai_hf.get_pool(model)  # shared, not copied
        with torch.no_grad():
            for p in twin.parameters():  # the copy's own weights drive the copy
                p.mul_(1.5)
        astrai_hf.unpatch(twin)
        ref_twin = twin.generate(ids, attention_mask=mask, **GREEDY)
        astrai_hf.patch(twin, astrai_hf.get_pool(model))
        got_twin = twin.generate(ids, attention_mask=mask, **GREEDY)
        got = model.generate(ids, attention_mask=mask, **GREEDY)
        assert torch.equal(got_twin, ref_twin)
        assert not torch.equal(got_twin, got)
        astrai_hf.unpatch(twin)
    assert not astrai_hf.is_patched(model)
    assert torch.equal(model.generate(ids, attention_mask=mask, **GREEDY), got)  # the original, restored


def test_deepcopy_of_a_peft_model_around_a_patched_model_is_a_peft_model_with_a_patched_copy_inside():
    # TRL's reference model and EMA copies deep-copy the PeftModel; it hands unknown attributes on to the model,
    # whose __deepcopy__ hook had copied the inner model alone
    peft = pytest.importorskip("peft")
    ids, mask = left_padded_batch([5, 9], seed=1)

    def lora(model):
        torch.manual_seed(3)
        config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        return peft.get_peft_model(model, config).eval()

    stock = lora(tiny_model("llama"))
    ref = stock.generate(input_ids=ids, attention_mask=mask, **GREEDY)
    base = tiny_model("llama")
    astrai_hf.patch(base, max_tokens=512, page_size=4)
    wrapped = lora(base)
    twin = copy.deepcopy(wrapped)
    assert type(twin) is type(wrapped) and twin.base_model.model is not base
    inner = twin.get_base_model()
    assert astrai_hf.is_patched(inner) and astrai_hf.get_pool(inner) is astrai_hf.get_pool(base)
    assert torch.equal(twin.generate(input_ids=ids, attention_mask=mask, **GREEDY), ref)
    with twin.disable_adapter():  # a PeftModel's own API
        plain = twin.generate(input_ids=ids, attention_mask=mask, **GREEDY)
    assert not torch.equal(plain, ref)
    assert torch.equal(wrapped.generate(input_ids=ids, attention_mask=mask, **GREEDY), ref)
    assert astrai_hf.get_pool(base).stats()["num_used_pages"] == 0


def test_unpatch_of_a_shallow_copy_is_refused_and_leaves_the_model_patched():
    model = tiny_model("llama")
    ids, mask = left_padded_batch([5, 9], seed=1)
    ref = model.generate(ids, attention_mask=mask, **GREEDY)
    with astrai_hf.patched(model, max_tokens=512, page_size=4):
        shallow = copy.copy(model)
        with pytest.raises(ValueError, match="shallow copy"):
            astrai_hf.unpatch(shallow)
        assert astrai_hf.is_patched(model)
        assert torch.equal(model.generate(ids, attention_mask=mask, **GREEDY), ref)
        twin = copy.deepcopy(shallow)  # a deep copy of the shallow copy is a patched copy of the model
        assert astrai_hf.is_patched(twin) and twin is not model
        assert torch.equal(twin.generate(ids, attention_mask=mask, **GREEDY), ref)
        assert torch.equal(model.generate(ids, attention_mask=mask, **GREEDY), ref)
        del shallow


@pytest.mark.parametrize("implementation", ["hybrid", "static", "sliding_window"])
def test_a_cache_implementation_in_the_models_generation_config_does_not_turn_the_patch_off(implementation):
    model = tiny_model("gemma2")
    model.generation_config.cache_implementation = implementation  # as hub generation_config.json files set
    ids, mask = left_padded_batch([7, 12], seed=1)
    model.generation_config.cache_implementation = None
    ref = model.generate(ids, attention_mask=mask, **GREEDY)
    model.generation_config.cache_implementation = implementation
    with astrai_hf.patched(model, max_tokens=512, page_size=4):
        for _ in range(2):
            assert torch.equal(model.generate(ids, attention_mask=mask, **GREEDY), ref)
        s = astrai_hf.get_pool(model).stats()
        assert s["prefix_query_tokens"] > 0 and s["prefix_hit_tokens"] > 0 and s["num_used_pages"] == 0
        # asked for in the call itself: that cache, as stock
        out = model.generate(ids, attention_mask=mask, cache_implementation="static", return_dict_in_generate=True,
                             **GREEDY)
        assert type(out.past_key_values).__name__ == "StaticCache"
        # but "hybrid" asked for in the call is the default cache (generate() drops it): paged, as without it
        hits = astrai_hf.get_pool(model).stats()["prefix_hit_tokens"]
        out = model.generate(ids, attention_mask=mask, cache_implementation="hybrid", return_dict_in_generate=True,
                             **GREEDY)
        assert torch.equal(out.sequences, ref) and astrai_hf.get_pool(model).stats()["prefix_hit_tokens"] > hits


def test_transformers_continuous_batching_asked_of_generate_runs_as_stock():
    # generate(cache_implementation="paged") hands the call to generate_batch(), whose forwards run on a worker
    # thread: they waited for the model's lock, held by the waiting generate(), for ever. Run without the lock, it
    # switched the model's attention under paged calls of other threads (wrong tokens, or continuous batching
    # refusing astrai-hf's attention)
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model = tiny_model("llama")
    ids, mask = left_padded_batch([5, 9, 3])
    # (sized: by default it takes most of the free memory for its cache)
    batching = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, cache_implementation="paged",
                    continuous_batching_config=ContinuousBatchingConfig(num_blocks=8, max_batch_tokens=64))
    plain = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    refs = {"batching": model.generate(**batching), "plain": model.generate(**plain)}
    with astrai_hf.patched(model, max_tokens=1024):
        results = []

        def run(name, kw, n):
            for _ in range(n):
                try:
                    results.append((name, torch.equal(model.generate(**kw), refs[name])))
                except Exception as e:  # noqa: BLE001 - every failure is the finding
                    results.append((name, e))

        workers = [threading.Thread(target=run, args=("batching", batching, 3), daemon=True),
                   threading.Thread(target=run, args=("plain", plain, 6), daemon=True)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(240)
        assert not any(w.is_alive() for w in workers), "generate(cache_implementation='paged') hangs"
        assert sorted(results, key=str) == sorted([("batching", True)] * 3 + [("plain", True)] * 6, key=str)
        assert _used(astrai_hf.get_pool(model)) == 0


def test_a_decoding_loop_of_the_callers_own_gets_an_empty_cache_as_from_stock():
    # custom_generate=<function> feeding the whole prompt itself: a repeated prompt had handed it a cache pre-filled
    # from the prefix cache (ValueError: the prompt fed again)
    model = tiny_model("llama")
    ids, mask = left_padded_batch([5, 9, 3])

    def decode(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
               streamer=None, **model_kwargs):
        name = astrai_hf.cache_kwarg(model)
        cache, am = model_kwargs[name], model_kwargs["attention_mask"]
        assert cache.get_seq_length() == 0
        positions, fed = (am.cumsum(-1) - 1).clamp(min=0), input_ids
        for _ in range(4):
            logits = model(input_ids=fed, attention_mask=am, position_ids=positions[:, -fed.shape[1]:],
                           use_cache=True, **{name: cache}).logits
            fed = logits[:, -1].argmax(-1, keepdim=True)
            input_ids, am = torch.cat([input_ids, fed], 1), torch.cat([am, torch.ones_like(fed)], 1)
            positions = torch.cat([positions, positions[:, -1:] + 1], 1)
        return input_ids

    ref = model.generate(ids, attention_mask=mask, max_new_tokens=4, custom_generate=decode)
    with astrai_hf.patched(model, max_tokens=1024, page_size=4):
        model.generate(ids, attention_mask=mask, max_new_tokens=4)  # the prompts, cached
        for _ in range(2):
            assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=4, custom_generate=decode), ref)
        assert _used(astrai_hf.get_pool(model)) == 0


def test_a_generation_config_passed_positionally_is_honoured():
    model = tiny_model("llama")
    model.set_attn_implementation("eager")
    ids, mask = left_padded_batch([6, 10], seed=4)
    base = {**model.generation_config.to_dict(), "max_new_tokens": 3, "do_sample": False,
            "return_dict_in_generate": True}
    with_attn = GenerationConfig(**{**base, "output_attentions": True})
    with_hidden = GenerationConfig(**{**base, "output_hidden_states": True})
    too_long = GenerationConfig(**{**base, "max_new_tokens": 600})
    ref_attn = model.generate(ids, with_attn, attention_mask=mask)
    ref_hidden = model.generate(ids, with_hidden, attention_mask=mask)
    with astrai_hf.patched(model, max_tokens=512, page_size=4, max_seq_len=256):
        got_attn = model.generate(ids, with_attn, attention_mask=mask)
        model.generate(ids, with_hidden, attention_mask=mask)
        got_hidden = model.generate(ids, with_hidden, attention_mask=mask)  # no prefix hit may shorten it
        with pytest.raises(ValueError, match="max_seq_len=256"):  # refused up front, before any forward
            model.generate(ids, too_long, attention_mask=mask)
        assert _used(astrai_hf.get_pool(model)) == 0
    assert len(got_attn.attentions[0]) == len(ref_attn.attentions[0])
    for got, want in zip(got_attn.attentions[0], ref_attn.attentions[0]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    real = mask.bool()  # padding columns hold meaningless states, computed differently
    for got, want in zip(got_hidden.hidden_states[0], ref_hidden.hidden_states[0]):
        torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("length", [dict(max_new_tokens=8), dict(max_length=38)])
def test_a_batch_whose_longest_row_overflows_max_seq_len_is_refused_up_front(length):
    # the longest row sets the length (a short row beside it, whose padding takes most of the width, does not): the
    # call had run its prefill and failed at the 3rd step, with less to say
    model = tiny_model("llama")
    ids, mask = left_padded_batch([4, 30], seed=1)
    with astrai_hf.patched(model, max_tokens=512, page_size=4, max_seq_len=32):
        with pytest.raises(ValueError, match=r"prompt \(30 tokens\) plus new tokens reaches 38 tokens, more than the "
                                             r"pool's max_seq_len=32; give the pool patch\(\) builds room"):
            model.generate(ids, attention_mask=mask, do_sample=False, **length)
        assert _used(astrai_hf.get_pool(model)) == 0 and astrai_hf.get_pool(model).stats()["num_cached_pages"] == 0


def test_a_call_without_a_length_stops_at_max_position_embeddings_as_stock():
    # generate()'s default length (20 new tokens) is capped at the model's max_position_embeddings: no refusal
    model = tiny_model("llama", max_position_embeddings=32)
    ids, mask = left_padded_batch([20, 14], seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (stock warns of the length it caps)
        want = model.generate(ids, attention_mask=mask, do_sample=False)
        assert want.shape == (2, 32)
        with astrai_hf.patched(model, max_tokens=512, page_size=4):
            assert astrai_hf.get_pool(model).max_seq_len == 32
            assert torch.equal(model.generate(ids, attention_mask=mask, do_sample=False), want)
            assert _used(astrai_hf.get_pool(model)) == 0


def test_kv_computed_under_autocast_never_serve_a_later_call_in_the_pools_dtype():
    model = tiny_model("llama")
    with torch.no_grad():
        model.get_output_embeddings().weight.div_(3.0)  # flatter logits: bf16-rounded K/V change a token
    ids, mask = left_padded_batch([30, 17], seed=4)
    kw = dict(attention_mask=mask, max_new_tokens=10, do_sample=False)
    ref = model.generate(ids, **kw)
    with astrai_hf.patched(model, max_tokens=2048):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model.generate(ids, **kw)
        assert torch.equal(model.generate(ids, **kw), ref)
        assert _used(astrai_hf.get_pool(model)) == 0


@pytest.mark.parametrize("patched", [False, True])
def test_a_callers_cache_under_autocast_gives_stocks_tokens_and_serves_no_later_call(patched):
    model = tiny_model("llama")
    with torch.no_grad():
        model.get_output_embeddings().weight.div_(3.0)  # flatter logits: bf16-rounded K/V change a token
    ids, mask = left_padded_batch([30, 17], seed=4)
    kw = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, return_dict_in_generate=True, output_scores=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_autocast = model.generate(ids, **kw)
    ref = model.generate(ids, **kw)
    pool = PagePool.from_model(model, max_tokens=2048, page_size=4)
    with astrai_hf.patched(model, pool=pool) if patched else contextlib.nullcontext():
        kwarg = astrai_hf.cache_kwarg(model)
        with PagedCache(pool, ids, mask) as cache, torch.autocast("cpu", dtype=torch.bfloat16):
            # a cache of the caller's: its rows are not laid out for decoding in place, so attention also runs
            # over gathered K/V, in autocast's dtype
            got = model.generate(ids, **kw, **{kwarg: cache})
        assert torch.equal(got.sequences, ref_autocast.sequences)
        with PagedCache(pool, ids, mask) as cache:
            assert cache.get_seq_length() == 0  # nothing computed under autocast was kept
            got = model.generate(ids, **kw, **{kwarg: cache})
        assert torch.equal(got.sequences, ref.sequences)
        for a, b in zip(got.scores, ref.scores):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        with PagedCache(pool, ids, mask) as cache:  # pre-filled, without autocast
            assert cache.get_seq_length() > 0
            with torch.autocast("cpu", dtype=torch.bfloat16):
                if patched:  # a patched generate() sees the call: the cache starts empty
                    assert torch.equal(model.generate(ids, **kw, **{kwarg: cache}).sequences, ref_autocast.sequences)
                else:
                    with pytest.raises(ValueError, match=r"pre-filled with \d+ columns.*torch.autocast.*"
                                                         r"prefix_cache=False"):
                        model.generate(ids, **kw, **{kwarg: cache})
        assert _used(pool) == 0


@pytest.mark.parametrize("change", ["load_state_dict(assign=True)", ".half().float()", "optimizer step, then save"])
def test_weights_replaced_or_changed_drop_the_cached_prefixes(change, tmp_path):
    def weights():
        m = tiny_model("llama", seed=0)
        with torch.no_grad():
            m.get_output_embeddings().weight.div_(3.0)
        return m

    def apply(m):
        if change == "load_state_dict(assign=True)":
            m.load_state_dict(tiny_model("llama", seed=1).state_dict(), assign=True)
        elif change == ".half().float()":
            m.half().float()  # new storages of rounded weights; the version counters stay as they were
        else:
            with torch.no_grad():
                for p in m.parameters():
                    p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.05)

    ids, mask = left_padded_batch([30, 17], seed=0)
    kw = dict(attention_mask=mask, max_new_tokens=10, do_sample=False)
    reference = weights()
    apply(reference)
    ref = reference.generate(ids, **kw)
    model = weights()
    pool = PagePool.from_model(model, max_tokens=2048)
    astrai_hf.patch(model, pool=pool)
    try:
        model.generate(ids, **kw)  # the prefix cache holds K/V of the weights as they are now
        assert pool.stats()["num_cached_pages"] > 0
        apply(model)
        if change.endswith("save"):  # nothing the old weights computed may be saved under the new fingerprint
            assert pool.save_prefix_cache(tmp_path / "prefix.safetensors") == 0
        hits = pool.stats()["prefix_hit_tokens"]
        assert torch.equal(model.generate(ids, **kw), ref)
        assert pool.stats()["prefix_hit_tokens"] == hits  # nothing the old weights computed was reused
        assert _used(pool) == 0
    finally:
        astrai_hf.unpatch(model)


def _hidden(output) -> torch.Tensor:
    """The hidden states a decoder layer's forward returned (a tuple's first item before transformers 5.25)."""
    return output[0] if isinstance(output, tuple) else output


def _with_hidden(output, hidden: torch.Tensor):
    """A decoder layer's ``output`` with ``hidden`` in place of its hidden states, in the same form."""
    return (hidden, *output[1:]) if isinstance(output, tuple) else hidden


@contextlib.contextmanager
def _steered(model, global_hook=False):
    steer = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(1)) * 0.5

    def add(module, args, output):  # activation steering: shift the residual stream after layer 0
        return _with_hidden(output, _hidden(output) + steer)

    layer = model.model.layers[0]
    if global_hook:
        handle = torch.nn.modules.module.register_module_forward_hook(
            lambda m, a, o: add(m, a, o) if m is layer else None)
    else:
        handle = layer.register_forward_hook(add)
    try:
        yield
    finally:
        handle.remove()


@contextlib.contextmanager
def _transposed(model):
    weight = model.model.layers[0].self_attn.o_proj.weight  # (square) the same storage, read another way
    weight.data = weight.data.t()
    try:
        yield
    finally:
        weight.data = weight.data.t()


@contextlib.contextmanager
def _rope_scaled(model):
    with torch.no_grad():
        model.model.rotary_emb.inv_freq.mul_(0.25)  # position interpolation, in place on a buffer
    try:
        yield
    finally:
        with torch.no_grad():
            model.model.rotary_emb.inv_freq.mul_(4.0)


def _lora(model):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj"], init_lora_weights=False)
    return peft.get_peft_model(model, config).eval()


@pytest.mark.parametrize("how", ["own cache", "a PagedCache of the caller's", "decode graphs (CPU stand-in)"])
@pytest.mark.parametrize("adapters", ["activated LoRA", "adapter_names per row"])
@pytest.mark.parametrize("patched_first", [False, True], ids=["peft model patched", "base model patched, then peft"])
def test_peft_adapters_acting_per_row_or_position_give_stocks_tokens(adapters, patched_first, how):
    # an activated LoRA adapts the tokens after the prompt's last invocation sequence: a prompt that moves it had
    # been served the adapted K/V of an earlier prompt's prefix (scores 2.6 off). Under a base model patched
    # before peft wrapped it, its prefill was packed into one row, and its decode steps padded to a graph bucket,
    # where peft's per-row arguments fail (IndexError for aLoRA, ValueError for adapter_names). A turn given the
    # returned cache had computed the earlier tokens again under this call's adapters: it runs as a call without it
    peft = pytest.importorskip("peft")
    invocation = [7, 8, 9]
    lora = dict(task_type="CAUSAL_LM", r=8, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj"],
                init_lora_weights=False)

    def wrapped(base):
        torch.manual_seed(3)
        if adapters == "activated LoRA":
            return peft.get_peft_model(base, peft.LoraConfig(**lora, alora_invocation_tokens=invocation)).eval()
        m = peft.get_peft_model(base, peft.LoraConfig(**lora), adapter_name="x")
        m.add_adapter("y", peft.LoraConfig(**lora))
        return m.eval()

    base = tiny_model("llama")
    stock = wrapped(copy.deepcopy(base))
    g = torch.Generator().manual_seed(1)
    x, y, w = (torch.randint(10, 96, (1, n), generator=g) for n in (10, 4, 3))
    inv = torch.tensor([invocation])
    first, moved = torch.cat([x, inv, y], 1), torch.cat([x, inv, y, inv, w], 1)
    short = torch.cat([torch.zeros(1, 5, dtype=torch.long), x[:, :5], inv, w], 1)
    batch = torch.cat([first[:, :short.shape[1]], short, first[:, -short.shape[1]:]])  # (3 rows: a bucket of 4)
    per_row = {"adapter_names": ["x", "y", "x"]} if adapters == "adapter_names per row" else {}
    calls = [(first, {}), (moved, {}), (batch, per_row), (moved, {})]
    kw = dict(max_new_tokens=5, do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    name = astrai_hf.cache_kwarg(base)

    def next_turn(out, edit=False):
        seq = torch.cat([out.sequences, torch.full((out.sequences.shape[0], 2), 11)], 1)
        if edit:  # an answer token tokenized otherwise on the next turn (the earlier tokens are computed again)
            seq[:, -4] = (seq[:, -4] + 1) % 96
        return seq, (seq != 0).long()

    def run(m, cache=lambda: None):
        outs = []
        for ids, more in calls:
            with contextlib.ExitStack() as stack:
                mine = cache()
                given = {} if mine is None else {name: stack.enter_context(mine)}
                outs.append(m.generate(input_ids=ids, attention_mask=(ids != 0).long(), **kw, **more, **given))
                if mine is not None and ids is batch:  # the caller's cache continued: stock's does as well
                    seq, mask = next_turn(outs[-1])
                    outs.append(m.generate(input_ids=seq, attention_mask=mask, **kw, **more, **given))
        return outs

    ref = run(stock)
    ref.insert(3, stock.generate(input_ids=next_turn(ref[2])[0], attention_mask=next_turn(ref[2])[1], **kw, **per_row,
                                 **{name: getattr(ref[2], name)}))
    fresh = stock.generate(input_ids=next_turn(ref[2], True)[0], attention_mask=next_turn(ref[2], True)[1], **kw,
                           **per_row)
    settings = dict(max_tokens=1024, page_size=4, cuda_graphs=how.startswith("decode graphs"))
    if patched_first:
        astrai_hf.patch(base, **settings)
        model, patched = wrapped(base), base
    else:
        model = patched = wrapped(base)
        astrai_hf.patch(model, **settings)
    pool = astrai_hf.get_pool(patched)
    try:
        if how == "a PagedCache of the caller's":
            got = run(model, cache=lambda: PagedCache(pool))
        else:
            got = run(model)
            seq, mask = next_turn(got[2], edit=True)  # the returned cache passed on: as a call without it
            _assert_same_output(model.generate(input_ids=seq, attention_mask=mask, **kw, **per_row,
                                               **{name: getattr(got[2], name)}), fresh)
            ref.pop(3)
        for out, want in zip(got, ref, strict=True):
            _assert_same_output(out, want)
        assert _used(pool) == 0
    finally:
        astrai_hf.unpatch(patched)


CHANGES = {
    "forward hook": lambda peft_model, model: _steered(model),
    "global forward hook": lambda peft_model, model: _steered(model, global_hook=True),
    "RoPE buffer in place": lambda peft_model, model: _rope_scaled(model),
    "param.data = param.data.t()": lambda peft_model, model: _transposed(model),
    "peft disable_adapter()": lambda peft_model, model: peft_model.disable_adapter(),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_changes_outside_the_parameters_are_not_served_stale_prefixes(change):
    # the K/V of a prompt depend on hooks, buffers and adapter state as much as on the parameters
    model = tiny_model("llama")
    generator = _lora(model) if change.startswith("peft") else model
    ids, mask = left_padded_batch([20, 9], seed=2)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, return_dict_in_generate=True,
              output_logits=True)

    def run():
        plain = generator.generate(**kw).logits
        with CHANGES[change](generator, model):
            changed = generator.generate(**kw).logits
        return plain, changed, generator.generate(**kw).logits

    stock = run()
    assert (stock[1][0] - stock[0][0]).abs().max() > 1e-3  # the change changes the logits
    pool = PagePool.from_model(model, max_tokens=2048)
    astrai_hf.patch(model, pool=pool)
    try:
        generator.generate(**kw)  # the prefix cache holds these prompts
        for got, ref in zip(run(), stock):
            for a, b in zip(got, ref):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
        assert _used(pool) == 0
        hits = pool.stats()["prefix_hit_tokens"]
        generator.generate(**kw)
        assert pool.stats()["prefix_hit_tokens"] > hits  # with nothing changed, prefixes are reused again
    finally:
        astrai_hf.unpatch(model)


def _first_position_steer(record):
    steer = torch.randn(64, generator=torch.Generator().manual_seed(3))

    def hook(module, args, output):  # ActAdd-style: steer the first position of each forward
        h = _hidden(output).clone()
        h[:, 0] += steer
        return _with_hidden(output, h)
    return hook


def _last_position_steer(record):
    steer = torch.randn(64, generator=torch.Generator().manual_seed(4))

    def hook(module, args, output):  # steer each row's last prompt position, read as the rectangle's last column
        h = _hidden(output).clone()
        h[:, -1] += steer
        return _with_hidden(output, h)
    return hook


def _probe(record):
    def hook(module, args, output):  # record the residual stream of every position a forward is shown
        record(_hidden(output).detach().clone())
    return hook


def _global_probe(record):
    probe = _probe(record)
    return lambda module, args, output: probe(module, args, output) if module is _global_probe.layer else None


HOOKS = {"first position steered": _first_position_steer, "last position steered": _last_position_steer,
         "probe": _probe, "global probe": _global_probe}


@pytest.mark.parametrize("kind", list(HOOKS))
def test_hooks_of_the_callers_see_the_whole_prompt_in_stocks_shape(kind):
    # a hook may act on a position by its index in the forward, or record every position it is shown: on stock a
    # fresh call shows it the whole prompt as the padded rectangle, so a patched call must too (no prefix hit for
    # the hooked call, no packed prefill)
    model = tiny_model("llama")
    layer = model.model.layers[0]
    _global_probe.layer = layer
    ids, mask = left_padded_batch([20, 9], seed=2)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False, return_dict_in_generate=True,
              output_scores=True)

    @contextlib.contextmanager
    def hooked(records):
        fn = HOOKS[kind](lambda r: records[-1].append(r))
        if kind == "global probe":
            handle = torch.nn.modules.module.register_module_forward_hook(fn)
        else:
            handle = layer.register_forward_hook(fn)
        try:
            yield
        finally:
            handle.remove()

    want_records = [[]]
    with hooked(want_records):
        want = model.generate(**kw)
    plain = model.generate(**kw)
    assert (want.scores[0] - plain.scores[0]).abs().max() > 1e-3 or kind.endswith("probe")
    pool = PagePool.from_model(model, max_tokens=1024, page_size=4)
    astrai_hf.patch(model, pool=pool)
    try:
        records = []
        with hooked(records):  # one hook over both calls: the first call's K/V are the second's prefix
            for _ in range(2):
                records.append([])
                _assert_same_output(model.generate(**kw), want)
                assert [r.shape for r in records[-1]] == [r.shape for r in want_records[0]]
                for got, ref in zip(records[-1], want_records[0]):  # real positions (stock's padding columns see
                    real = mask[:, -got.shape[1]:].bool()  # padding K/V)
                    torch.testing.assert_close(got[real], ref[real], rtol=1e-5, atol=1e-5)
                assert _used(pool) == 0
        _assert_same_output(model.generate(**kw), plain)  # the hook gone: the prompts are cached anew, and serve
        hits = pool.stats()["prefix_hit_tokens"]
        _assert_same_output(model.generate(**kw), plain)
        assert pool.stats()["prefix_hit_tokens"] > hits
    finally:
        astrai_hf.unpatch(model)


def _steering_hook(steer: torch.Tensor, shapes: list):
    """A forward hook adding ``steer`` to the hidden state at the forward's first column, recording the shapes it
    sees in ``shapes``."""

    def hook(module, args, output):
        h = _hidden(output).clone()
        shapes.append(tuple(h.shape))
        h[:, 0] += steer
        return _with_hidden(output, h)

    return hook


def test_a_hooked_chat_continued_on_the_returned_cache_shows_the_hook_stocks_columns():
    # stock's returned cache holds the first turn's K/V (its decode steps steered too), so the next turn's hook is
    # shown only the columns after them; the rule that keeps hooked calls off the prefix cache recomputed them all
    model = tiny_model("llama")
    steer = torch.randn(64, generator=torch.Generator().manual_seed(3)) * 3
    ids, mask = left_padded_batch([16, 9], seed=2)
    more = torch.tensor([[11, 12, 13], [14, 15, 16]])
    kw = dict(max_new_tokens=5, do_sample=False, return_dict_in_generate=True, output_scores=True)
    name = astrai_hf.cache_kwarg(model)

    def chat():
        shapes = []
        handle = model.model.layers[0].register_forward_hook(_steering_hook(steer, shapes))
        try:
            first = model.generate(ids, attention_mask=mask, **kw)
            seq = torch.cat([first.sequences, more], 1)
            mask2 = torch.cat([mask, torch.ones(2, seq.shape[1] - mask.shape[1], dtype=mask.dtype)], 1)
            n = len(shapes)
            second = model.generate(seq, attention_mask=mask2, **kw, **{name: first[name]})
        finally:
            handle.remove()
        return first, second, shapes[n:]

    want = chat()
    with astrai_hf.patched(model, max_tokens=1024, page_size=4):
        got = chat()
        assert _used(astrai_hf.get_pool(model)) == 0
    _assert_same_output(got[0], want[0])
    _assert_same_output(got[1], want[1])
    assert got[2] == want[2] and want[2][0][1] == 4  # the first forward of turn 2: the 4 columns after stock's


def test_a_hooked_call_on_the_returned_cache_is_served_no_more_than_it_held_when_the_prefix_cache_holds_more():
    # an earlier hooked call cached the whole prompt; the returned cache of a shorter one holds 8 columns: stock
    # computes the columns after those 8, and the prefix cache must serve no more than the returned cache held
    model = tiny_model("llama")
    steer = torch.randn(64, generator=torch.Generator().manual_seed(3)) * 3
    prompt = torch.randint(3, 96, (1, 20), generator=torch.Generator().manual_seed(5))
    kw = dict(do_sample=False, return_dict_in_generate=True, output_scores=True)
    name = astrai_hf.cache_kwarg(model)

    def calls():
        shapes = []
        handle = model.model.layers[0].register_forward_hook(_steering_hook(steer, shapes))
        try:
            model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=2, **kw)
            short = model.generate(prompt[:, :8], attention_mask=torch.ones_like(prompt[:, :8]), max_new_tokens=1,
                                   **kw)
            n = len(shapes)
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, **kw,
                                 **{name: short[name]})
        finally:
            handle.remove()
        return out, shapes[n:]

    want = calls()
    with astrai_hf.patched(model, max_tokens=1024, page_size=4):
        got = calls()
        assert _used(astrai_hf.get_pool(model)) == 0
    _assert_same_output(got[0], want[0])
    assert got[1] == want[1] and want[1][0][1] == 12  # the call's first forward: the 12 columns after stock's 8


@pytest.mark.parametrize("mode", ["num_return_sequences", "beams"])
def test_a_hook_that_treats_the_samples_of_a_prompt_apart_gets_each_computed(mode):
    # a steering strength per sample (or beam) of one prompt: identical rows were computed once, and the hook's
    # work on the others thrown away
    model = tiny_model("llama")
    steer = torch.randn(64, generator=torch.Generator().manual_seed(3))

    def hook(module, args, output):
        h = _hidden(output)
        return _with_hidden(output, h + torch.arange(h.shape[0], dtype=h.dtype)[:, None, None] * steer)

    ids, mask = left_padded_batch([12, 7], seed=2)
    kw = dict(attention_mask=mask, max_new_tokens=5, return_dict_in_generate=True, output_scores=True,
              **(dict(do_sample=True, num_return_sequences=3) if mode == "num_return_sequences" else
                 dict(do_sample=False, num_beams=2, num_return_sequences=2)))

    def run():
        handle = model.model.layers[0].register_forward_hook(hook)
        try:
            torch.manual_seed(0)
            return model.generate(ids, **kw)
        finally:
            handle.remove()

    want = run()
    with astrai_hf.patched(model, max_tokens=1024, page_size=4):
        got = run()
        assert _used(astrai_hf.get_pool(model)) == 0
    _assert_same_output(got, want)


def test_neftune_noise_in_training_mode_is_added_as_stock_adds_it_and_never_served_later():
    # transformers' NEFTune hook scales its noise by the forward's length: it counts as a hook of the caller's
    from transformers.integrations.neftune import activate_neftune, deactivate_neftune

    model = tiny_model("llama")
    ids, mask = left_padded_batch([16, 10], seed=2)
    kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, return_dict_in_generate=True,
              output_scores=True)

    def run():
        handle = activate_neftune(model, 50.0)
        try:
            model.train()
            torch.manual_seed(0)
            noisy = model.generate(ids, **kw)
            model.eval()
            plain = model.generate(ids, **kw)
        finally:
            deactivate_neftune(model, handle)
            model.eval()
        return noisy, plain, model.generate(ids, **kw)

    want = run()
    assert (want[0].scores[0] - want[1].scores[0]).abs().max() > 1e-3  # the noise matters
    with astrai_hf.patched(model, max_tokens=1024, page_size=4):
        got = run()
        assert _used(astrai_hf.get_pool(model)) == 0
    for a, b in zip(got, want):
        _assert_same_output(a, b)


def test_peft_poly_task_ids_per_row_through_a_patched_base_model():
    # peft's pre-hooks hand each row its task id; packed, the two rows were one and the LoRA mix failed
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    config = peft.PolyConfig(task_type="CAUSAL_LM", r=4, n_tasks=3, n_skills=2, n_splits=1,
                             target_modules=["q_proj", "v_proj"])
    model = peft.get_peft_model(tiny_model("llama"), config).eval()
    ids, mask = left_padded_batch([12, 7], seed=2)
    kw = dict(attention_mask=mask, task_ids=torch.tensor([0, 1]), max_new_tokens=4, do_sample=False)
    want = model.generate(input_ids=ids, **kw)
    base = model.base_model.model
    with astrai_hf.patched(base, max_tokens=1024, page_size=4):
        assert torch.equal(model.generate(input_ids=ids, **kw), want)
        assert _used(astrai_hf.get_pool(base)) == 0


def test_transformers_own_output_hooks_keep_the_cached_prefixes():
    # the first forward asking for hidden states makes transformers install output-capturing hooks for good;
    # they only record outputs, so they do not make the cached K/V stale
    model = tiny_model("llama")
    ids, mask = left_padded_batch([20, 9], seed=2)
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False)
    pool = PagePool.from_model(model, max_tokens=2048)
    astrai_hf.patch(model, pool=pool)
    try:
        model.generate(ids, **kw)
        with torch.no_grad():
            model(ids, attention_mask=mask, output_hidden_states=True)
        assert any(m._forward_hooks for m in model.modules())
        hits = pool.stats()["prefix_hit_tokens"]
        model.generate(ids, **kw)
        assert pool.stats()["prefix_hit_tokens"] > hits
    finally:
        astrai_hf.unpatch(model)


def test_patch_and_unpatch_of_a_torch_compile_wrapper_act_on_the_model_it_wraps():
    model = tiny_model("llama")
    ids, mask = left_padded_batch([9, 14, 5], seed=3)
    kw = dict(attention_mask=mask, max_new_tokens=3, do_sample=False)
    ref = model.generate(ids, **kw)
    compiled = torch.compile(model)
    assert astrai_hf.cache_kwarg(compiled) == astrai_hf.cache_kwarg(model)  # (the wrapper's forward takes **kwargs)
    before = set(model.__dict__)
    assert astrai_hf.patch(compiled, max_tokens=1024) is compiled
    assert astrai_hf.is_patched(compiled) and astrai_hf.is_patched(model)
    assert torch.equal(compiled.generate(ids, **kw), ref)
    assert astrai_hf.get_pool(compiled).stats()["prefix_query_tokens"] > 0  # it ran paged
    astrai_hf.unpatch(compiled)
    assert not astrai_hf.is_patched(model) and set(model.__dict__) == before


@pytest.mark.parametrize("compiled", ["the model", "its forward", "its patched forward"])
def test_fullgraph_compiles_score_as_stock_and_refuse_a_paged_generate_by_name(compiled):
    # torch.compile(model, fullgraph=True): a scoring forward (no cache) had failed on the patch's call lock, and a
    # patched generate() with a fullgraph forward failed on a raw dynamo error about a weak reference
    model = tiny_model("llama")
    ids, mask = left_padded_batch([7, 4, 9])
    kw = dict(attention_mask=mask, max_new_tokens=3, do_sample=False)
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits
    tokens = model.generate(ids, **kw)
    if compiled == "the model":
        target = torch.compile(model, backend="eager", fullgraph=True)
    elif compiled == "its forward":
        model.forward = target = torch.compile(model.forward, backend="eager", fullgraph=True)
    astrai_hf.patch(model, max_tokens=1024)
    if compiled == "its patched forward":  # (dynamo traces the patch's wrapper, which had failed on its lock)
        model.forward = target = torch.compile(model.forward, backend="eager", fullgraph=True)
    try:
        with torch.no_grad():
            assert torch.equal(target(ids, attention_mask=mask).logits, ref)
        if compiled == "the model":  # (generate() runs the model's own forward, not the compiled wrapper's call)
            assert torch.equal(target.generate(ids, **kw), tokens)
        else:
            with pytest.raises(NotImplementedError, match=r"LlamaForCausalLM's forward \(or a module of it\) is "
                                                          r"compiled with torch.compile\(fullgraph=True\).*compile "
                                                          r"without fullgraph=True, or astrai_hf.unpatch\(model\)"):
                model.generate(ids, **kw)
        assert astrai_hf.get_pool(model).stats()["num_used_pages"] == 0
    finally:
        astrai_hf.unpatch(model)


def test_the_patched_forward_compiled_without_fullgraph_generates_paged_and_as_stock():
    model = tiny_model("llama")
    ids, mask = left_padded_batch([7, 4, 9])
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False)
    want = model.generate(ids, **kw)
    astrai_hf.patch(model, max_tokens=1024)
    try:
        model.forward = torch.compile(model.forward, backend="eager")
        assert torch.equal(model.generate(ids, **kw), want)
        stats = astrai_hf.get_pool(model).stats()
        assert stats["prefix_query_tokens"] > 0 and stats["num_used_pages"] == 0  # (it ran paged)
    finally:
        astrai_hf.unpatch(model)


def test_a_config_copied_or_saved_by_a_hook_during_a_paged_forward_holds_nothing_of_astrai_hf(tmp_path):
    # the implementation a config selects outside a paged forward had been noted on the config, so a config saved by
    # a checkpointing hook mid-forward carried the note into config.json
    import json

    model = tiny_model("llama")
    ids, mask = left_padded_batch([7, 4])
    saved = []
    model.lm_head.register_forward_hook(
        lambda *a: saved.append(model.config.to_dict()) or model.config.save_pretrained(tmp_path))
    with astrai_hf.patched(model, max_tokens=1024):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
    assert saved and not [k for d in saved for k in d if "astrai" in k]
    assert "astrai" not in json.dumps(json.loads((tmp_path / "config.json").read_text()))


def test_the_multi_turn_recipe_passing_the_returned_cache_back_leaves_nothing_used():
    model = tiny_model("llama")
    ids, mask = left_padded_batch([12, 7], seed=1)
    more = torch.randint(3, 96, (2, 4), generator=torch.Generator().manual_seed(2))
    kw = dict(max_new_tokens=5, do_sample=False, return_dict_in_generate=True)

    def two_turns():
        out = model.generate(ids, attention_mask=mask, **kw)
        seq = torch.cat([out.sequences, more], 1)
        mask2 = torch.cat([mask, torch.ones(2, seq.shape[1] - mask.shape[1], dtype=mask.dtype)], 1)
        return model.generate(seq, attention_mask=mask2, past_key_values=out.past_key_values, **kw).sequences

    ref = two_turns()
    with astrai_hf.patched(model, max_tokens=1024, page_size=4):
        assert torch.equal(two_turns(), ref)
        s = astrai_hf.get_pool(model).stats()
        assert s["num_used_pages"] == 0 and s["prefix_hit_tokens"] > 0  # the second turn reused the first


@pytest.mark.parametrize("edit", [None, 14, "embeds", "first-turn-embeds"],
                         ids=["same-tokens", "a-generated-token-edited", "embeds", "first-turn-embeds"])
def test_hidden_states_and_attentions_of_a_turn_on_the_returned_cache_cover_stocks_positions(edit):
    # stock's cache holds the first turn's K/V, so its first forward covers only the columns after them; the
    # patched call, which recomputes the prompt for per-position outputs, had returned every column (after a first
    # turn of inputs_embeds, which records no tokens, too)
    model = tiny_model("llama", attn_implementation="eager")
    ids, mask = left_padded_batch([12, 7], seed=1)
    more = torch.randint(3, 96, (2, 3), generator=torch.Generator().manual_seed(2))
    kw = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True)

    def turns():
        if edit == "first-turn-embeds":
            out = model.generate(inputs_embeds=model.get_input_embeddings()(ids).detach(), attention_mask=mask, **kw)
            seq = torch.cat([ids, out.sequences, more], 1)  # (sequences: the new tokens alone)
        else:
            out = model.generate(ids, attention_mask=mask, **kw)
            seq = torch.cat([out.sequences, more], 1)
        if isinstance(edit, int):
            seq[0, edit] = (seq[0, edit] + 1) % 96
        m = torch.cat([mask, torch.ones(2, seq.shape[1] - mask.shape[1], dtype=mask.dtype)], 1)
        fed = dict(inputs_embeds=model.get_input_embeddings()(seq).detach()) if edit == "embeds" else dict(inputs=seq)
        return model.generate(**fed, attention_mask=m, past_key_values=out.past_key_values, output_hidden_states=True,
                              output_attentions=True, **kw)

    ref = turns()
    with astrai_hf.patched(model, max_tokens=1024, page_size=4):
        got = turns()
        assert _used(astrai_hf.get_pool(model)) == 0
    assert torch.equal(got.sequences, ref.sequences)
    for name in ("hidden_states", "attentions"):
        for step, ref_step in zip(getattr(got, name), getattr(ref, name)):
            for a, b in zip(step, ref_step):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("edit", ["a prompt token", "a generated token", "nothing"])
def test_the_returned_cache_passed_back_with_other_tokens_in_its_columns_gives_stocks_tokens(edit):
    # a chat template tokenizes the earlier answer otherwise than it was generated: stock's returned cache still
    # holds the K/V of the tokens it computed and uses them for those columns; the patched call had computed the
    # new prompt's tokens afresh (other tokens)
    model = tiny_model("llama")
    ids, mask = left_padded_batch([12, 7], seed=1)
    more = torch.randint(3, 96, (2, 4), generator=torch.Generator().manual_seed(2))
    kw = dict(max_new_tokens=5, do_sample=False, return_dict_in_generate=True, output_scores=True)
    column = {"a prompt token": 6, "a generated token": 14, "nothing": None}[edit]

    def turns():
        out, m, scores = model.generate(ids, attention_mask=mask, **kw), mask, []
        for _ in range(2):
            seq = torch.cat([out.sequences, more], 1)
            if column is not None:
                seq[0, column] = (seq[0, column] + 1) % 96
            m = torch.cat([m, torch.ones(2, seq.shape[1] - m.shape[1], dtype=m.dtype)], 1)
            out = model.generate(seq, attention_mask=m, past_key_values=out.past_key_values, **kw)
            scores.append(torch.stack(out.scores))
        return out.sequences, scores

    ref, ref_scores = turns()
    with astrai_hf.patched(model, max_tokens=1024, page_size=4):
        got, scores = turns()
        assert torch.equal(got, ref)
        for a, b in zip(scores, ref_scores):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        s = astrai_hf.get_pool(model).stats()
        assert s["num_used_pages"] == 0 and s["prefix_hit_tokens"] > 0


def test_the_returned_cache_of_several_samples_per_prompt_passed_back_with_other_tokens_gives_stocks_tokens():
    # stock's cache holds one row per returned sequence: the call had computed the edited columns afresh
    model = tiny_model("llama")
    ids, mask = left_padded_batch([12, 7], seed=1)
    more = torch.randint(3, 96, (4, 3), generator=torch.Generator().manual_seed(2))

    def turns():
        torch.manual_seed(0)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=True, num_return_sequences=2,
                             return_dict_in_generate=True)
        seq = torch.cat([out.sequences, more], 1)
        seq[:, 8] = (seq[:, 8] + 1) % 96
        m = torch.cat([mask.repeat_interleave(2, 0), torch.ones(4, seq.shape[1] - mask.shape[1], dtype=mask.dtype)], 1)
        return model.generate(seq, attention_mask=m, past_key_values=out.past_key_values, max_new_tokens=4,
                              do_sample=False, return_dict_in_generate=True, output_scores=True)

    ref = turns()
    with astrai_hf.patched(model, max_tokens=1024, page_size=4):
        got = turns()
        assert torch.equal(got.sequences, ref.sequences)
        torch.testing.assert_close(torch.stack(got.scores), torch.stack(ref.scores), rtol=1e-4, atol=1e-4)
        assert astrai_hf.get_pool(model).stats()["num_used_pages"] == 0


_ROPES_BY_LENGTH = {
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    # short factors up to position 16, long ones past it (head_dim 16: 8 factors each)
    "longrope": {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [4.0] * 8, "factor": 4.0,
                 "rope_theta": 10000.0, "original_max_position_embeddings": 16},
}


@pytest.mark.parametrize("kind", list(_ROPES_BY_LENGTH))
@pytest.mark.parametrize("where", ["config", "module swapped before patch", "module swapped after patch"])
def test_a_rope_that_depends_on_the_forwards_length_gets_no_prefix_reuse_and_no_chunks(where, kind):
    # a rotary module built from a dynamic-NTK config swapped into a model whose config still says "default" (a
    # context-extension recipe): prefixes had been reused, rotated for a shorter forward (scores 1.45 off); a
    # longrope model's chunks below its original length had taken the short factors (scores 1.7e-3 off)
    rope = _ROPES_BY_LENGTH[kind]

    def swap_rotary(m):
        config = copy.deepcopy(m.config)
        config.rope_parameters = rope
        m.model.rotary_emb = type(m.model.rotary_emb)(config=config)

    def fresh():  # dynamic RoPE keeps state between forwards: each run starts from a new model
        m = tiny_model("llama", max_position_embeddings=32, **({"rope_parameters": rope} if where == "config" else {}))
        with torch.no_grad():
            m.get_output_embeddings().weight.div_(3.0)
        if where != "config":
            swap_rotary(m)
        return m

    kw = dict(max_new_tokens=10, do_sample=False, output_scores=True, return_dict_in_generate=True)
    ids, mask = left_padded_batch([40, 26], seed=0)
    ref = fresh().generate(ids, attention_mask=mask, **kw)
    for chunk in (None, 16):
        model = fresh()
        if where == "module swapped after patch":
            model.model.rotary_emb = type(model.model.rotary_emb)(config=model.config)  # default until patched
        with astrai_hf.patched(model, max_tokens=2048, max_seq_len=128, prefill_chunk_tokens=chunk):
            if where == "module swapped after patch":
                swap_rotary(model)
            model.generate(ids[1:], attention_mask=mask[1:], max_new_tokens=2, do_sample=False)  # a shorter forward
            got = model.generate(ids, attention_mask=mask, **kw)
            assert astrai_hf.get_pool(model).stats()["prefix_hit_tokens"] == 0
        assert torch.equal(got.sequences, ref.sequences)
        for a, b in zip(got.scores, ref.scores):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bound", [True, False], ids=["pool bound to the model", "pool from its config, no model"])
def test_a_callers_cache_on_a_model_whose_rope_depends_on_the_forwards_length_is_not_pre_filled(bound):
    # a pool built from the config alone, and a cache told no model, had reused prefixes (scores 1.4e-3 off)
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    model = tiny_model("llama", max_position_embeddings=32, rope_parameters=rope)
    ids, mask = left_padded_batch([40, 26], seed=0)
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False)
    if bound:
        pool = PagePool.from_model(model, max_tokens=2048, page_size=4, max_seq_len=128)
    else:
        pool = PagePool(model.config, max_tokens=2048, page_size=4, max_seq_len=128)
    for _ in range(2):
        with PagedCache(pool, ids, mask, model=model if bound else None) as cache:
            assert cache.get_seq_length() == 0  # a prefix rotated for another forward's length is not stock's
            model.generate(ids, **kw, past_key_values=cache)
    assert pool.stats()["prefix_hit_tokens"] == 0 and _used(pool) == 0


@pytest.mark.parametrize("output", ["output_hidden_states", "output_attentions"])
def test_a_pre_filled_cache_of_the_callers_starts_empty_in_a_call_asking_for_every_prompt_positions_outputs(output):
    model = tiny_model("llama")
    model.set_attn_implementation("eager")
    ids, mask = left_padded_batch([5, 8, 3], seed=0)
    kw = dict(attention_mask=mask, max_new_tokens=3, do_sample=False, return_dict_in_generate=True, output_scores=True,
              **{output: True})
    ref = model.generate(ids, **kw)
    with astrai_hf.patched(model, max_tokens=1024, page_size=4) as patched:
        pool = astrai_hf.get_pool(patched)
        patched.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)  # fills the prefix cache
        with PagedCache(pool, ids, mask) as cache:
            assert cache.get_seq_length() > 0  # pre-filled
            got = patched.generate(ids, **kw, **{astrai_hf.cache_kwarg(patched): cache})
        assert torch.equal(got.sequences, ref.sequences)
        field = "hidden_states" if output == "output_hidden_states" else "attentions"
        for step_got, step_ref in zip(getattr(got, field), getattr(ref, field)):
            for a, b in zip(step_got, step_ref):
                assert a.shape == b.shape  # every prompt position, as stock's fresh cache gives
        for a, b in zip(getattr(got, field)[0], getattr(ref, field)[0]):
            real = mask.bool()[:, :, None] if a.dim() == 3 else mask.bool()[:, None, :, None]
            torch.testing.assert_close(a * real, b * real, rtol=1e-5, atol=1e-5)
        assert _used(pool) == 0


@pytest.mark.parametrize("extra", ["output_hidden_states", "prompt_lookup_num_tokens"])
def test_a_pre_filled_cache_whose_chosen_rows_hold_only_padding_of_the_cached_columns_still_starts_empty(extra):
    # rows chosen before the first forward whose hits are all 0 (the cached columns are their padding): the cache
    # had stayed 9 columns long in a call that skips the prefix cache (3 hidden-state positions of stock's 12, or
    # candidate decoding refused as the prompt fed again)
    model = tiny_model("llama", seed=3)
    ids, mask = left_padded_batch([3, 12], seed=7)
    one, m1 = ids[:1], mask[:1]
    kw = dict(attention_mask=m1, max_new_tokens=3, do_sample=False, return_dict_in_generate=True, output_scores=True)
    kw[extra] = True if extra == "output_hidden_states" else 2
    ref = model.generate(one, **kw)
    with astrai_hf.patched(model, max_tokens=2048, page_size=4) as patched:
        pool = astrai_hf.get_pool(patched)
        patched.generate(ids[1:], attention_mask=mask[1:], max_new_tokens=1, do_sample=False)
        with PagedCache(pool, ids, mask) as cache:
            assert cache.prefix_hit_tokens == [0, 9]
            cache.batch_select_indices(torch.tensor([0]))
            assert cache.get_seq_length() == 9 and cache.prefix_hit_tokens == [0]
            got = patched.generate(one, **kw, **{astrai_hf.cache_kwarg(patched): cache})
        assert torch.equal(got.sequences, ref.sequences)
        for a, b in zip(got.scores, ref.scores):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        if extra == "output_hidden_states":
            assert [h.shape for h in got.hidden_states[0]] == [h.shape for h in ref.hidden_states[0]]
        assert _used(pool) == 0


@pytest.mark.parametrize("arch,inputs", [("llama", "inputs_embeds"), ("gpt2", "token_type_ids")])
def test_a_callers_cache_in_a_call_with_custom_inputs_leaves_nothing_in_the_prefix_cache(arch, inputs):
    # K/V computed from the caller's embeddings (or token types) had gone into the prefix cache under the prompt's
    # ids, and a later plain call was served them (scores 1.8 off)
    model = tiny_model(arch)
    ids, mask = left_padded_batch([9, 6], seed=1)
    kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, return_dict_in_generate=True, output_scores=True)
    ref = model.generate(ids, **kw)
    custom = (dict(inputs_embeds=model.get_input_embeddings()(ids).detach() * 1.7) if inputs == "inputs_embeds"
              else dict(input_ids=ids, token_type_ids=torch.ones_like(ids)))
    with astrai_hf.patched(model, max_tokens=1024, page_size=4) as patched:
        pool = astrai_hf.get_pool(patched)
        with PagedCache(pool, ids, mask) as cache:
            patched.generate(**custom, **kw, **{astrai_hf.cache_kwarg(patched): cache})
        assert pool.stats()["num_cached_pages"] == 0
        got = patched.generate(ids, **kw)
        assert pool.stats()["prefix_hit_tokens"] == 0
    assert torch.equal(got.sequences, ref.sequences)
    for a, b in zip(got.scores, ref.scores):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert _used(pool) == 0


@pytest.mark.parametrize("reuse", ["release", "reset"])
def test_a_callers_cache_used_again_after_a_call_that_skipped_the_prefix_cache_fills_it_again(reuse):
    # leaving the prefix cache for one call (here: every position's hidden states) had been for good: the same
    # cache object in later plain calls filled nothing, so a repeat of the prompt got no hit
    model = tiny_model("llama")
    ids, mask = left_padded_batch([12, 9], seed=1)
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False)
    ref = model.generate(ids, **kw)
    with astrai_hf.patched(model, max_tokens=1024, page_size=4) as patched:
        pool = astrai_hf.get_pool(patched)
        kwarg = astrai_hf.cache_kwarg(patched)
        cache = PagedCache(pool)
        patched.generate(ids, output_hidden_states=True, return_dict_in_generate=True, **kw, **{kwarg: cache})
        getattr(cache, reuse)()
        assert pool.stats()["num_cached_pages"] == 0
        assert torch.equal(patched.generate(ids, **kw, **{kwarg: cache}), ref)
        getattr(cache, reuse)()
        assert pool.stats()["num_cached_pages"] > 0
        assert torch.equal(patched.generate(ids, **kw), ref)
        assert pool.stats()["prefix_hit_tokens"] == 19
        indexed = pool.stats()["prefix_cache_pages"]
        with PagedCache(pool, prefix_cache=False) as chosen:  # a choice made at construction stays
            for _ in range(2):
                patched.generate(ids[:1], attention_mask=mask[:1], max_new_tokens=9, do_sample=False,
                                 **{kwarg: chosen})
                chosen.release()
        assert pool.stats()["prefix_cache_pages"] == indexed
        assert _used(pool) == 0


def test_a_callers_cache_emptied_inside_a_call_that_skips_the_prefix_cache_fills_nothing():
    # the cache, holding another prompt, is emptied for this one inside the call (fit_to); the emptying had put it
    # back into the prefix cache, so the token types' K/V were served to a later plain call (logits 0.17 off)
    model = tiny_model("gpt2")
    g = torch.Generator().manual_seed(1)
    first, second = torch.randint(3, 96, (1, 20), generator=g), torch.randint(3, 96, (1, 20), generator=g)
    later = torch.cat([second, torch.randint(3, 96, (1, 5), generator=g)], 1)
    kw = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_scores=True)
    ref = model.generate(later, attention_mask=torch.ones_like(later), **kw)
    with astrai_hf.patched(model, max_tokens=2048) as patched:
        pool = astrai_hf.get_pool(patched)
        kwarg = astrai_hf.cache_kwarg(patched)
        with PagedCache(pool) as cache:
            patched.generate(first, attention_mask=torch.ones_like(first), **kw, **{kwarg: cache})
            patched.generate(second, attention_mask=torch.ones_like(second), token_type_ids=torch.zeros_like(second),
                             **kw, **{kwarg: cache})
        assert pool.stats()["prefix_cache_pages"] == 0
        got = patched.generate(later, attention_mask=torch.ones_like(later), **kw)
        assert pool.stats()["prefix_hit_tokens"] == 0
    assert torch.equal(got.sequences, ref.sequences)
    for a, b in zip(got.scores, ref.scores):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert _used(pool) == 0


def test_a_chat_continued_on_the_returned_cache_past_a_pad_token_the_model_emitted_equals_stock():
    # no mask: generate() masks the pad token in the new columns only, stock's cache having attended it. The
    # call had been refused, then run from scratch with it masked in every column (logits 0.016 off)
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 96, (1, 12), generator=g)
    emitted = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False)
    model.generation_config.pad_token_id = emitted[0, 14].item()  # a token the model emits inside its answer
    extra = torch.randint(3, 96, (1, 5), generator=g)
    extra[extra == model.generation_config.pad_token_id] = 3
    name = "cache" if astrai_hf.cache_kwarg(model) == "cache" else "past_key_values"

    def two_turns(m):
        out = m.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False,
                         return_dict_in_generate=True)
        return m.generate(torch.cat([out.sequences, extra], 1), max_new_tokens=6, do_sample=False,
                          return_dict_in_generate=True, output_scores=True, **{name: getattr(out, name)})

    ref = two_turns(model)
    with astrai_hf.patched(model, max_tokens=2048) as patched:
        got = two_turns(patched)
        assert _used(astrai_hf.get_pool(patched)) == 0
    assert torch.equal(got.sequences, ref.sequences)
    for a, b in zip(got.scores, ref.scores):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_gradients_of_the_inputs_of_a_frozen_model_equal_stock():
    model = tiny_model("llama")
    model.requires_grad_(False)  # prompt tuning, saliency: only the inputs require grad
    ids, mask = left_padded_batch([7, 10, 4])
    pool = PagePool.from_model(model, max_tokens=1024, page_size=4)

    def input_grads(cache):
        embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
        out = model(inputs_embeds=embeds, attention_mask=mask, past_key_values=cache, use_cache=True)
        out.logits[:, -1].logsumexp(-1).sum().backward()
        return out.logits[:, -1].detach(), embeds.grad

    want_logits, want_grad = input_grads(transformers.DynamicCache())
    for patched in (False, True):
        with astrai_hf.patched(model, pool=pool) if patched else contextlib.nullcontext():
            with PagedCache(pool, prefix_cache=False) as cache:
                logits, grad = input_grads(cache)
        torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-6)
        assert _used(pool) == 0


@pytest.mark.parametrize("patched", [False, True])
def test_a_loss_over_two_forwards_warns_that_the_first_ones_kv_carry_no_gradient(patched):
    # the second forward attends to K/V the first stored with their graph in a DynamicCache, as constants in the
    # pool: the loss is stock's, the gradients are not (77% off on k_proj), which had passed in silence
    model = tiny_model("llama")
    ids, mask = left_padded_batch([7, 5])
    pool = PagePool.from_model(model, max_tokens=1024, page_size=4)
    nxt = torch.full((2, 1), 5)
    mask2 = torch.cat([mask, torch.ones_like(nxt)], 1)
    with astrai_hf.patched(model, pool=pool) if patched else contextlib.nullcontext():
        with PagedCache(pool, prefix_cache=False) as cache, pytest.warns(UserWarning, match="gradients do not flow"):
            model(ids, attention_mask=mask, past_key_values=cache)
            model(nxt, attention_mask=mask2, past_key_values=cache).logits.sum().backward()
        with PagedCache(pool, prefix_cache=False) as cache, warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # K/V stored without autograd are constants in stock's cache too
            with torch.no_grad():
                model(ids, attention_mask=mask, past_key_values=cache)
            model(nxt, attention_mask=mask2, past_key_values=cache).logits.sum().backward()
    assert _used(pool) == 0


def test_a_decode_step_whose_query_requires_grad_through_a_hook_runs():
    """A learnable steering vector added by a forward hook (neither a parameter nor an input) makes the decode
    step's query require grad where astrai-hf cannot see it coming: paged attention must stay differentiable."""
    model = tiny_model("llama").requires_grad_(False)
    delta = torch.zeros(model.config.hidden_size, requires_grad=True)
    handle = model.get_input_embeddings().register_forward_hook(lambda m, i, o: o + delta)
    ids = torch.randint(3, 90, (2, 6), generator=torch.Generator().manual_seed(0))
    nxt = torch.randint(3, 90, (2, 1), generator=torch.Generator().manual_seed(1))

    def decode(cache):
        delta.grad = None
        model(ids, past_key_values=cache, use_cache=True)
        out = model(nxt, past_key_values=cache, use_cache=True)
        out.logits.sum().backward()
        return out.logits.detach(), delta.grad

    try:
        want, _ = decode(transformers.DynamicCache())
        pool = PagePool.from_model(model, max_tokens=256, page_size=4)
        with astrai_hf.patched(model, pool=pool), PagedCache(pool) as cache:
            logits, grad = decode(cache)
    finally:
        handle.remove()
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0
    assert _used(pool) == 0


def test_a_model_built_under_inference_mode_can_be_patched():
    with torch.inference_mode():
        model = tiny_model("llama")  # inference tensors: no version counters
    ids, mask = left_padded_batch([7, 10, 4])
    ref = model.generate(ids, attention_mask=mask, **GREEDY)
    with astrai_hf.patched(model, max_tokens=1024, page_size=4):
        for _ in range(2):
            assert torch.equal(model.generate(ids, attention_mask=mask, **GREEDY), ref)
        s = astrai_hf.get_pool(model).stats()
        assert s["prefix_hit_tokens"] > 0 and s["num_used_pages"] == 0


def test_weights_loaded_in_place_under_inference_mode_empty_the_prefix_cache():
    # inference tensors keep no version counter, and load_state_dict() inside inference_mode() writes them in place:
    # the prefix cache had served the old weights' K/V
    ids, mask = left_padded_batch([20, 12], seed=1)
    with torch.inference_mode():
        model, other = tiny_model("llama"), tiny_model("llama", seed=5)
        want = other.generate(ids, attention_mask=mask, **GREEDY)
        with astrai_hf.patched(model, max_tokens=1024, page_size=4):
            pool = astrai_hf.get_pool(model)
            model.generate(ids, attention_mask=mask, **GREEDY)
            model.load_state_dict(other.state_dict())
            hits = pool.stats()["prefix_hit_tokens"]
            assert torch.equal(model.generate(ids, attention_mask=mask, **GREEDY), want)
            assert pool.stats()["prefix_hit_tokens"] == hits
            model.generate(ids, attention_mask=mask, **GREEDY)  # unchanged weights: the prefix cache serves again
            assert pool.stats()["prefix_hit_tokens"] > hits


@pytest.mark.parametrize("move", ["rows", "columns", "one pair"])
def test_values_moved_under_inference_mode_empty_the_prefix_cache(move):
    # inference tensors keep no version counter; a plain sum of each misses values that only moved (rows or heads
    # swapped, a permuted checkpoint loaded in place), so the prefix cache served the K/V of the weights before
    ids, mask = left_padded_batch([20, 12], seed=1)
    with torch.inference_mode():
        model, ref = tiny_model("llama"), tiny_model("llama")
        with astrai_hf.patched(model, max_tokens=1024, page_size=4):
            pool = astrai_hf.get_pool(model)
            model.generate(ids, attention_mask=mask, **GREEDY)
            for m in (model, ref):
                w = m.model.layers[0].self_attn.q_proj.weight
                if move == "rows":
                    w[[0, 5]] = w[[5, 0]].clone()
                elif move == "columns":
                    w[:, [0, 5]] = w[:, [5, 0]].clone()
                else:
                    w[0, 0], w[5, 3] = w[5, 3].clone(), w[0, 0].clone()
            want = ref.generate(ids, attention_mask=mask, **GREEDY, return_dict_in_generate=True, output_scores=True)
            hits = pool.stats()["prefix_hit_tokens"]
            got = model.generate(ids, attention_mask=mask, **GREEDY, return_dict_in_generate=True, output_scores=True)
            _assert_same_output(got, want)
            assert pool.stats()["prefix_hit_tokens"] == hits


def test_a_submodule_swapped_for_one_of_the_same_class_empties_the_prefix_cache():
    # a new instance whose settings are ints or strings (Softplus(beta=8), GELU(approximate="tanh")), which the
    # settings check leaves out: only its identity tells it apart
    model = tiny_model("llama")
    for layer in model.model.layers:
        layer.mlp.act_fn = torch.nn.Softplus(beta=1)
    ids, mask = left_padded_batch([20, 12], seed=1)
    kw = dict(attention_mask=mask, **GREEDY, return_dict_in_generate=True, output_scores=True)
    with astrai_hf.patched(model, max_tokens=1024, page_size=4):
        pool = astrai_hf.get_pool(model)
        model.generate(ids, **kw)
        for layer in model.model.layers:
            layer.mlp.act_fn = torch.nn.Softplus(beta=8)
        hits = pool.stats()["prefix_hit_tokens"]
        got = model.generate(ids, **kw)
        assert pool.stats()["prefix_hit_tokens"] == hits
        model.generate(ids, **kw)
        assert pool.stats()["prefix_hit_tokens"] > hits  # unchanged since: the prefix cache serves again
    _assert_same_output(got, model.generate(ids, **kw))


def test_overriding_the_models_cache_implementation_adds_no_generation_argument():
    import logging

    seen = []

    class Collect(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    from transformers.utils import logging as hf_logging

    handler = Collect()
    logging.getLogger("transformers").addHandler(handler)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_warning()  # the tests run with transformers' warnings off
    try:
        model = tiny_model("llama")
        model.generation_config.cache_implementation = "static"
        ids, mask = left_padded_batch([7, 10, 4])
        config = GenerationConfig(max_new_tokens=6, do_sample=False, pad_token_id=0)
        with astrai_hf.patched(model, max_tokens=1024):
            model.generate(ids, config, attention_mask=mask)
            assert astrai_hf.get_pool(model).stats()["prefix_query_tokens"] > 0  # it ran paged
        assert model.generation_config.cache_implementation == "static"  # the model's own config, as it was
    finally:
        logging.getLogger("transformers").removeHandler(handler)
        hf_logging.set_verbosity(verbosity)
    assert not [m for m in seen if "generation-related arguments" in m]


def test_an_attention_function_of_the_callers_runs_as_stock():
    # AttentionInterface.register + a config that names it (research code: a temperature, a probe): paged attention
    # does not stand in for it; generate() runs stock, and a cache of the caller's runs the function over the pool
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    calls = []

    def hot(module, query, key, value, attention_mask, scaling=None, **kwargs):
        calls.append(module.layer_idx)
        scaling = (scaling or query.shape[-1] ** -0.5) * 3.0
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    AttentionInterface.register("astrai_test_hot", hot)
    model = tiny_model("llama")
    ids, mask = left_padded_batch([5, 9, 3], seed=1)
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False)
    plain = model.generate(ids, **kw)
    model.config._attn_implementation = "astrai_test_hot"
    ref = model.generate(ids, **kw)
    assert calls and not torch.equal(ref, plain)
    model.config._attn_implementation = "sdpa"
    with astrai_hf.patched(model, max_tokens=1024, page_size=4) as patched:
        pool = astrai_hf.get_pool(patched)
        patched.generate(ids, **kw)  # fills the prefix cache under sdpa
        model.config._attn_implementation = "astrai_test_hot"
        calls.clear()
        for _ in range(2):
            assert torch.equal(patched.generate(ids, **kw), ref)
        assert calls
        with PagedCache(pool, ids, mask) as cache:  # pre-filled from sdpa's prefixes: starts empty instead
            assert torch.equal(patched.generate(ids, **kw, **{astrai_hf.cache_kwarg(patched): cache}), ref)
        model.config._attn_implementation = "sdpa"
        assert torch.equal(patched.generate(ids, **kw), plain)
        assert _used(pool) == 0


@pytest.mark.parametrize("part", ["self_attn", "layer", "every layer"])
def test_an_attention_module_deep_copied_after_patch(part):
    # the copy (its own config object) is patched on the next call as patch() patched the first ones
    model = tiny_model("llama")
    ids, mask = left_padded_batch([5, 9, 3], seed=2)
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False)
    ref = model.generate(ids, **kw)
    with astrai_hf.patched(model, max_tokens=1024, page_size=4):
        model.generate(ids, **kw)
        layers = model.model.layers
        if part == "self_attn":
            layers[0].self_attn = copy.deepcopy(layers[0].self_attn)
        elif part == "layer":
            layers[1] = copy.deepcopy(layers[1])
        else:
            model.model.layers = copy.deepcopy(layers)
        for _ in range(2):
            assert torch.equal(model.generate(ids, **kw), ref)
        pool = astrai_hf.get_pool(model)
        with PagedCache(pool) as cache:
            assert torch.equal(model.generate(ids, **kw, **{astrai_hf.cache_kwarg(model): cache}), ref)
        assert _used(pool) == 0


@pytest.mark.parametrize("window", [2, None])
def test_a_sliding_window_changed_in_the_config_drops_the_cached_prefixes(window):
    # Mistral reads config.sliding_window at every forward
    model = tiny_model("mistral", sliding_window=5)
    ids, mask = left_padded_batch([20, 35, 18], seed=3)
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False)
    with astrai_hf.patched(model, max_tokens=4096, page_size=4):
        model.generate(ids, **kw)
        model.config.sliding_window = window
        hits = astrai_hf.get_pool(model).stats()["prefix_hit_tokens"]
        out = model.generate(ids, **kw)
        assert astrai_hf.get_pool(model).stats()["prefix_hit_tokens"] == hits
    assert torch.equal(out, model.generate(ids, **kw))


def _all_full(model):
    model.config.layer_types = ["full_attention"] * len(model.config.layer_types)


def _window_set_on_modules(model):
    for layer in model.model.layers:
        layer.self_attn.sliding_window = 2  # stock's sdpa reads the window from the config's mask, not from here


def _window_model(arch):
    """A tiny model of a family whose attention modules copy the sliding window from the config in __init__."""
    extra = {
        "exaone4": (transformers.Exaone4Config, transformers.Exaone4ForCausalLM, dict(
            num_key_value_heads=2, num_hidden_layers=3, sliding_window=5,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"])),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, dict(
            num_key_value_heads=2, head_dim=16, use_sliding_window=True, sliding_window=5, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=32)),
        # the window set from a flag the "sliding_attention" test set (self.is_local_attention)
        "afmoe": (transformers.AfmoeConfig, transformers.AfmoeForCausalLM, dict(
            num_key_value_heads=2, head_dim=16, sliding_window=5, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, layer_types=["sliding_attention", "full_attention"])),
        "laguna": (transformers.LagunaConfig, transformers.LagunaForCausalLM, dict(
            num_key_value_heads=2, head_dim=16, sliding_window=5, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, layer_types=["sliding_attention", "full_attention"])),
    }
    if arch not in extra:
        return tiny_model(arch)
    import tiny_models

    config_cls, model_cls, kwargs = extra[arch]
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**tiny_models._COMMON, **kwargs})).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(3.0)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = tiny_models.PAD, None
    return model


@pytest.mark.parametrize("arch", ["qwen2", "gemma2", "gemma3", "exaone4", "qwen3_moe", "afmoe", "laguna"])
@pytest.mark.parametrize("edit", [
    lambda m: setattr(m.config, "sliding_window", 2), lambda m: setattr(m.config, "sliding_window", 12),
    _all_full, _window_set_on_modules,
], ids=["window-2", "window-12", "layer-types-all-full", "module-attribute"])
@pytest.mark.parametrize("before_patch", [False, True], ids=["after-patch", "before-patch"])
def test_a_window_copied_by_the_attention_modules_follows_a_config_edited_since(arch, edit, before_patch):
    # these families copy config.sliding_window into each attention module once, in __init__; stock sdpa applies
    # the config's window (through the mask) at every forward
    model = _window_model(arch)
    if edit is _all_full and getattr(model.config, "layer_types", None) is None:
        pytest.skip(f"{arch} has no layer types")
    ids, mask = left_padded_batch([20, 35, 18], seed=3)
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False)
    before = model.generate(ids, **kw)
    if before_patch:
        edit(model)
    with astrai_hf.patched(model, max_tokens=4096, page_size=4):
        model.generate(ids, **kw)  # warms the prefix cache
        if not before_patch:
            edit(model)
        out = model.generate(ids, **kw)
        pool = astrai_hf.get_pool(model)
        with PagedCache(pool, ids, mask) as cache:  # a cache of the caller's: its first forward reads the windows
            mine = model.generate(ids, **kw, **{astrai_hf.cache_kwarg(model): cache})
        assert torch.equal(model.generate(ids, **kw), out)  # what the prefix cache then serves
        assert _used(pool) == 0
    ref = model.generate(ids, **kw)
    if edit is not _window_set_on_modules:
        assert not torch.equal(ref, before)  # the edit matters to stock
    assert torch.equal(out, ref) and torch.equal(mine, ref)


def _repeat_a_layer_as_a_copy(model):
    """Layer 1 again, deep-copied, after it (as layer-repeat experiments build): renumbered, the config updated."""
    layers = list(model.model.layers)
    layers.insert(2, copy.deepcopy(layers[1]))
    for i, layer in enumerate(layers):
        layer.self_attn.layer_idx = i
    model.model.layers = torch.nn.ModuleList(layers)
    model.config.num_hidden_layers = len(layers)
    types = getattr(model.config, "layer_types", None)
    if types is not None:
        model.config.layer_types = [*types[:2], types[1], *types[2:]]


def _a_layer_from_another_model(model):
    """A sliding layer taken from a model of the same weights whose config gives another window."""
    place = next(i for i, t in enumerate(getattr(model.config, "layer_types", None) or ["sliding_attention"])
                 if t == "sliding_attention")
    donor = tiny_model(model.config.model_type, sliding_window=2)
    model.model.layers[place] = copy.deepcopy(donor.model.layers[place])


@pytest.mark.parametrize("arch", ["qwen2", "gemma2", "mistral"])
@pytest.mark.parametrize("change", [_repeat_a_layer_as_a_copy, _a_layer_from_another_model],
                         ids=["repeated-as-a-copy", "from-another-model"])
@pytest.mark.parametrize("before_patch", [False, True], ids=["after-patch", "before-patch"])
def test_layers_with_a_config_of_their_own_are_masked_by_the_models(arch, change, before_patch):
    # a deep-copied layer keeps a copy of the config (its layer_types of before, another model's window): stock
    # masks each place by the config of the model holding the layers; paged attention had taken the window of the
    # module's own config (a full-attention place given a window, a sliding one the donor's), and tokens differed
    kw_model = dict(num_hidden_layers=4, **({"max_window_layers": 2} if arch == "qwen2" else {}))
    model, twin = tiny_model(arch, **kw_model), tiny_model(arch, **kw_model)
    ids, mask = left_padded_batch([3, 9, 6], seed=1)
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False)
    change(twin)
    want = twin.generate(ids, **kw)
    if before_patch:
        change(model)
    with astrai_hf.patched(model, max_tokens=2048, page_size=4):
        if not before_patch:
            model.generate(ids, **kw)
            change(model)
        for _ in range(2):  # (the second from the prefix cache)
            assert torch.equal(model.generate(ids, **kw), want)
        assert _used(astrai_hf.get_pool(model)) == 0


def test_a_window_copied_by_an_init_a_class_decorator_wrapped_follows_a_config_edited_since():
    # with the kernels package installed (transformers 5.25 installs it), use_kernelized_func wraps the attention
    # class's __init__ in a function of its own (no functools.wraps): the window copied in the __init__ it calls
    # was not found, and an edited config.sliding_window gave other tokens than stock
    model = _window_model("qwen2")
    attention = type(model.model.layers[0].self_attn)
    own_init = attention.__init__

    def new_init(self, *args, **kwargs):
        own_init(self, *args, **kwargs)
        self.__dict__.setdefault("_kernel_funcs", {})

    wrapped = type(attention.__name__, (attention,), {"__init__": new_init, "__module__": attention.__module__})
    for layer in model.model.layers:
        layer.self_attn.__class__ = wrapped
    ids, mask = left_padded_batch([20, 35, 18], seed=3)
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False)
    before = model.generate(ids, **kw)
    model.config.sliding_window = 2
    ref = model.generate(ids, **kw)
    assert not torch.equal(ref, before)
    with astrai_hf.patched(model, max_tokens=4096, page_size=4):
        assert torch.equal(model.generate(ids, **kw), ref)


def test_a_rope_switched_to_dynamic_after_patch_is_not_chunked():
    def dynamic(m):
        m.config.rope_parameters = {**m.config.rope_parameters, "rope_type": "dynamic", "factor": 8.0}
        m.model.rotary_emb = type(m.model.rotary_emb)(m.config)

    model = tiny_model("llama", max_position_embeddings=8)
    ids, mask = left_padded_batch([60, 45], seed=0)
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False)
    with astrai_hf.patched(model, max_tokens=4096, max_seq_len=256, prefill_chunk_tokens=8):
        dynamic(model)
        out = model.generate(ids, **kw)
    assert torch.equal(out, model.generate(ids, **kw))


def test_peft_modules_to_save_on_attention_after_patch():
    # peft deep-copies each attention module next to the original (which no longer runs), same layer_idx
    peft = pytest.importorskip("peft")
    ids, mask = left_padded_batch([9, 5], seed=1)
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False)
    ref = tiny_model("llama").generate(ids, **kw)
    model = astrai_hf.patch(tiny_model("llama"), max_tokens=512)
    config = peft.LoraConfig(r=2, target_modules=["gate_proj"], modules_to_save=["self_attn"])  # a no-op LoRA
    peft_model = peft.get_peft_model(model, config)
    for _ in range(2):
        assert torch.equal(peft_model.generate(input_ids=ids, **kw), ref)
    assert _used(astrai_hf.get_pool(model)) == 0
    astrai_hf.unpatch(peft_model)  # the wrapper of a model patched before it
    assert not astrai_hf.is_patched(model)


def test_peft_merge_and_unload_of_a_patched_peft_model_lets_its_pool_go():
    # the attention modules merge_and_unload() hands back had held the patch state, and through it the pool (1.4 GiB
    # by default), after the peft model was gone; unpatch() of the merged model did nothing
    import gc
    import weakref

    peft = pytest.importorskip("peft")
    ids, mask = left_padded_batch([9, 5], seed=1)
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False)
    config = peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    peft_model = peft.get_peft_model(tiny_model("llama"), config).eval()
    ref = peft_model.generate(input_ids=ids, **kw)
    astrai_hf.patch(peft_model, max_tokens=512)
    assert torch.equal(peft_model.generate(input_ids=ids, **kw), ref)
    pool = weakref.ref(astrai_hf.get_pool(peft_model))
    merged = peft_model.merge_and_unload()
    del peft_model
    gc.collect()
    assert pool() is None
    astrai_hf.unpatch(merged)
    assert not any(k.startswith("_astrai") or k == "__reduce_ex__" for m in merged.modules() for k in vars(m))
    assert torch.equal(merged.generate(ids, **kw), ref)  # the LoRA merged in: the same tokens, stock
    with astrai_hf.patched(merged, max_tokens=512):
        assert torch.equal(merged.generate(ids, **kw), ref)


@pytest.mark.parametrize("route", ["patch(peft model)", "patch(base), then peft"])
@pytest.mark.parametrize("method", ["prompt tuning", "prefix tuning"])
def test_peft_prompt_learning_on_a_padded_batch_runs_stock(method, route):
    # peft puts virtual tokens in front of each row, after the mask's padding (or hands the model K/V of its own):
    # the padded rows had come out wrong
    peft = pytest.importorskip("peft")
    ids, mask = left_padded_batch([9, 4], seed=1)
    kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False)
    make = {"prompt tuning": peft.PromptTuningConfig, "prefix tuning": peft.PrefixTuningConfig}[method]
    config = make(task_type="CAUSAL_LM", num_virtual_tokens=3)
    torch.manual_seed(0)
    peft_model = peft.get_peft_model(tiny_model("llama"), config).eval()
    ref = peft_model.generate(input_ids=ids, **kw)
    base = peft_model.get_base_model()
    target = peft_model if route.startswith("patch(peft") else base
    with astrai_hf.patched(target, max_tokens=512):
        for _ in range(2):
            assert torch.equal(peft_model.generate(input_ids=ids, **kw), ref)
        assert _used(astrai_hf.get_pool(target)) == 0


def test_peft_adapter_names_per_call_are_not_served_each_others_prefixes():
    # peft's generate(adapter_names=[...]) picks each row's adapter by hooks it sets inside its own generate(), after
    # the patched one looked the prompt up: the second adapter had been served the first one's K/V
    peft = pytest.importorskip("peft")
    ids, mask = left_padded_batch([9, 4], seed=1)
    kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False)
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj"], init_lora_weights=False)
    torch.manual_seed(0)
    peft_model = peft.get_peft_model(tiny_model("llama"), config, adapter_name="first").eval()
    torch.manual_seed(1)
    peft_model.add_adapter("second", config)
    with torch.no_grad():  # make adapter b clearly different
        for name, p in peft_model.named_parameters():
            if "lora_B.second" in name:
                p.mul_(-5.0)
    names = [["first"] * 2, ["second"] * 2, ["__base__"] * 2, ["first", "second"]]
    stock = [peft_model.generate(input_ids=ids, adapter_names=n, **kw) for n in names]
    assert not torch.equal(stock[0], stock[1])
    assert astrai_hf.cache_kwarg(peft_model) == astrai_hf.cache_kwarg(peft_model.get_base_model())
    with astrai_hf.patched(peft_model, max_tokens=1024):
        for _ in range(2):
            for n, ref in zip(names, stock):
                assert torch.equal(peft_model.generate(input_ids=ids, adapter_names=n, **kw), ref), n
        assert _used(astrai_hf.get_pool(peft_model)) == 0


def test_early_exit_drafts_leave_the_cached_prefixes():
    # assisted decoding with early exit lowers config.num_hidden_layers around each draft
    model = tiny_model("llama", num_hidden_layers=3)
    ids, mask = left_padded_batch([13], seed=1)
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False)
    ref = model.generate(ids, assistant_early_exit=1, **kw)
    with astrai_hf.patched(model, max_tokens=512, page_size=4):
        pool = astrai_hf.get_pool(model)
        model.generate(ids, **kw)
        assert torch.equal(model.generate(ids, assistant_early_exit=1, **kw), ref)
        hits = pool.stats()["prefix_hit_tokens"]
        model.generate(ids, **kw)
        assert pool.stats()["prefix_hit_tokens"] - hits == 12
        assert _used(pool) == 0


def test_a_mask_with_inner_zeros_and_a_cache_of_the_callers_is_refused():
    # a pad token inside an earlier turn that the caller's cache holds: generate() masks it, which no paged cache
    # expresses; the call is refused (without a cache of the caller's, it runs stock, unpaged)
    model = tiny_model("llama")
    turn1 = torch.tensor([[6, 56, 79, 30, 72, 48, 65, 29, 15, 35, 0, 29]])  # 0 is the pad id
    turn2 = torch.cat([turn1, torch.tensor([[76, 88]])], 1)
    ref = model.generate(turn2, max_new_tokens=4, do_sample=False)
    with astrai_hf.patched(model, max_tokens=256) as patched:
        pool = astrai_hf.get_pool(patched)
        assert torch.equal(patched.generate(turn2, max_new_tokens=4, do_sample=False), ref)
        with PagedCache(pool) as cache:
            with torch.no_grad():
                patched(turn1, **{astrai_hf.cache_kwarg(patched): cache})
            with pytest.raises(ValueError, match=r"rows \[0\] are not left-padded"):
                patched.generate(turn2, max_new_tokens=4, do_sample=False, **{astrai_hf.cache_kwarg(patched): cache})
        assert _used(pool) == 0


def test_a_function_of_the_callers_named_like_a_flash_kernel_is_still_the_callers():
    name = "astrai_test_flash_like"
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def warm(module, query, key, value, attention_mask, scaling=None, **kwargs):
        scaling = (scaling or query.shape[-1] ** -0.5) * 2.0
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    AttentionInterface.register("astrai_test_flash_like", warm)
    model = tiny_model("llama")
    ids, mask = left_padded_batch([5, 9], seed=1)
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False)
    model.config._attn_implementation = name
    ref = model.generate(ids, **kw)
    with astrai_hf.patched(model, max_tokens=512, page_size=4):
        for _ in range(2):
            assert torch.equal(model.generate(ids, **kw), ref)
        assert astrai_hf.get_pool(model).stats()["prefix_query_tokens"] == 0  # ran stock


@pytest.mark.parametrize("drop", [3, 14, 0], ids=["three-columns", "every-column", "none"])
def test_the_returned_cache_cropped_then_passed_back_continues_from_fewer_columns_as_stock(drop):
    # "regenerate the last tokens": stock's returned cache, cut back with crop(-n), computes the columns after what
    # it still holds. The released cache had ignored the crop (its get_seq_length() read 0), so the call built on
    # the earlier tokens in the cut columns: other tokens, scores 1.85 off
    model = tiny_model("llama")
    ids = torch.randint(3, 96, (1, 9), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=6, do_sample=False, return_dict_in_generate=True, output_scores=True)
    name = astrai_hf.cache_kwarg(model)

    def crop_and_regenerate(m):
        out = m.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        returned = getattr(out, name)
        held = returned.get_seq_length()
        returned.crop(-drop)
        kept = returned.get_seq_length()
        seq = torch.cat([out.sequences[:, :-4], torch.tensor([[5, 6, 7, 8]])], 1)
        again = m.generate(seq, attention_mask=torch.ones_like(seq), **{name: returned}, **kw)
        return held, kept, again

    ref = crop_and_regenerate(model)
    with astrai_hf.patched(model, max_tokens=1024, page_size=4) as patched:
        got = crop_and_regenerate(patched)
        assert _used(astrai_hf.get_pool(patched)) == 0
    assert got[:2] == ref[:2] == (14, 14 - drop)
    _assert_same_output(got[2], ref[2])


@pytest.mark.parametrize("case", ["continued", "other first tokens", "a hole in the mask"])
@pytest.mark.parametrize("keyword", ["past_key_values", "cache", "past_key_values, cache=None"])
def test_the_returned_cache_passed_back_warns_of_a_deprecated_keyword_as_stock(keyword, case):
    # transformers 5.24 renamed generate()'s past_key_values to cache and warns of the old name; a patched call given
    # back the cache an earlier one returned had dropped the keyword before stock's generate() saw it: no warning.
    # Passed both, stock's renaming keeps cache= (None: the call starts afresh) where the patched call had continued
    # past_key_values=; an older transformers takes past_key_values= and drops a cache=None
    model = tiny_model("llama")
    if astrai_hf.cache_kwarg(model) != keyword == "cache":
        pytest.skip("this transformers' generate() takes no cache=")
    passing = (lambda c: {"past_key_values": c, "cache": None}) if "," in keyword else (lambda c: {keyword: c})
    ids = torch.randint(3, 96, (1, 7), generator=torch.Generator().manual_seed(2))
    kw = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_scores=True)

    def turns(m):
        out = m.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        returned = getattr(out, astrai_hf.cache_kwarg(m))
        seq = torch.cat([out.sequences, torch.tensor([[9, 10]])], 1)
        mask = torch.ones_like(seq)
        if case == "other first tokens":  # the earlier columns computed again on a cache of its own
            seq[0, 0] = 11
        if case == "a hole in the mask":  # stock's cache continued, then continued again
            mask[0, 2] = 0
        outs, said = [], []
        for _ in range(2 if case == "a hole in the mask" else 1):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                outs.append(m.generate(seq, attention_mask=mask, **passing(returned), **kw))
            # (what a warning names a cache by, its repr, is another class's where a patched call passed its own)
            said.append([re.sub(r"=[^`]*`", "=`", str(w.message)) for w in caught
                         if issubclass(w.category, FutureWarning)])
        return outs, said

    ref, stock_said = turns(model)
    with astrai_hf.patched(model, max_tokens=512, page_size=4) as patched:
        got, said = turns(patched)
        assert _used(astrai_hf.get_pool(patched)) == 0
    assert said == stock_said
    renamed = astrai_hf.cache_kwarg(model) == "cache"  # (stock warns of past_key_values= from 5.24 on)
    assert any(stock_said) == (renamed and keyword != "cache")
    for g, r in zip(got, ref):
        _assert_same_output(g, r)


@pytest.mark.parametrize("keyword", ["past_key_values", "cache"])
def test_a_cache_keyword_passed_none_or_one_this_transformers_does_not_read_does_as_stock(keyword):
    # None under either keyword runs afresh, as stock (an older release drops a None it does not read; a patched
    # call had passed its own cache under that keyword, which it refused). A cache under a keyword the forward
    # does not read is no cache there (the patched forward had stored into it)
    model = tiny_model("llama")
    ids = torch.randint(3, 96, (1, 7), generator=torch.Generator().manual_seed(2))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)

    def calls(m):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = m.generate(ids, **{keyword: None}, **kw)
            cache = PagedCache(PagePool.from_model(model, max_tokens=64, page_size=4))
            with torch.no_grad():
                logits = m(ids, **{keyword: cache}).logits
        said = [re.sub(r"=[^`]*`", "=`", str(w.message)) for w in caught if issubclass(w.category, FutureWarning)]
        return out, logits, cache.get_seq_length(), said

    want = calls(model)
    with astrai_hf.patched(model, max_tokens=512, page_size=4) as patched:
        got = calls(patched)
        assert _used(astrai_hf.get_pool(patched)) == 0
    assert torch.equal(got[0], want[0]) and got[2:] == want[2:]
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("prompt", ["emitting the pad token", "a chat turn holding pad tokens"])
def test_early_exit_set_in_the_models_generation_config_past_pad_tokens_equals_stock(prompt):
    # transformers' drafts are generate() calls that read early exit from the model's generation_config too, crop
    # the cache the last draft returned by its get_seq_length(), and hand their own drafts the mask
    # input_ids != pad_token_id. A patched draft had refused a returned cache that recorded no tokens once the
    # model emitted the pad token, and that mask's holes on a chat turn holding pad tokens; each failure left
    # transformers' lowered config.num_hidden_layers in place: every later call gave other tokens
    model = tiny_model("llama")
    if prompt == "emitting the pad token":
        ids = torch.tensor([[57, 82, 91, 91, 51, 80, 71, 81, 27]])
        assert model.config.pad_token_id in model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                                                           do_sample=False)[0, ids.shape[1]:].tolist()
    else:
        first = torch.randint(3, 96, (1, 9), generator=torch.Generator().manual_seed(1))
        first = model.generate(first, attention_mask=torch.ones_like(first), max_new_tokens=10, do_sample=False)
        ids = torch.cat([first, torch.full((1, 2), 7)], 1)
        assert model.config.pad_token_id in ids[0].tolist()
    model.generation_config.assistant_early_exit = 1
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    try:
        ref = model.generate(ids, **kw)
    except TypeError as e:  # transformers before 5.18: its drafts recurse into early exit and fail
        pytest.skip(f"stock generate() fails here: {e}")
    with astrai_hf.patched(model, max_tokens=1024, page_size=4) as patched:
        for _ in range(2):
            assert torch.equal(patched.generate(ids, **kw), ref)
        assert patched.config.num_hidden_layers == 2
        assert _used(astrai_hf.get_pool(patched)) == 0


@pytest.mark.parametrize("how", ["generate", "forward-with-grad-mode-frozen-weights"])
def test_gradient_checkpointing_in_training_mode_runs_as_stock(how):
    # transformers hands a checkpointing layer no cache (5.17 in training mode, later releases in grad mode): the
    # patched forward had planned a paged step whose slots no layer filled, and attention read them (tokens that
    # changed from run to run)
    model = tiny_model("llama")
    ids, mask = left_padded_batch([5, 9, 3])
    model.gradient_checkpointing_enable()
    model.train()

    def run(cache=None):
        if how == "generate":
            return model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
        model.requires_grad_(False)
        with torch.enable_grad():
            return model(ids, attention_mask=mask, past_key_values=cache, use_cache=True).logits

    ref = run(transformers.DynamicCache(config=model.config))
    with astrai_hf.patched(model, max_tokens=1024, page_size=4) as patched:
        pool = astrai_hf.get_pool(patched)
        for _ in range(2):
            with PagedCache(pool) as cache:
                got = run(cache)
            assert torch.equal(got, ref) if how == "generate" else torch.allclose(got, ref, rtol=1e-5, atol=1e-5)
        assert _used(pool) == 0


@pytest.mark.parametrize("op", ["batch_select_indices", "reorder_cache", "batch_repeat_interleave"])
@pytest.mark.parametrize("edit", [False, True], ids=["same-tokens", "a-generated-token-edited"])
def test_rows_of_the_returned_cache_selected_or_reordered_then_passed_back_give_stocks_tokens(op, edit):
    # keep the best of several samples, or reorder them: stock's returned cache moves its rows. The released
    # cache had kept the recorded rows in place, so a continuation read another row's tokens (scores 1.5 off)
    model = tiny_model("llama")
    ids = torch.randint(3, 96, (1, 9), generator=torch.Generator().manual_seed(1))
    name = astrai_hf.cache_kwarg(model)
    rows = {"batch_select_indices": [1], "reorder_cache": [2, 0, 1], "batch_repeat_interleave": [0, 0, 1, 1, 2, 2]}[op]

    def continue_rows(m):
        torch.manual_seed(0)
        out = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=True,
                         num_return_sequences=3, return_dict_in_generate=True)
        returned = getattr(out, name)
        getattr(returned, op)(2 if op == "batch_repeat_interleave" else torch.tensor(rows))
        seq = torch.cat([out.sequences[rows], torch.full((len(rows), 3), 7)], 1)
        if edit:
            seq[:, 11] = (seq[:, 11] + 1) % 96
        return m.generate(seq, attention_mask=torch.ones_like(seq), max_new_tokens=4, do_sample=False,
                          return_dict_in_generate=True, output_scores=True, **{name: returned})

    ref = continue_rows(model)
    with astrai_hf.patched(model, max_tokens=1024, page_size=4) as patched:
        got = continue_rows(patched)
        assert _used(astrai_hf.get_pool(patched)) == 0
    _assert_same_output(got, ref)


@pytest.mark.parametrize("turn2", ["a mask", "a pad token the model emitted, no mask"])
def test_one_returned_cache_passed_on_every_turn_follows_the_latest_turn_as_stocks(turn2):
    # stock's generate() grows the cache it is given and hands that object back; the patched turn had handed back
    # another object, so the one passed again on turn 3 still recorded turn 1 (get_seq_length 13 for 21; a turn
    # that tokenizes the earlier answer otherwise got other scores)
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 96, (1, 9), generator=g)
    if turn2 != "a mask":
        emitted = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=5, do_sample=False)
        model.generation_config.pad_token_id = emitted[0, 11].item()  # a token inside the first answer
    name = astrai_hf.cache_kwarg(model)
    kw = dict(max_new_tokens=5, do_sample=False, return_dict_in_generate=True, output_scores=True)

    def turns(m):
        out = m.generate(prompt, attention_mask=torch.ones_like(prompt), **kw)
        cache, lengths = getattr(out, name), []
        seq = torch.cat([out.sequences, torch.tensor([[7, 8, 9]])], 1)
        mask = dict(attention_mask=torch.ones_like(seq)) if turn2 == "a mask" else {}
        out = m.generate(seq, **mask, **kw, **{name: cache})
        assert getattr(out, name) is cache
        lengths.append(cache.get_seq_length())
        seq = torch.cat([out.sequences, torch.tensor([[10, 11]])], 1)
        seq[0, 18] = (seq[0, 18] + 1) % 96  # the second answer tokenized otherwise
        out = m.generate(seq, attention_mask=torch.ones_like(seq), **kw, **{name: cache})
        lengths.append(cache.get_seq_length())
        return lengths, out

    ref = turns(model)
    with astrai_hf.patched(model, max_tokens=1024, page_size=4) as patched:
        got = turns(patched)
        assert _used(astrai_hf.get_pool(patched)) == 0
    assert got[0] == ref[0]
    _assert_same_output(got[1], ref[1])


def _soft_prompt(model, ids):
    """``ids``' embeddings with a few columns moved off them: a soft prompt (or spliced-in features) that no token id
    stands for."""
    embeds = model.get_input_embeddings()(ids).detach().clone()
    embeds[:, 1:4] += 0.7
    return embeds


def _assert_turns_as_stocks(model, run):
    """``run(model)``'s outputs (a list of generate() outputs) patched, with its pages back after, equal stock's."""
    ref = run(model)
    with astrai_hf.patched(model, max_tokens=1024, page_size=4) as patched:
        got = run(patched)
        assert _used(astrai_hf.get_pool(patched)) == 0
    for g, r in zip(got, ref, strict=True):
        _assert_same_output(g, r, tol=1e-4)


@pytest.mark.parametrize("turns", ["embeds, then ids", "ids, then embeds", "embeds, ids, embeds",
                                   "embeds, ids, ids", "embeds and ids, then ids", "embeds, then a hole"])
def test_the_returned_cache_of_a_call_fed_inputs_embeds_continues_from_those_embeddings_as_stocks(turns):
    # stock's returned cache holds the K/V computed from the embeddings; the patched call recorded no tokens, so the
    # next turn computed its prompt afresh from its own inputs: a soft prompt fed on the first turn was lost (and
    # embeddings fed on a later turn replaced the K/V of the tokens the cache held)
    model = tiny_model("llama")
    ids, mask = left_padded_batch([6, 9], seed=1)
    more = torch.randint(3, 96, (2, 2), generator=torch.Generator().manual_seed(2))
    name = astrai_hf.cache_kwarg(model)
    kw = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_scores=True)
    steps = turns.split(", then ") if ", then " in turns else turns.split(", ")

    def run(m):
        soft = _soft_prompt(m, ids)
        if steps[0] == "ids":
            out = m.generate(ids, attention_mask=mask, **kw)
            seq = out.sequences
        else:
            out = m.generate(inputs_embeds=soft, attention_mask=mask, **kw, **(
                {"input_ids": ids} if steps[0] == "embeds and ids" else {}))
            seq = out.sequences if steps[0] == "embeds and ids" else torch.cat([ids, out.sequences], 1)
        soft[:, 1:4] += 5.0  # (a soft prompt trained further in place: the cache holds what was computed)
        cache, outs = getattr(out, name), []
        for step in steps[1:]:
            seq = torch.cat([seq, more], 1)
            m2 = torch.cat([mask, torch.ones(2, seq.shape[1] - mask.shape[1], dtype=mask.dtype)], 1)
            if step == "embeds":
                fed = dict(inputs_embeds=_soft_prompt(m, seq))
            elif step == "a hole":
                m2[0, -1] = 0  # (stock masks it for the new columns only; the cache's K/V stay as computed)
                fed = dict(inputs=seq)
            else:
                fed = dict(inputs=seq)
            out = m.generate(**fed, attention_mask=m2, **kw, **{name: cache})
            outs.append(out)
            seq = torch.cat([seq, out.sequences[:, seq.shape[1]:] if "inputs" in fed else out.sequences], 1)
        return outs

    _assert_turns_as_stocks(model, run)


@pytest.mark.parametrize("call", ["beams", "inputs_embeds"])
def test_the_returned_cache_of_a_call_that_records_no_tokens_reads_stocks_length_and_takes_row_selections(call):
    # (its get_seq_length() had read 0, and a boolean batch_select_indices raised "the cache holds 0 rows")
    model = tiny_model("llama")
    ids = torch.randint(3, 96, (1, 9), generator=torch.Generator().manual_seed(1))
    name = astrai_hf.cache_kwarg(model)
    fed = (dict(input_ids=ids, num_beams=2) if call == "beams"
           else dict(inputs_embeds=model.get_input_embeddings()(ids).detach()))

    def lengths(m):
        out = m.generate(**fed, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                         return_dict_in_generate=True)
        returned = getattr(out, name)
        rows = 2 if call == "beams" else 1
        returned.batch_select_indices(torch.ones(rows, dtype=torch.bool))
        held = returned.get_seq_length()
        returned.crop(-2)
        return held, returned.get_seq_length()

    ref = lengths(model)
    with astrai_hf.patched(model, max_tokens=1024, page_size=4) as patched:
        assert lengths(patched) == ref
        assert _used(astrai_hf.get_pool(patched)) == 0


@pytest.mark.parametrize("call", ["greedy", "beams", "inputs_embeds"])
def test_row_operations_on_the_returned_cache_check_indices_against_its_rows_and_empty_it_as_stocks(call):
    # the returned cache of beams or inputs_embeds records no tokens, and had not counted its rows either: [0, 5]
    # on 2 rows was accepted (stock: IndexError), and batch_repeat_interleave(0) raised (stock empties its cache)
    model = tiny_model("llama")
    ids = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(1))
    name = astrai_hf.cache_kwarg(model)
    fed = {"greedy": dict(input_ids=ids), "beams": dict(input_ids=ids, num_beams=3),
           "inputs_embeds": dict(inputs_embeds=model.get_input_embeddings()(ids).detach())}[call]
    ops = [("reorder_cache", torch.tensor([0, 5])), ("reorder_cache", torch.tensor([1, 0])),
           ("batch_select_indices", torch.tensor([6])), ("batch_select_indices", torch.tensor([1])),
           ("batch_select_indices", torch.ones(3, dtype=torch.bool)), ("batch_repeat_interleave", 0),
           ("batch_repeat_interleave", 2)]

    def outcomes(m):
        got = []
        for op, arg in ops:
            out = m.generate(**fed, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                             return_dict_in_generate=True)
            returned = getattr(out, name)
            try:
                getattr(returned, op)(arg)
            except (IndexError, ValueError):
                got.append((op, "raised"))
                continue
            got.append((op, returned.get_seq_length()))
            if returned.get_seq_length():  # the rows it kept: a boolean mask of another length is refused
                with pytest.raises((IndexError, ValueError)):
                    returned.batch_select_indices(torch.ones(7, dtype=torch.bool))
        return got

    ref = outcomes(model)
    assert ("batch_repeat_interleave", 0) in ref and ("batch_select_indices", "raised") in ref  # (what it covers)
    with astrai_hf.patched(model, max_tokens=1024, page_size=4) as patched:
        assert outcomes(patched) == ref
        assert _used(astrai_hf.get_pool(patched)) == 0


@pytest.mark.parametrize("drafts", ["prompt lookup", "an assistant model"])
def test_candidate_decoding_continued_on_the_returned_cache_gives_the_tokens_of_a_call_without_it(drafts):
    # stock's first verification forward feeds the whole prompt again on top of the cache it is given (its cache
    # then holds those columns twice, and its tokens differ); the patched call computes what a call without that
    # cache computes (README, Generation modes)
    model = tiny_model("llama")
    ids = torch.randint(3, 20, (1, 5), generator=torch.Generator().manual_seed(1))
    kw = dict(do_sample=False, return_dict_in_generate=True, output_scores=True)
    kw.update(prompt_lookup_num_tokens=2) if drafts == "prompt lookup" else kw.update(
        assistant_model=tiny_model("llama", seed=3))
    name = astrai_hf.cache_kwarg(model)
    with astrai_hf.patched(model, max_tokens=1024, page_size=4) as patched:
        first = patched.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, **kw)
        seq = torch.cat([first.sequences, torch.tensor([[7, 8]])], 1)
        got = patched.generate(seq, attention_mask=torch.ones_like(seq), max_new_tokens=4, **kw,
                               **{name: getattr(first, name)})
        assert _used(astrai_hf.get_pool(patched)) == 0
    _assert_same_output(got, model.generate(seq, attention_mask=torch.ones_like(seq), max_new_tokens=4, **kw))


@pytest.mark.parametrize("returned", [1, 2], ids=["best beam", "every beam"])
@pytest.mark.parametrize("before_last", [1, 2])
def test_a_hole_among_the_columns_the_returned_cache_of_beams_holds_is_refused(before_last, returned):
    # stock's cache holds K/V of later columns that attended the masked one; the returned cache of beams (which
    # records no tokens, also where the rows returned are as many as the beams) runs as a fresh one: refused
    model = tiny_model("llama")
    ids, mask = left_padded_batch([6, 6], seed=1)
    name = astrai_hf.cache_kwarg(model)
    with astrai_hf.patched(model, max_tokens=1024, page_size=4):
        first = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, num_beams=2,
                               num_return_sequences=returned, return_dict_in_generate=True)
        held = getattr(first, name).get_seq_length()
        hole = torch.ones_like(first.sequences)
        hole[0, held - 1 - before_last] = 0  # the last column the cache holds stays unmasked
        with pytest.raises(ValueError, match=rf"attention_mask rows \[0\] mask a column among the {held} the cache "
                                             r"passed in holds, before one they leave unmasked"):
            model.generate(first.sequences, attention_mask=hole, max_new_tokens=4, do_sample=False,
                           **{name: getattr(first, name)})
        assert _used(astrai_hf.get_pool(model)) == 0


@pytest.mark.parametrize("call", ["beams", "inputs_embeds"])
def test_a_continuation_with_a_hole_on_the_returned_cache_of_a_call_that_records_no_tokens_runs(call):
    # the mask sequences != pad_token_id has a hole where a row finished early; the returned cache of beams or
    # inputs_embeds records no tokens, and the call had been refused as "not left-padded". Beams compute as a fresh
    # cache would (README); after inputs_embeds of the same ids, stock's cache holds what a fresh one computes
    model = tiny_model("llama")
    ids, mask = left_padded_batch([3, 6], seed=1 if call == "beams" else 0)
    kw = dict(max_new_tokens=6, do_sample=False, return_dict_in_generate=True, output_scores=True)
    if call == "beams":
        kw.update(num_beams=2, eos_token_id=list(range(5, 16)))
    else:
        kw.update(eos_token_id=list(range(3, 40)))
    name = astrai_hf.cache_kwarg(model)

    def turns(m, with_cache=True):
        if call == "beams":
            first = m.generate(ids, attention_mask=mask, **kw)
            seq = first.sequences
        else:
            first = m.generate(inputs_embeds=m.get_input_embeddings()(ids).detach(), attention_mask=mask, **kw)
            seq = torch.cat([ids, first.sequences], 1)
        hole = (torch.cat([mask, torch.ones(2, seq.shape[1] - ids.shape[1], dtype=mask.dtype)], 1) * (seq != 0))
        assert (hole.diff(dim=1) < 0).any()  # a one, then a zero: a hole
        cache = {name: getattr(first, name)} if with_cache else {}
        return m.generate(seq, attention_mask=hole, output_hidden_states=True, **kw, **cache)

    ref = turns(model, with_cache=call != "beams")
    with astrai_hf.patched(model, max_tokens=1024, page_size=4) as patched:
        got = turns(patched)
        assert _used(astrai_hf.get_pool(patched)) == 0
    _assert_same_output(got, ref)
    if call == "inputs_embeds":  # (stock's first forward covers the columns after its cache's)
        for a, b in zip(got.hidden_states[0], ref.hidden_states[0], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_the_returned_cache_of_samples_from_inputs_embeds_continues_each_sample_as_stocks():
    # num_return_sequences=2 from a soft prompt: each sample is a row of stock's cache, computed from its prompt's
    # embeddings, which the next turn continues (recorded once per prompt, not per sample, it failed: 2 rows, 4)
    model = tiny_model("llama")
    ids, mask = left_padded_batch([6, 9], seed=1)
    more = torch.randint(3, 96, (4, 2), generator=torch.Generator().manual_seed(2))
    name = astrai_hf.cache_kwarg(model)
    kw = dict(max_new_tokens=4, return_dict_in_generate=True, output_scores=True)

    def run(m):
        torch.manual_seed(0)
        first = m.generate(inputs_embeds=_soft_prompt(m, ids), attention_mask=mask, do_sample=True,
                           num_return_sequences=2, **kw)
        seq = torch.cat([ids.repeat_interleave(2, dim=0), first.sequences, more], 1)
        grown = torch.cat([mask.repeat_interleave(2, dim=0), torch.ones(4, seq.shape[1] - ids.shape[1],
                                                                        dtype=mask.dtype)], 1)
        return first, m.generate(seq, attention_mask=grown, do_sample=False, **kw, **{name: getattr(first, name)})

    _assert_turns_as_stocks(model, run)


def test_a_hole_among_the_columns_a_returned_cache_of_inputs_embeds_holds_gives_stocks_tokens():
    # stock's K/V of the columns after the masked one attended it, which a fresh cache's would not (other tokens):
    # such a call had been refused, from when the returned cache of inputs_embeds recorded no columns; it now
    # continues a stock cache of the columns it recorded, as stock does
    model = tiny_model("llama")
    ids = torch.randint(3, 96, (1, 10), generator=torch.Generator().manual_seed(1))
    ids[0, 3] = 0  # the pad token, attended in the first call (mask of ones), masked in the second (no mask)
    kw = dict(max_new_tokens=8, do_sample=False, return_dict_in_generate=True, output_scores=True)
    name = astrai_hf.cache_kwarg(model)

    def turns(m):
        first = m.generate(inputs_embeds=m.get_input_embeddings()(ids).detach(), attention_mask=torch.ones_like(ids),
                           **kw)
        return m.generate(torch.cat([ids, first.sequences], 1), **kw, **{name: getattr(first, name)})

    ref = turns(model)
    with astrai_hf.patched(model, max_tokens=1024, page_size=4) as patched:
        _assert_same_output(turns(patched), ref)
        assert _used(astrai_hf.get_pool(patched)) == 0
        first = patched.generate(inputs_embeds=patched.get_input_embeddings()(ids).detach(), **kw)
        with pytest.raises(ValueError, match=r"from 0, got \[-1\]"):
            getattr(first, name).reorder_cache(torch.tensor([0, -1]))


@pytest.mark.parametrize("how", ["patched", "a PagedCache without patch()"])
@pytest.mark.parametrize("lengths", [[3, 5], [2, 300, 301]], ids=["one bucket", "buckets"])
def test_generate_leaves_no_reference_cycles_of_its_own(how, lengths):
    # each step's metadata and its per-device view (and its one-bucket list) referred to each other: index tensors
    # left to the garbage collector, 100k objects over 400 calls where servers turn it off (gc.disable/freeze)
    model = tiny_model("llama")
    ids, mask = left_padded_batch(lengths, seed=0)
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False)
    pool = PagePool.from_model(model, max_tokens=4096, page_size=4, max_seq_len=512)

    def call():
        if how == "patched":
            return model.generate(ids, **kw)
        with PagedCache(pool, ids, mask, model=model) as cache:
            return model.generate(ids, **kw, **{astrai_hf.cache_kwarg(model): cache})

    with contextlib.ExitStack() as stack:
        if how == "patched":
            stack.enter_context(astrai_hf.patched(model, pool=pool))
        call()
        gc.collect()
        gc.disable()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            for _ in range(2):
                call()
            gc.collect()
            left = [o for o in gc.garbage if type(o).__module__.startswith("astrai_hf") or isinstance(o, torch.Tensor)]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
    assert not left, sorted({type(o).__name__ for o in left})
    assert _used(pool) == 0


def test_a_kept_output_lets_a_deleted_models_pool_go_and_its_cache_still_continues():
    # the released cache in a kept return_dict_in_generate output held the pool: after `del model` its K/V memory
    # stayed until the output went (a list of outputs pinned every pool)
    ids, mask = left_padded_batch([4, 7], seed=3)
    kw = dict(max_new_tokens=3, do_sample=False, return_dict_in_generate=True, output_scores=True)
    name = astrai_hf.cache_kwarg(tiny_model("llama"))

    def turn2(model, out):
        seq = torch.cat([out.sequences, torch.full((2, 2), 9)], 1)
        return model.generate(seq, attention_mask=torch.cat([mask, torch.ones(2, 5, dtype=mask.dtype)], 1),
                              **kw, **{name: getattr(out, name)})

    stock = tiny_model("llama")
    ref_first = stock.generate(ids, attention_mask=mask, **kw)
    length = ref_first[name].get_seq_length()
    ref = turn2(stock, ref_first)
    model = tiny_model("llama")
    astrai_hf.patch(model, max_tokens=1024, page_size=4)
    pool = weakref.ref(astrai_hf.get_pool(model))
    out = model.generate(ids, attention_mask=mask, **kw)
    returned = getattr(out, name)
    del model
    gc.collect()
    assert pool() is None
    with pytest.raises(AttributeError, match="PagePool is gone"):
        returned.pool
    assert not hasattr(returned, "pool")
    assert all(k.shape[0] == v.shape[0] == 0 for k, v, _ in returned)  # (its K/V, empty, as before)
    twin = copy.deepcopy(out)  # (a copy needs no pool)
    assert getattr(twin, name).get_seq_length() == returned.get_seq_length() == length
    other = tiny_model("llama")  # the same weights: stock's cache of the first model continues on it
    with astrai_hf.patched(other, max_tokens=1024, page_size=4):
        _assert_same_output(turn2(other, twin), ref)
        _assert_same_output(turn2(other, out), ref)
        assert _used(astrai_hf.get_pool(other)) == 0
        assert returned.pool is astrai_hf.get_pool(other)  # (handed back by that call: its pool, held weakly)


class _Int8Weight(torch.Tensor):
    """A weight kept as int8 values and a scale per output row, as torchao's quantized weights are: a wrapper tensor
    subclass naming its inner tensors (``__tensor_flatten__``), with no byte view or float copy of its own (those
    raise NotImplementedError, as torchao's unimplemented operators do)."""

    @staticmethod
    def __new__(cls, qdata, scale):
        return torch.Tensor._make_wrapper_subclass(cls, qdata.shape, dtype=scale.dtype, device=qdata.device)

    def __init__(self, qdata, scale):
        self.qdata, self.scale = qdata, scale

    def __tensor_flatten__(self):
        return ["qdata", "scale"], None

    @classmethod
    def of(cls, weight):
        scale = weight.detach().abs().amax(1, keepdim=True) / 127
        return torch.nn.Parameter(cls(torch.round(weight.detach() / scale).to(torch.int8), scale), requires_grad=False)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.detach.default:
            return cls(args[0].qdata, args[0].scale)
        if func is torch.ops.aten.clone.default:  # (deepcopy)
            return cls(args[0].qdata.clone(), args[0].scale.clone())
        if func in (torch.ops.aten.view.default, torch.ops.aten._to_copy.default):
            raise NotImplementedError(f"{cls.__name__} dispatch: {func} is not implemented")
        plain = [a.qdata.to(a.scale.dtype) * a.scale if isinstance(a, cls) else a for a in args]
        return func(*plain, **kwargs)


@pytest.mark.parametrize("pool_of", ["patch()", "the caller"])
def test_the_returned_cache_passed_to_the_model_unpatched_says_it_cannot_continue_there(pool_of):
    # the with-block ends, and the chat's next turn goes to the same model, now stock: the returned cache holds no
    # K/V for stock's generate() to continue from, and the error said the model had been deleted
    model = tiny_model("llama")
    ids, mask = left_padded_batch([7, 4], seed=2)
    kw = dict(max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    settings = dict(max_tokens=512, page_size=4)
    pool = PagePool.from_model(model, **settings) if pool_of == "the caller" else None
    with astrai_hf.patched(model, **(dict(pool=pool) if pool is not None else settings)):
        out = model.generate(ids, attention_mask=mask, **kw)
    name = astrai_hf.cache_kwarg(model)
    seq = torch.cat([out.sequences, torch.full((2, 2), 11)], 1)
    mask2 = torch.cat([mask, torch.ones(2, 5, dtype=mask.dtype)], 1)
    with pytest.raises((AttributeError, ValueError), match="unpatched"):
        model.generate(seq, attention_mask=mask2, **kw, **{name: out[name]})
    fresh = model.generate(seq, attention_mask=mask2, **kw)  # as the error advises: stock's tokens
    stock = tiny_model("llama")
    ref = stock.generate(seq, attention_mask=mask2, **kw, **{name: stock.generate(ids, attention_mask=mask, **kw)[name]})
    assert torch.equal(fresh.sequences, ref.sequences)



@pytest.mark.parametrize("when", ["before patch", "after patch"])
def test_weights_of_a_tensor_subclass_without_a_byte_view_are_watched_through_their_inner_tensors(when):
    # torchao's int8 weights: the weights digest read their bytes, then their float64 values, and both raised
    # NotImplementedError, so patch() (or the first call after quantizing a patched model) failed
    model = tiny_model("llama")
    ids, mask = left_padded_batch([5, 9], seed=4)
    kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, return_dict_in_generate=True, output_scores=True)

    def quantize(m):
        for layer in m.model.layers:
            for name in ("q_proj", "k_proj", "v_proj"):
                proj = getattr(layer.self_attn, name)
                proj.weight = _Int8Weight.of(proj.weight)

    stock = copy.deepcopy(model)
    quantize(stock)
    ref = stock.generate(ids, **kw)
    from astrai_hf.persist import weights_fingerprint

    other = copy.deepcopy(stock)  # its int8 values differ in one place: so does its digest
    other.model.layers[0].self_attn.k_proj.weight.qdata[0, 0] += 1
    assert weights_fingerprint(stock) == weights_fingerprint(copy.deepcopy(stock)) != weights_fingerprint(other)
    if when == "before patch":
        quantize(model)
    with astrai_hf.patched(model, max_tokens=1024, page_size=4):
        if when == "after patch":
            model.generate(ids, **kw)  # (the prefix cache holds these prompts, of the float weights)
            quantize(model)
        for _ in range(2):
            _assert_same_output(model.generate(ids, **kw), ref)
        assert _used(astrai_hf.get_pool(model)) == 0
        assert astrai_hf.get_pool(model).stats()["prefix_hit_tokens"] > 0  # (the second call reuses the first's)


def test_a_base_model_patched_inside_its_patched_peft_wrapper_is_not_refused_as_shared():
    # the wrapper's attention modules are the base model's own: patching the base after the wrapper (the zero-code
    # hook does, when peft's generate() calls the base's) had been refused as "shared with another patched model"
    peft = pytest.importorskip("peft")
    ids, mask = left_padded_batch([9, 4], seed=1)
    kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False)
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    torch.manual_seed(0)
    peft_model = peft.get_peft_model(tiny_model("llama"), config).eval()
    ref = peft_model.generate(input_ids=ids, **kw)
    with astrai_hf.patched(peft_model, max_tokens=512):
        with astrai_hf.patched(peft_model.get_base_model(), max_tokens=512) as base:
            assert torch.equal(peft_model.generate(input_ids=ids, **kw), ref)
            assert _used(astrai_hf.get_pool(base)) == 0

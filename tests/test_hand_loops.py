"""Forwards of the caller's own on a PagedCache (research code's decode loops), against DynamicCache: the same
logits, the Cache API transformers' own code and users reach for, and masks only a hand-written loop makes."""

import contextlib
import copy

import pytest
import torch
from transformers import DynamicCache

import astrai_hf
from astrai_hf import PagedCache, PagePool
from tiny_models import left_padded_batch, tiny_model

pytestmark = pytest.mark.equivalence

ARCHS = ["llama", "qwen2", "gemma2", "gpt2", "opt"]


def _dynamic(model):
    try:
        return DynamicCache(config=model.config)
    except TypeError:  # (older releases take no config)
        return DynamicCache()


def _greedy_loop(model, cache, ids, mask, steps=6, **prefill_kwargs):
    """Prefill, then one token per step with the mask grown by a column of ones: (tokens [B, steps], logits
    [B, steps, vocab])."""
    kw = {astrai_hf.cache_kwarg(model): cache, "use_cache": True}
    tokens, logits = [], []
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, **prefill_kwargs, **kw)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(steps):
            tokens.append(tok)
            mask = torch.cat([mask, torch.ones_like(tok)], 1)
            out = model(input_ids=tok, attention_mask=mask, **kw)
            logits.append(out.logits[:, -1])
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
    return torch.cat(tokens, 1), torch.stack(logits, 1)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_padded_prefill_with_logits_to_keep_and_no_position_ids_equals_dynamic_cache(arch):
    # generate() passes position_ids; a loop of one's own may not, and then the model counts positions itself
    # (from the column for most families, padding included): such a prefill is not packed, whose rows would
    # count their own positions and store K/V rotated for other positions than the decode steps that follow
    model = tiny_model(arch, seed=3)
    with torch.no_grad():
        model.get_output_embeddings().weight.div_(3.0)  # less peaked logits: a position error flips tokens
    ids, mask = left_padded_batch([2, 12, 6], seed=3)
    ref_tokens, ref_logits = _greedy_loop(model, _dynamic(model), ids, mask, logits_to_keep=1)
    pool = PagePool.from_model(model, max_tokens=1024)
    with astrai_hf.patched(model, pool=pool), PagedCache(pool, prefix_cache=False) as cache:
        tokens, logits = _greedy_loop(model, cache, ids, mask, logits_to_keep=1)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-5)
    assert pool.stats()["num_used_pages"] == 0


@pytest.mark.parametrize("keep", ["tensor([3, 11])", "tensor([1])", "tensor(1)", "int64(1)"])
@pytest.mark.parametrize("lengths", [[12, 12], [2, 12]], ids=["unpadded", "padded"])
def test_logits_to_keep_as_an_index_gives_the_positions_it_names(keep, lengths):
    # transformers reads a tensor (or any non-int) as indices of positions: tensor([1]) is column 1, not the last
    # position, and a 0-dim index drops the position axis; only the int 1 asks for the last position alone
    import numpy as np

    value = {"tensor([3, 11])": torch.tensor([3, 11]), "tensor([1])": torch.tensor([1]), "tensor(1)": torch.tensor(1),
             "int64(1)": np.int64(1)}[keep]
    model = tiny_model("llama", seed=3)
    ids, mask = left_padded_batch(lengths, seed=3)
    kw = dict(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), use_cache=True,
              logits_to_keep=value)
    name = astrai_hf.cache_kwarg(model)
    pool = PagePool.from_model(model, max_tokens=1024)
    with torch.no_grad():
        ref = model(**kw, **{name: _dynamic(model)}).logits
        with astrai_hf.patched(model, pool=pool), PagedCache(pool, prefix_cache=False) as cache:
            got = model(**kw, **{name: cache}).logits
    assert got.shape == ref.shape
    cols = torch.as_tensor(value).reshape(-1)
    real = mask[:, cols].bool()  # [B, positions]: the logits of a padding column are meaningless (never stored)
    B, V = ids.shape[0], ref.shape[-1]
    got, ref = got.reshape(B, len(cols), V)[real], ref.reshape(B, len(cols), V)[real]
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    assert pool.stats()["num_used_pages"] == 0


def _loop_with_a_masked_column(model, cache, ids, mask, full_width):
    """Row 1 is fed a pad token with mask 0 after its prompt (a finished row), then every row decodes on. With
    ``full_width`` the loop makes its mask at the final width up front and passes all of it at every step (stock
    cuts it to the columns so far)."""
    kw = {astrai_hf.cache_kwarg(model): cache, "use_cache": True}
    steps, logits = 4, []
    final = torch.cat([mask, torch.ones(mask.shape[0], steps, dtype=mask.dtype)], 1)
    final[1, mask.shape[1]] = 0
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, **kw)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        tok = torch.where(final[:, mask.shape[1] :][:, :1].bool(), tok, 0)
        for i in range(steps):
            width = mask.shape[1] + i + 1
            out = model(input_ids=tok, attention_mask=final if full_width else final[:, :width], **kw)
            logits.append(out.logits[:, -1])
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
    return torch.stack(logits, 1)


@pytest.mark.parametrize("full_width", [False, True])
@pytest.mark.parametrize("arch", ["llama", "gemma2", "gpt2"])
def test_a_column_masked_after_the_prompt_is_masked_as_stock_masks_it(arch, full_width):
    # paged attention masks by each row's stored length alone: such a step runs the model's own attention over
    # the pool's K/V, which applies the mask
    model = tiny_model(arch)
    ids, mask = left_padded_batch([3, 7, 5], seed=1)
    ref = _loop_with_a_masked_column(model, _dynamic(model), ids, mask, full_width)
    pool = PagePool.from_model(model, max_tokens=1024)
    with astrai_hf.patched(model, pool=pool):
        with PagedCache(pool) as cache:
            got = _loop_with_a_masked_column(model, cache, ids, mask, full_width)
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
        assert pool.stats()["num_used_pages"] == 0
        # such a row's K/V follow from more than its token ids: none of it went to the prefix cache
        assert pool.stats()["num_cached_pages"] == 0


@pytest.mark.parametrize("asked", ["keyword", "config"])
@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_a_forward_of_ones_own_asking_for_attentions_gets_them(arch, asked):
    model = tiny_model(arch)
    model.set_attn_implementation("eager")  # (sdpa returns no weights, in stock too; gemma2 is eager already)
    ids, mask = left_padded_batch([3, 7, 5], seed=1)
    if asked == "config":  # (config.output_attentions alone asks for them too)
        model.config.output_attentions = True
    ask = dict(output_attentions=True) if asked == "keyword" else {}
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, use_cache=True, **ask,
                    **{astrai_hf.cache_kwarg(model): _dynamic(model)}).attentions
        pool = PagePool.from_model(model, max_tokens=1024)
        with astrai_hf.patched(model, pool=pool), PagedCache(pool) as cache:
            got = model(input_ids=ids, attention_mask=mask, use_cache=True, **ask,
                        **{astrai_hf.cache_kwarg(model): cache}).attentions
    assert len(got) == len(ref) > 0
    for g, r in zip(got, ref):
        real = mask.bool()[:, None, :, None] & mask.bool()[:, None, None, :]  # (rows of padding are meaningless)
        torch.testing.assert_close(g * real, r * real, rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "opt"])
def test_a_padded_batch_with_positions_but_no_mask_attends_the_padding_as_stock(arch):
    # without a mask stock attention sees every column; positions that mark padding do not make a patched
    # forward of one's own drop it
    model = tiny_model(arch)
    ids, mask = left_padded_batch([3, 7, 5], seed=1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    kw = dict(input_ids=ids, position_ids=positions, use_cache=True)
    with torch.no_grad():
        ref = model(**kw, **{astrai_hf.cache_kwarg(model): _dynamic(model)}).logits
        pool = PagePool.from_model(model, max_tokens=1024)
        with astrai_hf.patched(model, pool=pool), PagedCache(pool) as cache:
            got = model(**kw, **{astrai_hf.cache_kwarg(model): cache}).logits
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("patched", [False, True])
def test_batch_select_indices_takes_a_boolean_mask_of_rows_as_dynamic_cache_does(patched):
    model = tiny_model("llama")
    ids, mask = left_padded_batch([3, 7, 5], seed=1)
    kw = lambda cache: {astrai_hf.cache_kwarg(model): cache, "use_cache": True}  # noqa: E731
    pool = PagePool.from_model(model, max_tokens=1024)
    results = []
    with torch.no_grad(), (astrai_hf.patched(model, pool=pool) if patched else _nothing()):
        for make in (lambda: _dynamic(model), lambda: PagedCache(pool, prefix_cache=False)):
            cache = make()
            out = model(input_ids=ids, attention_mask=mask, **kw(cache))
            tok = out.logits[:, -1:].argmax(-1)
            keep = torch.tensor([True, False, True])
            cache.batch_select_indices(keep)
            m = torch.cat([mask[keep], torch.ones(2, 1, dtype=mask.dtype)], 1)
            results.append(model(input_ids=tok[keep], attention_mask=m, **kw(cache)).logits)
            if isinstance(cache, PagedCache):
                with pytest.raises(ValueError, match="boolean mask of 3 entries, but the cache holds 2 rows"):
                    cache.batch_select_indices(torch.tensor([True, False, True]))
                with pytest.raises(ValueError, match="integer row indices"):
                    cache.batch_select_indices(torch.tensor([0.0, 1.0]))
                with pytest.raises(ValueError, match="boolean tensor"):
                    cache.reorder_cache(torch.tensor([True, True]))
                with pytest.raises(ValueError, match=r"from 0, got \[-1\] in \[0, -1\]"):
                    cache.reorder_cache(torch.tensor([0, -1]))  # (index_select refuses it: stock's IndexError)
                cache.release()
    torch.testing.assert_close(results[1], results[0], rtol=0, atol=1e-5)
    assert pool.stats()["num_used_pages"] == 0


@pytest.mark.parametrize("none", ["[]", "all False"])
def test_selecting_no_rows_leaves_an_empty_cache_of_the_shape_dynamic_cache_has(none):
    # [] had been refused as float indices; with every row dropped the layers had lost their columns too
    model = tiny_model("llama")
    ids, mask = left_padded_batch([3, 7, 5], seed=1)
    pool = PagePool.from_model(model, max_tokens=1024)
    select = [] if none == "[]" else torch.tensor([False, False, False])
    shapes = []
    with torch.no_grad():
        for cache in (_dynamic(model), PagedCache(pool, prefix_cache=False)):
            model(input_ids=ids, attention_mask=mask, use_cache=True, **{astrai_hf.cache_kwarg(model): cache})
            cache.batch_select_indices(select)
            shapes.append((tuple(cache.layers[0].keys.shape), cache.get_seq_length()))
            if isinstance(cache, PagedCache):
                cache.release()
    assert shapes[1] == shapes[0]
    assert pool.stats()["num_used_pages"] == 0


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def test_layers_and_iteration_give_the_keys_and_values_dynamic_cache_holds():
    model = tiny_model("llama")
    ids, mask = left_padded_batch([3, 8, 5], seed=2)
    with torch.no_grad():
        ref = _dynamic(model)
        model(input_ids=ids, attention_mask=mask, use_cache=True, **{astrai_hf.cache_kwarg(model): ref})
        pool = PagePool.from_model(model, max_tokens=1024)
        with PagedCache(pool, ids, mask) as cache:
            assert not cache.layers[0].is_initialized
            model(input_ids=ids, attention_mask=mask, use_cache=True, **{astrai_hf.cache_kwarg(model): cache})
            real = mask.bool()[:, None, :, None]
            assert len(cache.layers) == len(ref.layers) == model.config.num_hidden_layers
            for got, want in zip(cache.layers, ref.layers):
                assert got.keys.shape == want.keys.shape and got.get_seq_length() == want.get_seq_length()
                torch.testing.assert_close(got.keys * real, want.keys * real, rtol=0, atol=0)
                torch.testing.assert_close(got.values * real, want.values * real, rtol=0, atol=0)
                assert not got.keys[~real.expand_as(got.keys)].any()  # padding is not stored: zeros there
            assert [k.shape for k, _, _ in cache] == [k.shape for k, _, _ in ref]
            assert cache.get_seq_length(model.config.num_hidden_layers) == 0 == ref.get_seq_length(5)
            with pytest.raises(ValueError, match="layer_idx=7 is outside"):
                cache.layer_kv(7)
    empty = PagedCache(pool)
    assert empty.layers[1].keys.shape == (0, 2, 0, 16) and not empty.layers[1].is_initialized


def test_generate_hands_back_a_cache_whose_layers_transformers_can_walk():
    # transformers' deferred stop check (Apple's MPS) walks cache.layers when generate() returns the cache; a
    # CPU stands in for the device here
    from transformers.generation import utils as generation_utils

    if not hasattr(generation_utils, "DeferredStopCheck"):
        pytest.skip("this transformers release has no deferred stop check")
    model = tiny_model("llama")
    model.generation_config.eos_token_id = 5
    ids, mask = left_padded_batch([3, 7, 5])
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, return_dict_in_generate=True)
    ref = model.generate(ids, **kw).sequences

    class _Event:  # a host-side event: the CPU runs in order
        def __init__(self, *args, **kwargs):
            pass

        record = synchronize = lambda self: None

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "Event", _Event)
        mp.setattr(generation_utils.DeferredStopCheck, "is_supported", staticmethod(lambda *a, **k: True))
        with astrai_hf.patched(model):
            out = model.generate(ids, **kw).sequences
            assert astrai_hf.get_pool(model).stats()["num_used_pages"] == 0
    assert torch.equal(out, ref)


@pytest.mark.parametrize("patched", [False, True])
@pytest.mark.parametrize("arch", ["llama", "opt"])
@pytest.mark.parametrize("case", ["crop-everything", "crop-into-the-padding"])
def test_a_row_cropped_into_its_left_padding_stores_what_is_fed_there_next(case, arch, patched):
    # the cache had kept the row's old padding count: tokens fed into those columns after the crop were taken as
    # padding, not stored, and gave other logits than DynamicCache's
    model = tiny_model(arch, seed=1)
    pool = PagePool.from_model(model, max_tokens=512, page_size=4)
    ids, mask = left_padded_batch([4, 9], seed=2)  # row 0: 5 columns of padding

    def run(cache):
        kw = {astrai_hf.cache_kwarg(model): cache, "use_cache": True}
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, **kw)
            if case == "crop-everything":  # then a batch of other padding
                cache.crop(-cache.get_seq_length())
                ids2, mask2 = left_padded_batch([8, 3], seed=4)
            else:  # back to column 2, then 3 tokens every row holds
                cache.crop(2 - ids.shape[1])
                ids2 = torch.tensor([[10, 11, 12]] * 2)
                mask2 = torch.cat([mask[:, :2], torch.ones(2, 3, dtype=mask.dtype)], 1)
            return model(input_ids=ids2, attention_mask=mask2, **kw).logits, mask2[:, -ids2.shape[1]:].bool()

    want, real = run(_dynamic(model))
    with astrai_hf.patched(model, pool=pool) if patched else _nothing():
        with PagedCache(pool, prefix_cache=False) as cache:
            got, _ = run(cache)
    torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)
    assert pool.stats()["num_used_pages"] == 0


@pytest.mark.parametrize("grow", ["batch_repeat_interleave", "reorder_cache"])
def test_rows_that_do_not_fit_leave_the_cache_as_it_was(grow):
    # growing past max_reqs raised CacheFullError after the padding of the new row count was recorded: the
    # cache, still holding its 2 rows, then gave row 1 other logits (patched) or failed inside (unpatched)
    from astrai_hf import CacheFullError

    model = tiny_model("llama", seed=1)
    ids, mask = left_padded_batch([4, 7], seed=2)
    step, m2 = torch.tensor([[5], [6]]), torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
    dynamic = _dynamic(model)
    kw = lambda cache: {astrai_hf.cache_kwarg(model): cache, "use_cache": True}  # noqa: E731
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, **kw(dynamic))
        want = model(input_ids=step, attention_mask=m2, **kw(dynamic)).logits
        with astrai_hf.patched(model, max_tokens=512, max_reqs=4):
            pool = astrai_hf.get_pool(model)
            with PagedCache(pool, prefix_cache=False) as cache:
                model(input_ids=ids, attention_mask=mask, **kw(cache))
                before = repr(cache)
                with pytest.raises(CacheFullError, match="growing 2 rows to 6"):
                    if grow == "reorder_cache":
                        cache.reorder_cache(torch.tensor([0, 0, 0, 1, 1, 1]))
                    else:
                        cache.batch_repeat_interleave(3)
                assert repr(cache) == before
                got = model(input_ids=step, attention_mask=m2, **kw(cache)).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert pool.stats()["num_used_pages"] == 0 and pool.stats()["num_reqs_used"] == 0


@torch.no_grad()
def test_a_hole_inside_a_prompt_under_the_models_own_attention_is_no_padding():
    # output_attentions=True: the model's own attention over the gathered K/V, which applies the mask's hole; the
    # hole had been counted as the row's padding (a token not stored): other logits at both steps
    model = tiny_model("llama")
    ids, mask = torch.tensor([[5, 6, 7, 8, 9, 10]]), torch.tensor([[1, 1, 0, 1, 1, 1]])
    mask2 = torch.cat([mask, torch.ones(1, 1, dtype=mask.dtype)], 1)

    def run(cache):
        kw = {astrai_hf.cache_kwarg(model): cache, "use_cache": True}
        first = model(ids, attention_mask=mask, output_attentions=True, **kw).logits
        return first, model(torch.tensor([[11]]), attention_mask=mask2, **kw).logits

    want = run(_dynamic(model))
    with astrai_hf.patched(model, max_tokens=512, page_size=4):
        pool = astrai_hf.get_pool(model)
        with PagedCache(pool) as cache:
            got = run(cache)
            assert cache.seq_lens == [7]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert pool.stats()["num_used_pages"] == 0


def test_a_forward_that_failed_midway_and_was_released_offers_only_what_every_layer_stored():
    # an unpatched model's second chunk raised in layer 1 after layer 0 stored it; released without a crop, the
    # cache offers the prefix cache only the first chunk, which every layer holds (a later call had been served
    # the half-stored tokens: other tokens than stock's)
    model = tiny_model("llama")
    full = torch.randint(3, 96, (1, 16), generator=torch.Generator().manual_seed(0))
    kw = dict(attention_mask=torch.ones_like(full), max_new_tokens=5, do_sample=False)
    ref = model.generate(full, **kw)
    pool = PagePool.from_model(model, max_tokens=512, page_size=4)
    cache = PagedCache(pool, full[:, :8], torch.ones_like(full[:, :8]))
    name = astrai_hf.cache_kwarg(model)

    def stop(*args):
        raise RuntimeError("stopped in layer 1")

    with torch.no_grad():
        model(full[:, :4], **{name: cache})
        handle = model.model.layers[1].register_forward_pre_hook(stop)
        try:
            with pytest.raises(RuntimeError, match="stopped in layer 1"):
                model(full[:, 4:8], **{name: cache})
        finally:
            handle.remove()
    cache.release()
    with astrai_hf.patched(model, pool=pool):
        assert torch.equal(model.generate(full, **kw), ref)
    assert pool.stats()["prefix_hit_tokens"] == 4
    assert pool.stats()["num_used_pages"] == 0


def test_tokens_fed_after_embeddings_of_ones_own_offer_nothing_to_the_prefix_cache():
    # a soft prompt (embeddings no token id stands for), then a token id: the cache knows no ids for the first
    # columns, so nothing is a prefix; the step of ids had counted them known, and the request row's ids of an
    # earlier call keyed the soft prompt's K/V
    model = tiny_model("llama")
    prompt = torch.randint(3, 96, (1, 8), generator=torch.Generator().manual_seed(4))
    longer = torch.cat([prompt, torch.tensor([[50, 51, 52, 53]])], 1)
    kw = dict(max_new_tokens=5, do_sample=False)
    ref = model.generate(longer, attention_mask=torch.ones_like(longer), **kw)
    with astrai_hf.patched(model, max_tokens=512, page_size=4):
        pool = astrai_hf.get_pool(model)
        model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=1, do_sample=False)
        pool.clear_prefix_cache()  # (the request row keeps the prompt's ids)
        name = astrai_hf.cache_kwarg(model)
        with PagedCache(pool) as cache, torch.no_grad():
            out = model(inputs_embeds=model.get_input_embeddings()(prompt) * 1.5, **{name: cache})
            model(out.logits[:, -1:].argmax(-1), **{name: cache})
        hits = pool.stats()["prefix_hit_tokens"]
        assert torch.equal(model.generate(longer, attention_mask=torch.ones_like(longer), **kw), ref)
        assert pool.stats()["prefix_hit_tokens"] == hits
    assert pool.stats()["num_used_pages"] == 0


def test_embeddings_fed_on_a_cache_built_with_the_prompt_offer_nothing_to_the_prefix_cache():
    # the cache took the K/V of the forward's embeddings (a soft prompt, scaled) for those of the ids it was built
    # with, and a later call of those ids was served them
    model = tiny_model("llama")
    ids, mask = left_padded_batch([9])
    kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False)
    ref = model.generate(ids, **kw)
    with astrai_hf.patched(model, max_tokens=512, page_size=4):
        pool = astrai_hf.get_pool(model)
        with PagedCache(pool, ids, mask) as cache, torch.no_grad():
            model(inputs_embeds=model.get_input_embeddings()(ids) * 1.5, attention_mask=mask,
                  **{astrai_hf.cache_kwarg(model): cache})
        assert pool.stats()["num_cached_pages"] == 0
        assert torch.equal(model.generate(ids, **kw), ref)
    assert pool.stats()["num_used_pages"] == 0


def _steer(module, args, out):
    return (out[0] + 1.0, *out[1:]) if isinstance(out, tuple) else out + 1.0


@contextlib.contextmanager
def _for_one_forward(model, change):
    """A change of ``model`` made for one forward and undone after it."""
    layer = model.model.layers[0]
    if change == "forward hook":
        handle = layer.register_forward_hook(_steer)
        yield
        handle.remove()
    elif change == "global forward hook":
        handle = torch.nn.modules.module.register_module_forward_hook(
            lambda m, args, out: out + 1.0 if isinstance(m, torch.nn.Embedding) else None)
        yield
        handle.remove()
    elif change == "submodule swapped":
        act = layer.mlp.act_fn
        layer.mlp.act_fn = torch.nn.Softplus(beta=2)
        yield
        layer.mlp.act_fn = act
    elif change == "parameter reassigned":
        emb = model.model.embed_tokens
        weight = emb.weight
        emb.weight = torch.nn.Parameter(weight.detach() + 0.5)
        yield
        emb.weight = weight
    elif change == "sliding window":
        window = model.config.sliding_window
        model.config.sliding_window = 2
        yield
        model.config.sliding_window = window


@pytest.mark.parametrize("change", ["forward hook", "global forward hook", "submodule swapped",
                                    "parameter reassigned", "sliding window"])
@pytest.mark.parametrize("step", ["prefill", "extend"])
def test_a_change_made_and_undone_within_a_caches_life_keeps_its_k_v_from_later_calls(change, step):
    # the prefix cache is checked against the model at a lookup: a change undone before the cache's release was
    # never seen, and a later call of the same ids was served K/V the change computed
    model = tiny_model("qwen2" if change == "sliding window" else "llama")
    ids, mask = left_padded_batch([11])
    kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False)
    ref = model.generate(ids, **kw)
    name = astrai_hf.cache_kwarg(model)
    with astrai_hf.patched(model, max_tokens=512, page_size=4):
        pool = astrai_hf.get_pool(model)
        with PagedCache(pool, ids, mask) as cache, torch.no_grad():
            if step == "extend":  # a plain first forward, then the change for the next tokens only
                model(input_ids=ids[:, :6], attention_mask=mask[:, :6], **{name: cache})
                ids_fed, mask_fed = ids[:, 6:], mask
            else:
                ids_fed, mask_fed = ids, mask
            with _for_one_forward(model, change):
                model(input_ids=ids_fed, attention_mask=mask_fed, **{name: cache})
        assert pool.stats()["num_cached_pages"] == 0
        assert torch.equal(model.generate(ids, **kw), ref)
    assert pool.stats()["num_used_pages"] == 0


def _failing_midway_setup():
    """A tiny llama, a left-padded prompt of 2 rows and its mask, the mask and tokens of the next step, and the
    keywords handing a forward a cache."""
    model = tiny_model("llama", seed=1)
    ids, mask = left_padded_batch([4, 9], seed=2)
    m2 = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
    tok = torch.tensor([[5], [6]])
    return model, ids, mask, m2, tok, lambda cache: {astrai_hf.cache_kwarg(model): cache, "use_cache": True}


def test_a_forward_that_failed_midway_on_an_unpatched_model_is_named_on_the_next_and_crop_recovers():
    # the next forward had planned a new step over the half-stored one and given other logits than a clean run,
    # without a word (stock's layers of different lengths fail there). A copy of the cache had not carried the
    # unfinished step, and crop(0) (nothing dropped) had forgotten it: their next forward ran without a word too
    model, ids, mask, m2, tok, kw = _failing_midway_setup()
    pool = PagePool.from_model(model, max_tokens=512, page_size=4)
    with torch.no_grad():
        dynamic = _dynamic(model)
        model(input_ids=ids, attention_mask=mask, **kw(dynamic))
        want = model(input_ids=tok, attention_mask=m2, **kw(dynamic)).logits
        with PagedCache(pool, prefix_cache=False) as cache:
            model(input_ids=ids, attention_mask=mask, **kw(cache))

            def fail(*_):
                raise RuntimeError("stopped")

            hook = model.model.layers[0].self_attn.register_forward_hook(fail)  # after layer 0 stored its K/V
            with pytest.raises(RuntimeError, match="stopped"):
                model(input_ids=tok, attention_mask=m2, **kw(cache))
            hook.remove()
            with pytest.raises(ValueError, match=r"stopped after 1 of 2 layers .* call cache.crop\(-1\)"):
                model(input_ids=tok, attention_mask=m2, **kw(cache))
            for copier in (copy.deepcopy, copy.copy):
                with pytest.raises(ValueError, match=r"cannot copy this PagedCache.*cache.crop\(-1\)"):
                    copier(cache)
            cache.crop(0)
            with pytest.raises(ValueError, match=r"stopped after 1 of 2 layers .* call cache.crop\(-1\)"):
                model(input_ids=tok, attention_mask=m2, **kw(cache))
            cache.crop(-1)
            assert cache.get_seq_length() == 9
            with copy.deepcopy(cache) as twin:
                got_twin = model(input_ids=tok, attention_mask=m2, **kw(twin)).logits
            got = model(input_ids=tok, attention_mask=m2, **kw(cache)).logits
    torch.testing.assert_close(got_twin, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert pool.stats()["num_used_pages"] == 0


@pytest.mark.parametrize("failed", ["prefill", "decode step"])
def test_a_forward_that_failed_midway_on_a_patched_model_is_rolled_back_by_itself(failed):
    # a patched model drops the unfinished step itself: the next forward equals a clean run's
    model, ids, mask, m2, tok, kw = _failing_midway_setup()
    with torch.no_grad():
        dynamic = _dynamic(model)
        want_prefill = model(input_ids=ids, attention_mask=mask, **kw(dynamic)).logits
        want_step = model(input_ids=tok, attention_mask=m2, **kw(dynamic)).logits
    with astrai_hf.patched(model, max_tokens=512, page_size=4), torch.no_grad():
        pool = astrai_hf.get_pool(model)
        with PagedCache(pool, prefix_cache=False) as cache:
            if failed == "decode step":
                model(input_ids=ids, attention_mask=mask, **kw(cache))
            inputs = dict(input_ids=tok, attention_mask=m2) if failed == "decode step" else dict(
                input_ids=ids, attention_mask=mask)
            hook = model.model.layers[0].self_attn.register_forward_hook(  # after layer 0 stored its K/V
                lambda *_: (_ for _ in ()).throw(RuntimeError("stopped")))
            with pytest.raises(RuntimeError, match="stopped"):
                model(**inputs, **kw(cache))
            hook.remove()
            assert cache.get_seq_length() == (9 if failed == "decode step" else 0)
            got = model(**inputs, **kw(cache)).logits
            if failed == "prefill":
                torch.testing.assert_close(got[mask.bool()], want_prefill[mask.bool()], rtol=1e-5, atol=1e-5)
                got = model(input_ids=tok, attention_mask=m2, **kw(cache)).logits
            torch.testing.assert_close(got, want_step, rtol=1e-5, atol=1e-5)
        assert pool.stats()["num_used_pages"] == 0


@pytest.mark.parametrize("op", ["reorder_cache", "batch_select_indices", "batch_repeat_interleave"])
def test_a_row_operation_after_a_forward_that_failed_midway_names_crop_and_keeps_the_cache(op):
    # the row operation had forgotten the unfinished step: the next forward ran without a word on a column that
    # layer 1 never filled (stock's layers of different lengths fail there)
    model, ids, mask, m2, tok, kw = _failing_midway_setup()
    rows = {"reorder_cache": torch.tensor([1, 0]), "batch_select_indices": torch.tensor([1, 0]),
            "batch_repeat_interleave": 1}[op]
    pool = PagePool.from_model(model, max_tokens=512, page_size=4)
    with torch.no_grad():
        dynamic = _dynamic(model)
        model(input_ids=ids, attention_mask=mask, **kw(dynamic))
        getattr(dynamic, op)(rows)
        want = model(input_ids=tok.flip(0) if op != "batch_repeat_interleave" else tok,
                     attention_mask=m2.flip(0) if op != "batch_repeat_interleave" else m2, **kw(dynamic)).logits
        with PagedCache(pool, prefix_cache=False) as cache:
            model(input_ids=ids, attention_mask=mask, **kw(cache))
            hook = model.model.layers[0].self_attn.register_forward_hook(lambda *_: 1 / 0)
            with pytest.raises(ZeroDivisionError):
                model(input_ids=tok, attention_mask=m2, **kw(cache))
            hook.remove()
            before = repr(cache)
            with pytest.raises(ValueError, match=r"cannot reorder or select the rows .* stopped after 1 of 2 layers"
                                                 r".*cache.crop\(-1\)"):
                getattr(cache, op)(rows)
            assert repr(cache) == before
            cache.crop(-1)
            getattr(cache, op)(rows)
            got = model(input_ids=tok.flip(0) if op != "batch_repeat_interleave" else tok,
                        attention_mask=m2.flip(0) if op != "batch_repeat_interleave" else m2, **kw(cache)).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert pool.stats()["num_used_pages"] == 0


def test_a_forward_of_another_length_after_one_that_failed_midway_keeps_the_cache_for_crop():
    # it had been taken for cross-attention K/V: the cache was released, and after the crop() the message advised,
    # the next forwards ran on an empty cache without a word
    model = tiny_model("llama", seed=1)
    ids, mask = left_padded_batch([4, 9], seed=2)
    kw = lambda cache: {astrai_hf.cache_kwarg(model): cache, "use_cache": True}  # noqa: E731
    ones = lambda n: torch.ones(2, n, dtype=mask.dtype)  # noqa: E731
    two = torch.tensor([[5, 7], [6, 8]])
    pool = PagePool.from_model(model, max_tokens=512, page_size=4)
    with torch.no_grad():
        dynamic = _dynamic(model)
        model(input_ids=ids, attention_mask=mask, **kw(dynamic))
        want = model(input_ids=two, attention_mask=torch.cat([mask, ones(2)], 1), **kw(dynamic)).logits
        with PagedCache(pool, prefix_cache=False) as cache:
            model(input_ids=ids, attention_mask=mask, **kw(cache))
            hook = model.model.layers[0].self_attn.register_forward_hook(lambda *_: 1 / 0)
            with pytest.raises(ZeroDivisionError):
                model(input_ids=two[:, :1], attention_mask=torch.cat([mask, ones(1)], 1), **kw(cache))
            hook.remove()
            with pytest.raises(ValueError, match=r"stores K/V of 2 tokens x 2 rows while the step of 1 x 2 is "
                                                 r"unfinished.*stopped after 1 of 2 layers.*cache.crop\(-1\)"):
                model(input_ids=two, attention_mask=torch.cat([mask, ones(2)], 1), **kw(cache))
            assert cache.get_seq_length() == 10
            cache.crop(-1)
            got = model(input_ids=two, attention_mask=torch.cat([mask, ones(2)], 1), **kw(cache)).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert pool.stats()["num_used_pages"] == 0


@pytest.mark.parametrize("patched", [False, True])
@pytest.mark.parametrize("select", ["reorder_cache([1, 0])", "batch_select_indices([1])", "batch_select_indices([0])"])
def test_rows_of_a_pre_filled_cache_selected_before_its_first_forward_continue_at_their_own_positions(select, patched):
    # the prompt's padding stayed in the old row order, so generate()'s positions for the selected rows were refused
    model = tiny_model("llama", seed=3)
    ids, mask = left_padded_batch([3, 12], seed=7)  # row 0: 9 columns of padding
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    idx = [1, 0] if select.startswith("reorder") else [int(select[-3])]
    pool = PagePool.from_model(model, max_tokens=1024, page_size=4)
    kwarg = astrai_hf.cache_kwarg(model)
    with astrai_hf.patched(model, pool=pool):
        model.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False)  # the prompts, cached
    with torch.no_grad(), astrai_hf.patched(model, pool=pool) if patched else contextlib.nullcontext():
        with PagedCache(pool, ids, mask) as cache:
            L = cache.get_seq_length()
            assert L == 11
            dynamic = _dynamic(model)
            model(input_ids=ids[:, :L], attention_mask=mask[:, :L], position_ids=positions[:, :L], **{kwarg: dynamic})
            for c in (dynamic, cache):
                if select.startswith("reorder"):
                    c.reorder_cache(torch.tensor(idx))
                else:
                    c.batch_select_indices(torch.tensor(idx))
            logits = [model(input_ids=ids[idx, L:], attention_mask=mask[idx], position_ids=positions[idx, L:],
                            **{kwarg: c}).logits[:, -1] for c in (dynamic, cache)]
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)
    assert pool.stats()["num_used_pages"] == 0


@pytest.mark.parametrize("autocast", [False, True])
def test_a_selected_row_whose_served_columns_are_its_padding_runs_as_stock_without_positions(autocast):
    # such a row holds no served K/V, so no positions contradict them: a forward without position_ids (the model
    # counts the padding, as stock does for the same row) had been refused, and so had a first step under autocast
    model = tiny_model("llama", seed=3)
    ids, mask = left_padded_batch([3, 12], seed=7)  # row 0: 9 columns of padding
    one, m1 = ids[:1], mask[:1]
    kwarg = astrai_hf.cache_kwarg(model)
    pool = PagePool.from_model(model, max_tokens=1024, page_size=4)
    with astrai_hf.patched(model, pool=pool):
        model.generate(ids[1:], attention_mask=mask[1:], max_new_tokens=1, do_sample=False)  # row 1, cached
    run = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if autocast else contextlib.nullcontext
    with torch.no_grad():
        with run():
            want = model(input_ids=one, attention_mask=m1).logits[:, -3:]
        with PagedCache(pool, ids, mask, model=model) as cache:
            cache.batch_select_indices(torch.tensor([0]))
            n = cache.get_seq_length()
            assert n == 9 and cache.prefilled_from_prefix_cache
            with run():
                got = model(input_ids=one[:, n:], attention_mask=m1, **{kwarg: cache}).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert pool.stats()["num_used_pages"] == 0


def test_layer_methods_a_paged_cache_does_not_have_say_what_to_call_instead():
    # they had failed with a bare AttributeError of PagedLayer (or, for early_initialization, of supports_early_init)
    model = tiny_model("llama")
    ids, mask = left_padded_batch([4, 6], seed=1)
    pool = PagePool.from_model(model, max_tokens=256, page_size=4)
    with torch.no_grad(), PagedCache(pool, prefix_cache=False) as cache:
        model(input_ids=ids, attention_mask=mask, **{astrai_hf.cache_kwarg(model): cache})
        cache.early_initialization(2, 2, 16, torch.float32, "cpu")  # the pool is allocated already
        layer = cache.layers[0]
        for call in (lambda: cache.offload(0), layer.offload, layer.prefetch):
            with pytest.raises(NotImplementedError, match="K/V live in its PagePool"):
                call()
        for name in ("crop", "reset", "lazy_initialization"):
            with pytest.raises(AttributeError, match=f"read-only view .* it has no '{name}'"):
                getattr(layer, name)
        with pytest.raises(AttributeError, match="its values cannot be assigned"):
            layer.values = torch.zeros(1)
        assert not hasattr(layer, "is_sliding") and getattr(layer, "max_cache_len", None) is None
        assert cache.get_seq_length() == 6
    assert pool.stats()["num_used_pages"] == 0


def _peft_wrapped(base, adapters: str):
    """``base`` under peft LoRA adapters acting per row (``adapter_names``, two adapters) or per position (an
    activated LoRA with invocation tokens 7, 8, 9)."""
    peft = pytest.importorskip("peft")
    lora = dict(task_type="CAUSAL_LM", r=8, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj"],
                init_lora_weights=False)
    torch.manual_seed(3)
    if adapters == "activated LoRA":
        return peft.get_peft_model(base, peft.LoraConfig(**lora, alora_invocation_tokens=[7, 8, 9])).eval()
    m = peft.get_peft_model(base, peft.LoraConfig(**lora), adapter_name="x")
    m.add_adapter("y", peft.LoraConfig(**lora))
    return m.eval()


def _patched_peft(base, adapters: str, patched_first: bool, **settings):
    """(peft model, the model patch() was given): the base model patched before peft wraps it, or the peft model."""
    if patched_first:
        astrai_hf.patch(base, **settings)
        return _peft_wrapped(base, adapters), base
    model = _peft_wrapped(base, adapters)
    astrai_hf.patch(model, **settings)
    return model, model


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "decode graphs (CPU stand-in)"])
@pytest.mark.parametrize("patched_first", [False, True], ids=["peft model patched", "base model patched, then peft"])
def test_a_loop_of_ones_own_with_peft_adapter_names_per_row_runs_its_rows_as_fed(patched_first, graphs):
    # peft's per-row adapter_names name 3 rows: a prefill packed into one row, or a decode step padded to a graph
    # bucket of 4, had made peft raise ValueError ("got 3 and 1", "got 3 and 4")
    base = tiny_model("llama")
    ids, mask = left_padded_batch([5, 7, 9], seed=2)
    names = ["x", "y", "x"]

    def loop(m, cache):
        positions, am, x, logits = (mask.cumsum(-1) - 1).clamp(min=0), mask, ids, []
        with torch.no_grad():
            for _ in range(4):
                out = m(input_ids=x, attention_mask=am, position_ids=positions, use_cache=True, logits_to_keep=1,
                        adapter_names=names, **{astrai_hf.cache_kwarg(base): cache})
                logits.append(out.logits[:, -1])
                x = out.logits[:, -1].argmax(-1, keepdim=True)
                am, positions = torch.cat([am, torch.ones(3, 1, dtype=am.dtype)], 1), positions[:, -1:] + 1
        return logits

    ref = loop(_peft_wrapped(copy.deepcopy(base), "adapter_names"), DynamicCache())
    model, patched = _patched_peft(base, "adapter_names", patched_first, max_tokens=1024, page_size=4,
                                   cuda_graphs=graphs)
    try:
        pool = astrai_hf.get_pool(patched)
        with PagedCache(pool, prefix_cache=False) as cache:
            got = loop(model, cache)
        for a, b in zip(got, ref, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert pool.stats()["num_used_pages"] == 0
    finally:
        astrai_hf.unpatch(patched)


@pytest.mark.parametrize("told", ["the patched model", "the peft model"])
@pytest.mark.parametrize("patched_first", [False, True], ids=["peft model patched", "base model patched, then peft"])
def test_a_cache_built_for_an_activated_lora_is_not_pre_filled_from_the_prefix_cache(patched_first, told):
    # an activated LoRA adapts the tokens after each prompt's last invocation sequence: a cache built with the
    # prompt had been pre-filled with a prefix adapted for another prompt (scores 1.12 off) where it was told the
    # base model patched before peft wrapped it (that model knows no peft config)
    base = tiny_model("llama")
    g = torch.Generator().manual_seed(1)
    x, y, z, w = (torch.randint(10, 96, (1, n), generator=g) for n in (8, 8, 4, 3))
    invocation = torch.tensor([[7, 8, 9]])
    first, second = torch.cat([x, invocation, y], 1), torch.cat([x, invocation, y, z, invocation, w], 1)
    with torch.no_grad():
        ref = _peft_wrapped(copy.deepcopy(base), "activated LoRA")(input_ids=second).logits[:, -1]
    model, patched = _patched_peft(base, "activated LoRA", patched_first, max_tokens=1024, page_size=4)
    target = patched if told == "the patched model" else model
    pool = astrai_hf.get_pool(patched)
    name = astrai_hf.cache_kwarg(base)
    try:
        with torch.no_grad():
            with PagedCache(pool, first, torch.ones_like(first), model=target) as cache:
                model(input_ids=first, use_cache=True, **{name: cache})
            with PagedCache(pool, second, torch.ones_like(second), model=target) as cache:
                assert cache.get_seq_length() == 0
                got = model(input_ids=second, use_cache=True, **{name: cache}).logits[:, -1]
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        assert pool.stats()["num_used_pages"] == 0
    finally:
        astrai_hf.unpatch(patched)


@pytest.mark.parametrize("first", ["with autograd on", "asking for attentions", "under a 4-D mask", "then generate()"])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_first_forward_the_models_own_attention_runs_stores_no_padding_for_the_paged_steps_after(first, arch):
    # such a forward stores its K/V through update(), which before transformers 5.24 is handed no positions: a
    # cache told no prompt stored the padding columns as tokens, and the paged steps after it attended them
    # (scores 0.15-1.8 off on the padded row)
    model = tiny_model(arch, attn_implementation="eager")
    ids, mask = left_padded_batch([6, 9], seed=1)
    kw = dict(attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), use_cache=True,
              output_attentions=first == "asking for attentions")
    if first in ("under a 4-D mask", "then generate()"):  # (an additive float mask: 0 where seen)
        n = ids.shape[1]
        seen = torch.tril(torch.ones(n, n, dtype=torch.bool))[None] & mask.bool()[:, None, :]
        kw["attention_mask"] = torch.where(seen, 0.0, torch.finfo(torch.float32).min)[:, None]

    def run(m, cache):
        name = astrai_hf.cache_kwarg(m)
        grad = contextlib.nullcontext() if first == "with autograd on" else torch.no_grad()
        with grad:
            tok = m(input_ids=ids, **kw, **{name: cache}).logits[:, -1:].argmax(-1)
        tokens, logits, grown = [], [], mask
        if first == "then generate()":
            out = m.generate(torch.cat([ids, tok], 1), attention_mask=torch.cat([mask, torch.ones_like(tok)], 1),
                             max_new_tokens=5, do_sample=False, return_dict_in_generate=True, output_logits=True,
                             **{name: cache})
            return out.sequences[:, -5:], torch.stack(out.logits, 1)
        with torch.no_grad():
            for _ in range(5):
                grown = torch.cat([grown, torch.ones_like(tok)], 1)
                out = m(input_ids=tok, attention_mask=grown, use_cache=True, **{name: cache})
                tok = out.logits[:, -1:].argmax(-1)
                tokens.append(tok)
                logits.append(out.logits[:, -1])
        return torch.cat(tokens, 1), torch.stack(logits, 1)

    ref = run(model, _dynamic(model))
    with astrai_hf.patched(model, max_tokens=1024, page_size=4) as patched, \
            PagedCache(astrai_hf.get_pool(patched)) as cache:
        got = run(patched, cache)
        assert cache.seq_lens == [6 + 5, 9 + 5]  # (no padding stored)
    assert torch.equal(got[0], ref[0])
    torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache_made", ["with the prompt", "empty"])
def test_dropout_switched_on_after_patch_applies_in_a_loop_of_ones_own(cache_made):
    # a cache built with the prompt skipped the per-cache look at the model, so the modules that drop out were
    # those listed at patch(): a layer's attention dropout switched on since ran paged attention, without it
    model = tiny_model("llama")
    ids, mask = left_padded_batch([6, 6], seed=3)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    astrai_hf.patch(model, max_tokens=512)
    try:
        attention = model.model.layers[0].self_attn
        attention.attention_dropout = 0.5
        attention.train()

        def run(cache):
            torch.manual_seed(0)
            with torch.no_grad():
                return model(ids, attention_mask=mask, position_ids=pos, **{astrai_hf.cache_kwarg(model): cache}).logits

        ref = run(_dynamic(model))
        pool = astrai_hf.get_pool(model)
        cache = PagedCache(pool, ids, mask) if cache_made == "with the prompt" else PagedCache(pool)
        try:
            torch.testing.assert_close(run(cache), ref, rtol=0, atol=1e-5)
        finally:
            cache.release()
        assert pool.stats()["num_used_pages"] == 0
    finally:
        astrai_hf.unpatch(model)

"""Inputs beyond left-padded text: position ids that restart inside a row, masks of the caller's making, token
types, and image prompts. Each equals stock transformers; none is served K/V keyed by token ids alone."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import transformers as T
from packaging.version import Version

import astrai_hf
from astrai_hf import PagedCache, PagePool
from tiny_models import tiny_model

IMG = 95  # the image placeholder id of the tiny multimodal models


def _packed_documents():
    ids = torch.randint(3, 96, (1, 8), generator=torch.Generator().manual_seed(0))
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])  # two documents of 4 tokens in one row
    blocks = torch.tril(torch.ones(8, 8, dtype=torch.bool))
    blocks[4:, :4] = False
    mask4d = torch.where(blocks, 0.0, torch.finfo(torch.float32).min)[None, None]  # block-diagonal causal
    return ids, pos, mask4d


@pytest.mark.parametrize("with_mask", [False, True], ids=["position_ids", "position_ids+4d_mask"])
@pytest.mark.parametrize("patched", [False, True])
def test_position_ids_that_restart_in_a_row_store_every_token(with_mask, patched):
    model = tiny_model("llama")
    ids, pos, mask4d = _packed_documents()
    extra = {"attention_mask": mask4d} if with_mask else {}
    kw = {astrai_hf.cache_kwarg(model): None}
    name = next(iter(kw))
    pool = PagePool.from_model(model, max_tokens=256)
    with torch.no_grad():
        ref = model(ids, position_ids=pos, use_cache=True, **{name: T.DynamicCache()}, **extra).logits
        if patched:
            astrai_hf.patch(model, pool=pool)
        with PagedCache(pool) as cache:
            out = model(ids, position_ids=pos, use_cache=True, **{name: cache}, **extra).logits
            assert cache.seq_lens == [8]
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    assert pool.stats()["num_used_pages"] == 0


@pytest.mark.parametrize("positions", [[1, 1, 0, 1, 2], [0, 0, 0, 1, 2], [-1, -1, 0, 1, 2]])
def test_left_padding_is_still_read_from_position_ids(positions):
    if Version(T.__version__) < Version("5.24"):
        pytest.skip("transformers passes the layer's position_ids to cache.update() from 5.24 on")
    model = tiny_model("llama")
    pool = PagePool.from_model(model, max_tokens=256)
    ids = torch.randint(3, 96, (1, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), PagedCache(pool) as cache:
        model(ids, position_ids=torch.tensor([positions]), use_cache=True, **{astrai_hf.cache_kwarg(model): cache})
        assert cache.seq_lens == [3]


def test_token_types_are_not_served_from_the_prefix_cache():
    # GPT-2 adds an embedding per token type (zeros included), so the same ids give other K/V with token types
    model = tiny_model("gpt2")
    ids = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, return_dict_in_generate=True,
              output_logits=True)
    types = {"zeros": torch.zeros_like(ids), "ones": torch.ones_like(ids)}
    plain = model.generate(ids, **kw).logits[0]
    stock = {k: model.generate(ids, token_type_ids=t, **kw).logits for k, t in types.items()}
    assert all((stock[k][0] - plain).abs().max() > 0.1 for k in types)  # token types change the logits
    astrai_hf.patch(model, max_tokens=512)
    model.generate(ids, **kw)  # fills the prefix cache for these ids
    for k, t in types.items():
        for a, b in zip(model.generate(ids, token_type_ids=t, **kw).logits, stock[k]):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert astrai_hf.get_pool(model).stats()["num_used_pages"] == 0


def _llava(**text):
    cfg = T.LlavaConfig(
        text_config=dict(dict(model_type="llama", vocab_size=96, hidden_size=64, intermediate_size=128,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2), **text),
        vision_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                           image_size=28, patch_size=14),
        image_token_index=IMG)
    torch.manual_seed(0)
    model = T.LlavaForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(3.0)
    return model


def _images():
    return [torch.randn(1, 3, 28, 28, generator=torch.Generator().manual_seed(s)) for s in (1, 1, 2)]


@pytest.mark.parametrize("build", ["patch", "pool from the config"])
def test_a_length_dependent_rope_in_a_multimodal_models_text_config_gets_no_prefix_reuse(build):
    # the check read the top-level config only: LLaVA's language model with a dynamic RoPE reused prefixes rotated
    # for another forward's length (scores 3-4e-4 off stock)
    rope = {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}
    stock, model = _llava(max_position_embeddings=32, rope_parameters=rope), _llava(max_position_embeddings=32,
                                                                                    rope_parameters=rope)
    assert astrai_hf.config.rope_depends_on_length(model.config)
    g = torch.Generator().manual_seed(0)
    long, prompt = torch.randint(3, 90, (1, 100), generator=g), torch.randint(3, 90, (1, 60), generator=g)
    longer = torch.cat([prompt, torch.randint(3, 90, (1, 70), generator=g)], 1)
    if build == "patch":
        astrai_hf.patch(model, max_tokens=4096, page_size=4, max_seq_len=512)
        pool = astrai_hf.get_pool(model)
    else:
        pool = PagePool(model.config, max_tokens=4096, page_size=4, max_seq_len=512)
        assert pool.rope_by_length
    for ids in (long, prompt, longer):  # each longer than the RoPE's base length: each forward rescales it
        kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, pad_token_id=0,
                  return_dict_in_generate=True, output_scores=True)
        ref = stock.generate(ids, **kw)
        if build == "patch":
            got = model.generate(ids, **kw)
        else:
            with PagedCache(pool, ids, torch.ones_like(ids)) as cache:
                assert cache.get_seq_length() == 0
                got = model.generate(ids, **kw, **{astrai_hf.cache_kwarg(model): cache})
        assert torch.equal(got.sequences, ref.sequences)
        for a, b in zip(got.scores, ref.scores):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert pool.stats()["prefix_hit_tokens"] == 0 and pool.stats()["num_used_pages"] == 0


def test_image_prompts_repeated_and_changed_equal_stock():
    # the same placeholder ids with the same image, then another image: no prefix hit may feed the tail alone
    model = _llava()
    ids = torch.tensor([[1] + [IMG] * 4 + [10, 11, 12, 13, 14]])
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
              pad_token_id=0, eos_token_id=None)
    stock = [model.generate(pixel_values=img, **kw) for img in _images()]
    assert not torch.equal(stock[0], stock[2])  # the image matters
    astrai_hf.patch(model, max_tokens=1024)
    for img, ref in zip(_images(), stock):
        assert torch.equal(model.generate(pixel_values=img, **kw), ref)
    pool = astrai_hf.get_pool(model)
    text = dict(kw, input_ids=ids[:, 5:], attention_mask=torch.ones_like(ids[:, 5:]))
    paged_text = model.generate(**text)  # text alone is paged
    assert pool.stats()["prefix_hit_tokens"] == 0 and pool.stats()["num_cached_pages"] > 0
    assert pool.stats()["num_used_pages"] == 0
    assert torch.equal(paged_text, astrai_hf.unpatch(model).generate(**text))


def _image_features(model, image):
    with torch.no_grad():
        try:
            return model.get_image_features(pixel_values=image, return_dict=True)
        except TypeError:
            pytest.skip("get_image_features() takes return_dict from transformers 5.24 on")


def test_image_features_computed_beforehand_are_not_keyed_by_placeholder_ids():
    # generate(mm_encoder_outputs={"image": features}): a dict, not a tensor, so the call was paged and its image
    # K/V cached under the placeholder ids. The same ids with other features then failed (the hit sliced the image
    # tokens off), and the same ids without an image got the first image's tokens.
    model = _llava()
    ids = torch.tensor([[1] + [IMG] * 4 + [10, 11, 12, 13, 14]])
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, pad_token_id=0,
              eos_token_id=None)
    images = _images()
    features = [_image_features(model, img) for img in images]

    def run(f):  # (a copy: generate() expands the features it is passed in place for samples and beams)
        return model.generate(ids, **kw, **({} if f is None else {"mm_encoder_outputs": {"image": copy.deepcopy(f)}}))

    calls = [features[0], features[2], features[0], None]
    try:
        stock = [run(f) for f in calls]
    except ValueError as e:
        pytest.skip(f"this transformers release takes no mm_encoder_outputs: {e}")
    assert not torch.equal(stock[0], stock[1]) and not torch.equal(stock[0], stock[3])
    astrai_hf.patch(model, max_tokens=1024)
    pool = astrai_hf.get_pool(model)
    for f, ref in zip(calls, stock):
        assert torch.equal(run(f), ref)
    assert pool.stats()["num_used_pages"] == 0


def test_images_through_a_cache_of_the_callers_are_not_keyed_by_placeholder_ids():
    # a PagedCache of the caller's with pixel_values (generate() or a forward of its own) offered its image K/V to
    # the prefix cache: the next image of the same ids failed, a text call of the same ids got the image's tokens
    model = _llava()
    ids = torch.tensor([[1] + [IMG] * 4 + [10, 11, 12, 13, 14]])
    mask = torch.ones_like(ids)
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    images = _images()
    stock = [model.generate(ids, pixel_values=img, **kw) for img in images]
    text = model.generate(ids, **kw)
    assert not torch.equal(stock[0], text)
    pool = PagePool.from_model(model, max_tokens=1024)
    astrai_hf.patch(model, pool=pool)
    name = astrai_hf.cache_kwarg(model)
    for img, ref in zip(images, stock):
        with PagedCache(pool, ids, mask) as cache:
            assert cache.get_seq_length() == 0
            assert torch.equal(model.generate(ids, pixel_values=img, **kw, **{name: cache}), ref)
    with torch.no_grad(), PagedCache(pool) as cache:
        model(ids, attention_mask=mask, pixel_values=images[2], use_cache=True, **{name: cache})
    with torch.no_grad(), PagedCache(pool) as cache:  # pixel_values LLaVA's second positional argument
        model(ids, images[2], attention_mask=mask, use_cache=True, **{name: cache})
    with PagedCache(pool, ids, mask) as cache:
        assert cache.get_seq_length() == 0
    assert torch.equal(model.generate(ids, **kw), text)
    assert pool.stats()["prefix_hit_tokens"] == 0 and pool.stats()["num_used_pages"] == 0


def test_a_one_row_cache_shared_by_rows_of_the_same_ids_and_other_images_computes_each_row():
    # rows were grouped by their ids and mask alone: the second row decoded from the first row's image
    model = _llava()
    ids = torch.tensor([[1] + [IMG] * 4 + [10, 11, 12, 13, 14]])
    batch, images = ids.expand(2, -1).clone(), torch.cat([_images()[0], _images()[2]])
    kw = dict(attention_mask=torch.ones_like(batch), max_new_tokens=6, do_sample=False, pad_token_id=0,
              eos_token_id=None)
    stock = model.generate(batch, pixel_values=images, **kw)
    assert not torch.equal(stock[0], stock[1])
    pool = PagePool.from_model(model, max_tokens=1024, page_size=4)
    astrai_hf.patch(model, pool=pool)
    name = astrai_hf.cache_kwarg(model)
    with PagedCache(pool, prefix_cache=False) as cache:  # one row, shared by the batch
        with torch.no_grad():
            model(input_ids=ids[:, :1], use_cache=True, **{name: cache})
        assert torch.equal(model.generate(batch, pixel_values=images, **kw, **{name: cache}), stock)
    assert pool.stats()["num_used_pages"] == 0


@pytest.mark.parametrize("setting", ["eos_token_id", "pad_token_id"])
def test_a_generation_setting_given_as_a_tensor_keeps_the_prefix_cache(setting):
    # a tensor that is no model input had been taken for an image: the call ran stock, nothing cached or reused
    model = tiny_model("llama")
    ids = torch.randint(3, 90, (1, 12), generator=torch.Generator().manual_seed(1))
    value = torch.tensor([95]) if setting == "eos_token_id" else torch.tensor(0)
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, **{setting: value})
    stock = model.generate(ids, **kw)
    astrai_hf.patch(model, max_tokens=1024, page_size=4)
    for _ in range(2):
        assert torch.equal(model.generate(ids, **kw), stock)
    assert astrai_hf.get_pool(model).stats()["prefix_hit_tokens"] == 11


def _gemma3_multimodal():
    text = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=256, sliding_window=4,
                layer_types=["sliding_attention", "full_attention"], pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cfg = T.Gemma3Config(text_config=text, vision_config=dict(hidden_size=32, num_hidden_layers=1,
                         num_attention_heads=2, intermediate_size=64, image_size=28, patch_size=7),
                         mm_tokens_per_image=4, image_token_index=IMG, boi_token_index=93, eoi_token_index=94)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return T.Gemma3ForConditionalGeneration(cfg).eval()


def test_zero_token_types_of_a_text_prompt_keep_the_prefix_cache():
    # a multimodal processor sends token_type_ids of zeros with plain text; Gemma 3 only masks with them
    model = _gemma3_multimodal()
    ids = torch.randint(3, 90, (1, 12), generator=torch.Generator().manual_seed(0))
    kw = dict(attention_mask=torch.ones_like(ids), token_type_ids=torch.zeros_like(ids), max_new_tokens=5,
              do_sample=False, pad_token_id=0, eos_token_id=None)
    stock = model.generate(ids, **kw)
    astrai_hf.patch(model, max_tokens=1024)
    pool = astrai_hf.get_pool(model)
    for _ in range(2):
        assert torch.equal(model.generate(ids, **kw), stock)
    assert pool.stats()["prefix_hit_tokens"] == 11 and pool.stats()["num_used_pages"] == 0


def test_gemma3_image_spans_attend_both_ways_as_stock():
    model = _gemma3_multimodal()
    ids = torch.tensor([[1, 93] + [IMG] * 4 + [94, 10, 11, 12, 13]])
    tt = (ids == IMG).long()
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=_images()[0], token_type_ids=tt,
              max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None, return_dict_in_generate=True,
              output_logits=True)
    stock = model.generate(**kw)
    pool = PagePool.from_model(model, max_tokens=1024)
    astrai_hf.patch(model, pool=pool)
    paged = model.generate(**kw)
    for a, b in zip(paged.logits, stock.logits):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    with torch.no_grad(), PagedCache(pool) as cache:  # a forward of its own with the image's token types
        forward = model(**{k: kw[k] for k in ("input_ids", "attention_mask", "pixel_values", "token_type_ids")},
                        use_cache=True, **{astrai_hf.cache_kwarg(model): cache}).logits
    torch.testing.assert_close(forward[:, -1], stock.logits[0], rtol=0, atol=1e-6)
    assert pool.stats()["num_used_pages"] == 0


@pytest.mark.parametrize("inputs", ["gemma3 image", "qwen2_vl image", "4D mask"])
def test_a_forward_of_your_own_under_a_mask_of_its_own_leaves_the_prefix_cache_alone(inputs):
    # token types marking an image span (attended both ways), or a 4D mask of the caller's, took the model's own
    # attention and left the cache's K/V marked for the prefix cache: a later text call of the same ids (image
    # placeholders fed as text, or packed documents as one) was served K/V computed under that other mask
    if inputs == "gemma3 image":
        model, ids = _gemma3_multimodal(), torch.tensor([[1, 93] + [IMG] * 4 + [94, 10, 11, 12, 13]])
        forward = dict(pixel_values=_images()[0], token_type_ids=(ids == IMG).long())
    elif inputs == "qwen2_vl image":
        image = _qwen2_vl_image(grid=(1, 4, 4))
        model, ids = _qwen2_vl(), image.pop("input_ids")
        forward = image
    else:
        model, ids = tiny_model("llama"), torch.randint(3, 90, (1, 12), generator=torch.Generator().manual_seed(0))
        allowed = torch.ones(12, 12, dtype=torch.bool).tril()
        allowed[6:, :6] = False  # two packed documents of 6 tokens, positions counted from the cache (not restarted)
        forward = dict(attention_mask=torch.zeros(1, 1, 12, 12).masked_fill(~allowed, float("-inf")))
    mask = torch.ones_like(ids)
    kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0, eos_token_id=None)
    stock = model.generate(ids, **kw)
    astrai_hf.patch(model, max_tokens=1024, page_size=4)
    pool = astrai_hf.get_pool(model)
    with torch.no_grad(), PagedCache(pool, ids, mask) as cache:
        model(**dict(dict(input_ids=ids, attention_mask=mask, use_cache=True, past_key_values=cache), **forward))
    assert pool.stats()["num_cached_pages"] == 0
    assert torch.equal(model.generate(ids, **kw), stock)
    assert pool.stats()["num_used_pages"] == 0


def test_attention_of_a_vision_tower_is_not_taken_for_decoder_layers():
    # Gemma 4's vision encoder layers carry a layer_idx too; only the text decoder's attention owns the cache
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2, max_position_embeddings=256)
    text = dict(**common, head_dim=16, global_head_dim=16, sliding_window=5, num_kv_shared_layers=0,
                layer_types=["sliding_attention", "full_attention"])
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=4, head_dim=8, global_head_dim=8)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = T.Gemma4ForConditionalGeneration(T.Gemma4Config(text_config=text, vision_config=vision,
                                                                  audio_config=None)).eval()
    assert [m.layer_idx for m in astrai_hf.pool.attention_modules(model)] == [0, 1]
    ids = torch.randint(3, 90, (1, 12), generator=torch.Generator().manual_seed(0))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False, pad_token_id=0,
              eos_token_id=None)
    stock = model.generate(ids, **kw)
    astrai_hf.patch(model, max_tokens=512)
    for _ in range(2):
        assert torch.equal(model.generate(ids, **kw), stock)
    assert astrai_hf.get_pool(model).stats()["prefix_hit_tokens"] == 11


def _qwen2_vl():
    # M-RoPE: the model keeps `rope_deltas` of the last call it prepared positions for
    text = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                rope_parameters=dict(rope_type="default", mrope_section=[2, 3, 3], rope_theta=10000.0))
    vision = dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2, in_channels=3)
    cfg = T.Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=IMG, video_token_id=91,
                          vision_start_token_id=92, vision_end_token_id=93)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = T.Qwen2VLForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.model.language_model.named_parameters():
            if "q_proj.weight" in name or "k_proj.weight" in name:
                p.mul_(4.0)  # attention that a shift of positions visibly moves
    return model


def _qwen2_vl_image(grid=(1, 8, 8)):
    t, h, w = grid
    g = torch.Generator().manual_seed(1)
    ids = torch.tensor([[1, 92] + [IMG] * (t * h * w // 4) + [93] + torch.randint(3, 89, (6,), generator=g).tolist()])
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=torch.randn(t * h * w, 1176, generator=g),
                image_grid_thw=torch.tensor([[t, h, w]]), mm_token_type_ids=(ids == IMG).long())


def test_a_text_prompt_served_from_the_prefix_cache_after_an_image_call_keeps_stock_positions():
    # An image call leaves rope_deltas of its image on the model; transformers adds them to the positions of any
    # call that starts with a cached prefix. Stock starts every call empty and recomputes them.
    model = _qwen2_vl()
    ids = torch.randint(3, 89, (1, 20), generator=torch.Generator().manual_seed(0))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False, pad_token_id=0,
              eos_token_id=None, return_dict_in_generate=True, output_logits=True)
    stock = model.generate(ids, **kw)
    image = dict(kw, **_qwen2_vl_image())
    astrai_hf.patch(model, max_tokens=1024)
    pool = astrai_hf.get_pool(model)
    model.generate(ids, **kw)  # fills the prefix cache
    model.generate(**image)  # runs stock: rope_deltas of the image stay on the model
    assert model.model.rope_deltas.abs().max() > 0
    paged = model.generate(ids, **kw)
    assert pool.stats()["prefix_hit_tokens"] == 19
    for a, b in zip(paged.logits, stock.logits):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    model.generate(**image)
    with PagedCache(pool, ids, kw["attention_mask"]) as cache:  # a cache of the caller's, pre-filled
        paged = model.generate(ids, past_key_values=cache, **kw)
    for a, b in zip(paged.logits, stock.logits):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    astrai_hf.unpatch(model)
    model.generate(**image)
    with PagedCache(pool, ids, kw["attention_mask"], model=model) as cache:  # unpatched, pre-filled
        paged = model.generate(ids, past_key_values=cache, **kw)
    for a, b in zip(paged.logits, stock.logits):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert pool.stats()["num_used_pages"] == 0


def test_a_batch_served_from_the_prefix_cache_after_a_smaller_batch_gets_positions_of_its_own():
    # rope_deltas of a batch of 2 were added to the positions of a batch of 3 (a size mismatch)
    model = _qwen2_vl()
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, 89, (1, 20), generator=g)
    a = torch.cat([prefix.expand(2, -1), torch.randint(3, 89, (2, 3), generator=g)], 1)
    b = torch.cat([prefix.expand(3, -1), torch.randint(3, 89, (3, 3), generator=g)], 1)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    stock = [model.generate(x, attention_mask=torch.ones_like(x), **kw) for x in (a, b)]
    astrai_hf.patch(model, max_tokens=2048)
    for x, ref in zip((a, b), stock):
        assert torch.equal(model.generate(x, attention_mask=torch.ones_like(x), **kw), ref)
    assert astrai_hf.get_pool(model).stats()["prefix_hit_tokens"] > 0


def _chat_turns_text_image_text(model, family):
    """Three turns, each given the cache the turn before returned: text (holding the image placeholder id as
    text, as a typed "<image>" or a generated one would), then text with an image, then text; the new tokens of
    the second and third."""
    g = torch.Generator().manual_seed(3)
    first = torch.tensor([[1, 59, IMG if family == "llava" else 60, 46, 83, 82]])
    kw = dict(max_new_tokens=5, do_sample=False, return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    types = {"gemma3": "token_type_ids", "qwen2_vl": "mm_token_type_ids"}.get(family)

    def call(ids, cache=None, **image):
        extra = {types: (ids == IMG).long() * bool(image)} if types else {}
        given = {} if cache is None else {astrai_hf.cache_kwarg(model): cache}
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kw, **image, **extra, **given)
        return out, getattr(out, astrai_hf.cache_kwarg(model))

    out, cache = call(first)
    start, end = {"gemma3": (93, 94), "qwen2_vl": (92, 93)}.get(family, (10, 11))
    ids = torch.cat([out.sequences, torch.tensor([[4, 81, start] + [IMG] * 4 + [end, 24, 45]])], 1)
    if family == "qwen2_vl":
        image = dict(pixel_values=torch.randn(16, 1176, generator=g), image_grid_thw=torch.tensor([[1, 4, 4]]))
    else:
        image = dict(pixel_values=torch.randn(1, 3, 28, 28, generator=g))
    second, cache = call(ids, cache, **image)
    third, _ = call(torch.cat([second.sequences, torch.tensor([[7, 8, 9]])], 1), cache)
    return second.sequences[:, -5:], third.sequences[:, -5:]


@pytest.mark.equivalence
@pytest.mark.parametrize("family", ["llava", "gemma3", "qwen2_vl"])
def test_an_image_turn_given_a_text_turns_cache_continues_it_as_stock(family):
    # stock computes the image turn's new columns alone on its cache of the text turn's; a patched call ran it from
    # scratch (images run stock generate()), which counted the text turn's placeholder id as an image's (LLaVA:
    # "Image features and image tokens do not match"), and on 5.17 gave other tokens than stock's continuation
    build = {"llava": _llava, "gemma3": _gemma3_multimodal, "qwen2_vl": _qwen2_vl}[family]
    want = _chat_turns_text_image_text(build(), family)
    model = build()
    astrai_hf.patch(model, max_tokens=1024, page_size=4)
    got = _chat_turns_text_image_text(model, family)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert astrai_hf.get_pool(model).stats()["num_used_pages"] == 0


def _repadded_image_turn(model):
    """Two rows: text (row 0 holding the placeholder id as text), then the chat tokenized again and left-padded
    otherwise, row 0 with an image, given the cache the first call returned; (the second call's sequences,)."""
    kw = dict(max_new_tokens=5, do_sample=False, return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    ids = torch.tensor([[0, 0, 1, 59, IMG, 46], [1, 33, 34, 35, 36, 37]])
    out = model.generate(ids, attention_mask=(torch.arange(6) >= torch.tensor([[2], [0]])).long(), **kw)
    rows = [out.sequences[0, 2:].tolist() + [4, 81, 10, IMG, IMG, IMG, IMG, 11, 24, 45],
            out.sequences[1].tolist() + [4, 82, 3, 3, 3, 3, 3, 3, 25, 46, 9, 9]]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    image = torch.randn(1, 3, 28, 28, generator=torch.Generator().manual_seed(3))
    cache = {astrai_hf.cache_kwarg(model): getattr(out, astrai_hf.cache_kwarg(model))}
    return (model.generate(ids, attention_mask=mask, pixel_values=image, **kw, **cache).sequences,)


def _embeds_then_image_then_text(model):
    """Qwen2-VL: embeddings, then ids with an image, then text, each given the cache the call before returned."""
    kw = dict(max_new_tokens=5, do_sample=False, return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    name = astrai_hf.cache_kwarg(model)
    ids = torch.tensor([[1, 59, 60, 46]])
    out = model.generate(inputs_embeds=model.get_input_embeddings()(ids).detach(), attention_mask=torch.ones_like(ids),
                         **kw)
    seq = torch.cat([ids, out.sequences], 1)
    ids = torch.cat([seq, torch.tensor([[4, 81, 92, IMG, IMG, IMG, IMG, 93, 24, 45]])], 1)
    image = dict(pixel_values=torch.randn(16, 1176, generator=torch.Generator().manual_seed(3)),
                 image_grid_thw=torch.tensor([[1, 4, 4]]), mm_token_type_ids=(ids == IMG).long())
    second = model.generate(ids, attention_mask=torch.ones_like(ids), **image, **kw, **{name: getattr(out, name)})
    ids = torch.cat([second.sequences, torch.tensor([[7, 8, 9]])], 1)
    third = model.generate(ids, attention_mask=torch.ones_like(ids), **kw, **{name: getattr(second, name)})
    return second.sequences, third.sequences


@pytest.mark.equivalence
@pytest.mark.parametrize("flow", ["padded otherwise", "after embeddings"])
def test_an_image_turn_given_a_returned_cache_that_it_does_not_simply_extend_continues_it_as_stock(flow):
    # stock computes the columns after its cache's on that cache whatever they hold: padded otherwise, the patched
    # call had run from scratch and counted the placeholder id in the earlier text as an image's (LLaVA: "Image
    # features and image tokens do not match"); after a call fed embeddings it had run paged, and the text turn
    # after it got other tokens than stock's (Qwen2-VL on 5.25)
    build, run = (_llava, _repadded_image_turn) if flow == "padded otherwise" else (_qwen2_vl, _embeds_then_image_then_text)
    want = run(build())
    model = build()
    astrai_hf.patch(model, max_tokens=1024, page_size=4)
    got = run(model)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert astrai_hf.get_pool(model).stats()["num_used_pages"] == 0

"""Model families paged attention does not compute: ``patch()`` refuses each with ``NotImplementedError`` naming
the feature (before any pool is built or any output changes), and the zero-code hook leaves them on stock
``generate()``."""

from __future__ import annotations

import contextlib
import functools
import re
import warnings

import pytest
import torch
import transformers as T

import astrai_hf
from astrai_hf import PagedCache, PagePool

_COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2, max_position_embeddings=256)
_ENC_DEC = dict(vocab_size=96, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)


def _gpt_oss():
    return T.GptOssForCausalLM(T.GptOssConfig(**_COMMON, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                              sliding_window=4, layer_types=["sliding_attention", "full_attention"]))


def _deepseek_v3():
    return T.DeepseekV3ForCausalLM(T.DeepseekV3Config(
        **{**_COMMON, "num_key_value_heads": 4}, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        first_k_dense_replace=1, n_group=1, topk_group=1))


def _lfm2():
    return T.Lfm2ForCausalLM(T.Lfm2Config(**_COMMON, layer_types=["conv", "full_attention"]))


def _jamba():
    return T.JambaForCausalLM(T.JambaConfig(**_COMMON, num_experts=2, attn_layer_period=2, attn_layer_offset=1,
                                            expert_layer_period=2, expert_layer_offset=1, mamba_d_state=4,
                                            mamba_dt_rank=4))


def _minimax():
    return T.MiniMaxForCausalLM(T.MiniMaxConfig(**_COMMON, head_dim=16, num_local_experts=2, num_experts_per_tok=1,
                                                layer_types=["linear_attention", "full_attention"], block_size=4))


def _bart():
    return T.BartForConditionalGeneration(T.BartConfig(
        d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=128, **_ENC_DEC))


def _t5():
    return T.T5ForConditionalGeneration(T.T5Config(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                                                   **_ENC_DEC))


def _bart_decoder():
    return T.BartForCausalLM(T.BartConfig(d_model=64, decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=128,
                                          max_position_embeddings=128, is_decoder=True, is_encoder_decoder=False,
                                          **_ENC_DEC))


def _gemma3n(num_kv_shared_layers=2, pattern=("sliding_attention", "full_attention")):
    """A tiny Gemma 3n of two repeats of ``pattern``, its last ``num_kv_shared_layers`` layers sharing K/V."""
    n = 2 * len(pattern)
    return T.Gemma3nForCausalLM(T.Gemma3nTextConfig(
        vocab_size=96, vocab_size_per_layer_input=96, hidden_size=64, hidden_size_per_layer_input=8,
        intermediate_size=[128] * n, num_hidden_layers=n, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        layer_types=list(pattern) * 2, sliding_window=4,
        num_kv_shared_layers=num_kv_shared_layers, laurel_rank=4, altup_num_inputs=2,
        activation_sparsity_pattern=[0.0] * n, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        max_position_embeddings=256))


def _llama4(chunk=4):
    return T.Llama4ForCausalLM(T.Llama4TextConfig(
        **{**_COMMON, "head_dim": 16}, intermediate_size_mlp=128, num_local_experts=2, interleave_moe_layer_step=1,
        no_rope_layers=[1, 1], attention_chunk_size=chunk))


def _gemma4_kv_sharing():
    return T.Gemma4ForCausalLM(T.Gemma4TextConfig(
        **{**_COMMON, "num_hidden_layers": 4}, head_dim=16, global_head_dim=16, sliding_window=4,
        num_kv_shared_layers=2, layer_types=["sliding_attention", "full_attention"] * 2))


def _gemma4_per_layer_head_dim():
    # full-attention layers with a head size of their own (global_head_dim), as in the released Gemma 4 checkpoints
    return T.Gemma4ForCausalLM(T.Gemma4TextConfig(
        **{**_COMMON, "num_hidden_layers": 2}, head_dim=16, global_head_dim=32, sliding_window=4,
        num_kv_shared_layers=0, layer_types=["sliding_attention", "full_attention"]))


def _diffllama():  # splits V into two halves after the cache stored it, and attends to each
    return T.DiffLlamaForCausalLM(T.DiffLlamaConfig(**_COMMON))


def _jetmoe():  # tiles the K/V heads after the cache stored them (query head i reads K/V head i % kv_heads)
    return T.JetMoeForCausalLM(T.JetMoeConfig(
        **{k: v for k, v in _COMMON.items() if k != "intermediate_size"}, kv_channels=16, num_local_experts=4,
        num_experts_per_tok=2))


def _bert_encoder():  # an encoder checkpoint loaded as a causal LM: its self-attention attends both ways
    return T.BertLMHeadModel(T.BertConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, pad_token_id=0, is_decoder=False))


def _doge():  # builds a mask of its own in the attention module (a learned bias per key, top-k masking)
    return T.DogeForCausalLM(T.DogeConfig(**_COMMON, keep_window_size=4))


def _phimoe(sliding_window=5):  # its sliding window reaches attention through the mask only
    return T.PhimoeForCausalLM(T.PhimoeConfig(**_COMMON, num_local_experts=4,
                                              num_experts_per_tok=2, sliding_window=sliding_window))


def _qwen2_moe(sliding_window=5):  # as PhiMoE, with use_sliding_window
    return T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(
        **_COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, use_sliding_window=True, sliding_window=sliding_window,
        max_window_layers=2))


def _git():  # its text self-attention is written by hand (its file's vision attention uses AttentionInterface)
    return T.GitForCausalLM(T.GitConfig(**{k: v for k, v in _COMMON.items() if k != "num_key_value_heads"}))


def _gpt_neox_japanese():  # attention written by hand, which .view()s the K/V the cache returns
    return T.GPTNeoXJapaneseForCausalLM(T.GPTNeoXJapaneseConfig(
        **{k: v for k, v in _COMMON.items() if k not in ("num_key_value_heads", "intermediate_size")},
        intermediate_multiple_size=2))


def _dory(mode="per_loop"):  # runs its recurrent layers' attention modules once per loop, under other cache layers
    if not hasattr(T, "DoryConfig"):
        pytest.skip("Dory is in transformers 5.24 and later")
    return T.DoryForCausalLM(T.DoryConfig(
        **{k: v for k, v in _COMMON.items() if k != "num_hidden_layers"}, num_hidden_layers=3, head_dim=16,
        n_input_layers=1, n_recurrent_layers=1, n_output_layers=1, n_recurrent_loops=2, recurrent_kv_cache_mode=mode))


def _hrm_text():  # cycles through its stacks of layers, each cycle under other cache layers
    return T.HrmTextForCausalLM(T.HrmTextConfig(**{**_COMMON, "num_hidden_layers": 2}, head_dim=16, H_cycles=2,
                                                L_cycles=1, num_layers_per_stack=1))


UNSUPPORTED = {
    "gpt_oss": (_gpt_oss, "attention sinks"),
    "deepseek_v3": (_deepseek_v3, "multi-head latent attention"),
    "lfm2": (_lfm2, "hybrid model"),
    "jamba": (_jamba, "hybrid model"),
    "minimax": (_minimax, "cache class of its own"),
    "bart": (_bart, "encoder-decoder"),
    "t5": (_t5, "encoder-decoder"),
    "bart_decoder": (_bart_decoder, "cross-attention"),
    "llama4_chunked": (_llama4, "chunked attention"),
    "gemma4_kv_sharing": (_gemma4_kv_sharing, "KV sharing"),
    "gemma4_per_layer_head_dim": (_gemma4_per_layer_head_dim, "layers differ in head_dim"),
    "diffllama": (_diffllama, "changes K/V between storing them in the cache and attending"),
    "jetmoe": (_jetmoe, "changes K/V between storing them in the cache and attending"),
    "bert_encoder": (_bert_encoder, "attends both ways"),
    "doge": (_doge, "a mask of its own making"),
    "phimoe_window": (_phimoe, "sliding window .* through the attention mask only"),
    "qwen2_moe_window": (_qwen2_moe, "sliding window .* through the attention mask only"),
    "git": (_git, "GitSelfAttention computes attention without transformers' AttentionInterface"),
    "gpt_neox_japanese": (_gpt_neox_japanese, "GPTNeoXJapaneseAttention computes attention without"),
    "dory_per_loop": (_dory, r"under cache layer `self.layer_idx \+ cache_offset`: .* more than once per forward"),
    "dory_last_loop": (functools.partial(_dory, "last_loop"), r"more than once per forward"),
    "hrm_text": (_hrm_text, r"under cache layer `self.layer_idx \+ cycle_offset`"),
}


@contextlib.contextmanager
def _quiet():
    with warnings.catch_warnings():  # the tiny configs trip transformers' config warnings
        warnings.simplefilter("ignore")
        yield


def _build(name, **kwargs):
    torch.manual_seed(0)
    with _quiet():
        model = (UNSUPPORTED[name][0] if name in UNSUPPORTED else _gemma3n)(**kwargs).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(3.0)
    return model


_IDS = torch.randint(3, 96, (2, 7), generator=torch.Generator().manual_seed(0))
_KW = dict(attention_mask=torch.ones_like(_IDS), max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None)


@pytest.mark.parametrize("name", list(UNSUPPORTED))
def test_patch_refuses_naming_the_feature(name):
    model = _build(name)
    with pytest.raises(NotImplementedError, match=UNSUPPORTED[name][1]):
        astrai_hf.patch(model, max_tokens=512)
    assert not astrai_hf.is_patched(model)


@pytest.mark.parametrize("name", ["jamba", "lfm2", "bart", "minimax", "deepseek_v3"])
def test_pool_refuses_a_cache_it_cannot_hold(name):
    with pytest.raises(NotImplementedError, match=UNSUPPORTED[name][1]):
        PagePool.from_model(_build(name), max_tokens=512)


@pytest.mark.parametrize("name", ["jamba", "lfm2", "bart", "t5", "deepseek_v3"])
def test_a_pool_built_from_the_config_alone_refuses_it_as_from_model_does(name):
    # PagePool(config) had accepted encoder-decoder and hybrid configs: BART then stored its cross-attention K/V
    # as tokens of the rows (other logits, no error)
    model = _build(name)
    with pytest.raises(NotImplementedError, match=UNSUPPORTED[name][1]):
        PagePool(model.config, max_tokens=512)


@pytest.mark.parametrize("config", ["FalconH1Config", "RecurrentGemmaConfig", "Qwen3NextConfig", "Zamba2Config"])
def test_a_pool_refuses_the_config_of_a_hybrid_model(config):
    with _quiet():
        cfg = getattr(T, config)()
    with pytest.raises(NotImplementedError, match="hybrid model"):
        PagePool(cfg, max_tokens=64)


@pytest.mark.parametrize("config, reason", [
    ("MllamaConfig", "cross-attention"), ("TrOCRConfig", "cross-attention"), ("DeepseekV4Config", "compressed"),
    (dict(GPT2Config=dict(add_cross_attention=True)), r"cross-attention \(add_cross_attention=True"),
    ("xLSTMConfig", r"K and V have different head sizes \(256 and 512\)"),
    (dict(LlamaConfig=dict(head_dim=16, v_head_dim=32)), r"K and V have different head sizes \(16 and 32\)"),
], ids=["mllama", "trocr", "deepseek-v4", "gpt2-add-cross-attention", "xlstm", "v-head-larger"])
def test_a_pool_refuses_configs_of_cross_attention_and_compressed_attention(config, reason):
    # accepted by PagePool(config) though from_model refused the model: DeepSeek-V4's compressor caches then failed
    # with an AttributeError inside its attention
    # (a V head larger than K's, as xLSTM's, and a config's add_cross_attention: each refused by PagePool(config) too)
    name, kwargs = next(iter(config.items())) if isinstance(config, dict) else (config, {})
    with _quiet():
        cfg = getattr(T, name)(**kwargs)
    with pytest.raises(NotImplementedError, match=reason):
        PagePool(cfg, max_tokens=64)


def test_a_cache_fed_the_cross_attention_kv_of_an_encoder_decoder_model_says_so():
    # a PagedCache of a decoder-only pool handed to BART: its cross-attention stores K/V of the encoder's length
    # in the same step, which had ended in an IndexError of index_copy_
    model = _build("bart")
    pool = PagePool(T.LlamaConfig(**dict(_COMMON, num_key_value_heads=4)), max_tokens=512)  # BART's K/V geometry
    with pytest.raises(ValueError, match="cross-attention"), PagedCache(pool) as cache:
        model.generate(_IDS, **{astrai_hf.cache_kwarg(model): cache}, **_KW)
    assert pool.stats()["num_used_pages"] == 0


@pytest.mark.parametrize("name", ["gpt_oss", "jamba", "bart", "llama4_chunked"])
def test_zero_code_hook_keeps_stock_generate(name):
    from astrai_hf.patches import autopatch

    model = _build(name)
    with _quiet():
        stock = model.generate(_IDS, **_KW)
    autopatch.install(max_tokens=512)
    try:
        with _quiet():
            out = model.generate(_IDS, **_KW)
    finally:
        autopatch.uninstall()
    assert torch.equal(out, stock)
    assert not astrai_hf.is_patched(model)


def test_chunked_attention_is_served_by_a_pool_no_longer_than_a_chunk():
    # while no row is longer than a chunk, chunked attention is causal attention: a pool of such rows is accepted
    model = _build("llama4_chunked")
    stock = model.generate(_IDS, **{**_KW, "max_new_tokens": 9})
    with pytest.raises(NotImplementedError, match="max_seq_len=4"):
        astrai_hf.patch(model, pool=PagePool.from_model(model, max_tokens=512))
    short = PagePool.from_model(model, max_tokens=512, max_seq_len=4)
    astrai_hf.patch(model, pool=short)
    out = model.generate(_IDS[:, :2], **{**_KW, "attention_mask": torch.ones_like(_IDS[:, :2]), "max_new_tokens": 2})
    assert torch.equal(out, model.__class__.generate(model, _IDS[:, :2], **{
        **_KW, "attention_mask": torch.ones_like(_IDS[:, :2]), "max_new_tokens": 2}))
    assert short.stats()["num_used_pages"] == 0
    with pytest.raises(NotImplementedError, match="chunked attention"):
        astrai_hf.patch(model, pool=PagePool.from_model(model, max_tokens=512))  # swapping in a longer pool
    astrai_hf.unpatch(model)
    assert torch.equal(model.generate(_IDS, **{**_KW, "max_new_tokens": 9}), stock)


@pytest.mark.parametrize("name", ["phimoe_window", "qwen2_moe_window"])
def test_a_window_the_mask_alone_applies_is_served_by_a_pool_no_longer_than_the_window(name):
    # the window bites only on rows longer than it: a pool of such rows is accepted, and matches stock
    model = _build(name)
    ids = _IDS[:, :3]
    kw = {**_KW, "attention_mask": torch.ones_like(ids), "max_new_tokens": 2}
    stock = model.generate(ids, **kw)
    short = PagePool.from_model(model, max_tokens=512, max_seq_len=5)
    with astrai_hf.patched(model, pool=short):
        assert torch.equal(model.generate(ids, **kw), stock)
        assert model.generate(ids, **kw).shape == stock.shape  # a second call, from the prefix cache
    with pytest.raises(NotImplementedError, match="max_seq_len=5"):
        astrai_hf.patch(model, pool=PagePool.from_model(model, max_tokens=512))


def test_a_cache_of_the_callers_on_a_longer_pool_is_refused_as_patch_refuses_the_pool():
    model = _build("phimoe_window")
    short = PagePool.from_model(model, max_tokens=512, max_seq_len=5)
    ids = _IDS[:, :3]
    with astrai_hf.patched(model, pool=short):
        long = PagePool.from_model(model, max_tokens=512)
        with PagedCache(long) as cache, pytest.raises(NotImplementedError, match="max_seq_len=5"):
            model.generate(ids, **{**_KW, "attention_mask": torch.ones_like(ids)},
                           **{astrai_hf.cache_kwarg(model): cache})
        assert long.stats()["num_used_pages"] == 0


@pytest.mark.parametrize("hands_on", ["by keyword", "by position"])
def test_a_subclass_that_makes_a_mask_of_its_own_before_super_forward_is_refused(hands_on):
    import transformers.models.llama.modeling_llama as llama

    class MaskedAttention(llama.LlamaAttention):
        def forward(self, hidden_states, position_embeddings, attention_mask=None, **kwargs):
            if attention_mask is not None:
                attention_mask = attention_mask.clone()
                attention_mask[..., 1:3] = False if attention_mask.dtype == torch.bool else -1e9
            if hands_on == "by keyword":
                return super().forward(hidden_states, position_embeddings, attention_mask=attention_mask, **kwargs)
            return super().forward(hidden_states, position_embeddings, attention_mask, **kwargs)

    class PlainSubclass(llama.LlamaAttention):  # hands the mask on as it came: served
        def forward(self, hidden_states, position_embeddings, attention_mask=None, **kwargs):
            return super().forward(hidden_states, position_embeddings, attention_mask, **kwargs)

    from astrai_hf.patch import own_attention_mask

    assert own_attention_mask(MaskedAttention) == "attention_mask"
    assert own_attention_mask(PlainSubclass) is None


def test_a_subclass_that_puts_a_mask_of_its_own_into_the_kwargs_it_hands_on_is_refused():
    # the mask reaches the parent's forward inside **kwargs: it had been patched (and attended as plain causal)
    import transformers.models.llama.modeling_llama as llama

    def masked(attention_mask):
        attention_mask = attention_mask.clone()
        attention_mask[..., 1:3] = -1e9
        return attention_mask

    class ByItem(llama.LlamaAttention):
        def forward(self, hidden_states, position_embeddings, **kwargs):
            kwargs["attention_mask"] = masked(kwargs["attention_mask"])
            return super().forward(hidden_states, position_embeddings, **kwargs)

    class ByUpdate(llama.LlamaAttention):
        def forward(self, hidden_states, position_embeddings, **kw):
            kw.update(attention_mask=masked(kw["attention_mask"]))
            return super().forward(hidden_states, position_embeddings, **kw)

    class ByMerge(llama.LlamaAttention):  # a new dict: {**kwargs, ...}
        def forward(self, hidden_states, position_embeddings, **kwargs):
            kwargs = {**kwargs, "attention_mask": masked(kwargs["attention_mask"])}
            return super().forward(hidden_states, position_embeddings, **kwargs)

    class ByDictCall(llama.LlamaAttention):  # dict(kwargs, attention_mask=...) under another name
        def forward(self, hidden_states, position_embeddings, **kwargs):
            kw = dict(kwargs, attention_mask=masked(kwargs["attention_mask"]))
            return super().forward(hidden_states, position_embeddings, **kw)

    class ByOrAssign(llama.LlamaAttention):
        def forward(self, hidden_states, position_embeddings, **kwargs):
            kwargs |= {"attention_mask": masked(kwargs["attention_mask"])}
            return super().forward(hidden_states, position_embeddings, **kwargs)

    class ByCopyThenItem(llama.LlamaAttention):
        def forward(self, hidden_states, position_embeddings, **kwargs):
            new = dict(kwargs)
            new["attention_mask"] = masked(kwargs["attention_mask"])
            return super().forward(hidden_states, position_embeddings, **new)

    class InTheCall(llama.LlamaAttention):
        def forward(self, hidden_states, position_embeddings, **kwargs):
            return super().forward(hidden_states, position_embeddings,
                                   **{**kwargs, "attention_mask": masked(kwargs["attention_mask"])})

    class InPlace(llama.LlamaAttention):  # the parameter itself written into
        def forward(self, hidden_states, position_embeddings, attention_mask=None, **kwargs):
            if attention_mask is not None:
                attention_mask.masked_fill_(torch.ones_like(attention_mask, dtype=torch.bool).tril(-3), -1e9)
            return super().forward(hidden_states, position_embeddings, attention_mask, **kwargs)

    class ByKeyName(llama.LlamaAttention):
        def forward(self, hidden_states, position_embeddings, **kwargs):
            key = "attention_mask"
            kwargs[key] = masked(kwargs[key])
            return super().forward(hidden_states, position_embeddings, **kwargs)

    class ByUpdatePairs(llama.LlamaAttention):
        def forward(self, hidden_states, position_embeddings, **kwargs):
            kwargs.update([("attention_mask", masked(kwargs["attention_mask"]))])
            return super().forward(hidden_states, position_embeddings, **kwargs)

    class InPlaceThroughAlias(llama.LlamaAttention):
        def forward(self, hidden_states, position_embeddings, attention_mask=None, **kwargs):
            m = attention_mask
            m[..., 2:5] = -1e9
            return super().forward(hidden_states, position_embeddings, attention_mask, **kwargs)

    class ReadsOnly(llama.LlamaAttention):  # reads the mask from the kwargs, hands them on unchanged: served
        def forward(self, hidden_states, position_embeddings, **kwargs):
            self.last_mask = kwargs.get("attention_mask")
            other = dict(kwargs)
            return super().forward(hidden_states, position_embeddings, **other)

    class LogsTheMask(llama.LlamaAttention):  # dicts of its own that name the mask (a log record, a probe): served
        def forward(self, hidden_states, position_embeddings, **kwargs):
            record = {"layer": self.layer_idx, "attention_mask": tuple(kwargs["attention_mask"].shape)}
            probe = dict(attention_mask=kwargs["attention_mask"] is not None, layer=self.layer_idx)
            self.seen = {}
            self.seen["attention_mask"] = kwargs["attention_mask"]
            stats = {}
            stats["attention_mask"] = record, probe
            return super().forward(hidden_states, position_embeddings, **kwargs)

    from astrai_hf.patch import own_attention_mask

    for cls in (ByItem, ByUpdate, ByMerge, ByDictCall, ByOrAssign, ByCopyThenItem, InTheCall, ByKeyName,
                ByUpdatePairs):
        assert own_attention_mask(cls) == "an attention_mask put into the **kwargs handed on", cls.__name__
    for cls in (InPlace, InPlaceThroughAlias):
        assert own_attention_mask(cls) == "attention_mask, changed in place", cls.__name__
    for cls in (ReadsOnly, LogsTheMask):
        assert own_attention_mask(cls) is None, cls.__name__
    from tiny_models import tiny_model

    model = tiny_model("llama")
    for layer in model.model.layers:
        layer.self_attn.__class__ = ByMerge
    with pytest.raises(NotImplementedError, match="attention_mask put into the"):
        astrai_hf.patch(model)
    assert not astrai_hf.is_patched(model)


def test_a_subclass_of_an_attention_that_leaves_the_window_to_the_mask_is_judged_as_its_parent():
    import transformers.models.phimoe.modeling_phimoe as phimoe

    class MyPhimoeAttention(phimoe.PhimoeAttention):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    from astrai_hf.patch import passes_sliding_window

    assert not passes_sliding_window(MyPhimoeAttention)
    model = _build("phimoe_window")
    for layer in model.model.layers:
        twin = MyPhimoeAttention(model.config, layer.self_attn.layer_idx)
        twin.load_state_dict(layer.self_attn.state_dict())
        layer.self_attn = twin.eval()
    with pytest.raises(NotImplementedError, match="through the attention mask only"):
        astrai_hf.patch(model, max_tokens=512)


def test_a_model_without_a_window_passing_none_is_patched():
    # PhiMoE without a sliding window computes causal attention: nothing for paged attention to miss
    torch.manual_seed(0)
    model = _phimoe(sliding_window=None).eval()
    ids, kw = _IDS, {**_KW, "max_new_tokens": 6}
    stock = model.generate(ids, **kw)
    with astrai_hf.patched(model, max_tokens=512):
        assert torch.equal(model.generate(ids, **kw), stock)


@pytest.mark.parametrize("paged", ["patched", "PagedCache alone"])
def test_llama4_temperature_tuning_counts_query_positions_as_stock(paged):
    # Llama 4's NoPE layers scale their queries by positions counted from cache.get_seq_length(layer_idx) before
    # they store the step's K/V; the cache had answered with the step included once layer 0 had stored it, so every
    # later NoPE layer scaled by positions shifted by the step's width (the whole prompt at prefill)
    from tiny_models import left_padded_batch

    chunk = 32
    torch.manual_seed(1)
    model = T.Llama4ForCausalLM(T.Llama4TextConfig(
        **{**_COMMON, "num_hidden_layers": 4, "head_dim": 16}, intermediate_size_mlp=128, num_local_experts=1,
        num_experts_per_tok=1, no_rope_layers=[1, 0, 1, 0], attention_chunk_size=chunk, attn_temperature_tuning=True,
        floor_scale=4, attn_scale=1.0)).eval()
    ids, mask = left_padded_batch([9, 5, 12], seed=1)
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None,
              return_dict_in_generate=True, output_logits=True)
    stock = model.generate(ids, **kw)
    pool = PagePool.from_model(model, max_tokens=512, page_size=4, max_seq_len=chunk)
    if paged == "patched":
        with astrai_hf.patched(model, pool=pool):
            runs = [model.generate(ids, **kw) for _ in range(2)]  # the second from the prefix cache
    else:
        runs = [model.generate(ids, **kw, past_key_values=astrai_hf.PagedCache(pool, ids, mask))]
    for out in runs:
        assert torch.equal(out.sequences, stock.sequences)
        for got, ref in zip(out.logits, stock.logits):
            torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    assert pool.stats()["num_used_pages"] == 0 or paged != "patched"


@pytest.mark.parametrize("tuning", [False, True])
def test_decode_graphs_leave_out_layers_that_read_the_cache_length(tuning):
    # the length such a layer reads is a host integer: a replayed graph would keep the one of its capture (on a CPU
    # the runner's stand-in reruns the forward, so only whether a step went through it is checked here)
    model = _build("llama4_chunked")
    model.config.attn_temperature_tuning = tuning
    for layer in model.model.layers:
        layer.self_attn.attn_temperature_tuning = tuning
    pool = PagePool.from_model(model, max_tokens=512, max_seq_len=4)
    with astrai_hf.patched(model, pool=pool, cuda_graphs=True):
        model.generate(_IDS[:, :2], **{**_KW, "attention_mask": torch.ones_like(_IDS[:, :2]), "max_new_tokens": 2})
        (runner,) = model._astrai_patch_state.runners.values()
    assert runner.length_readers == ["Llama4TextAttention"]  # the source asks, whatever the setting
    assert runner.replays == 0
    llama = T.LlamaForCausalLM(T.LlamaConfig(**_COMMON)).eval()
    with astrai_hf.patched(llama, cuda_graphs=True):
        llama.generate(_IDS, **_KW)
        (runner,) = llama._astrai_patch_state.runners.values()
    assert runner.length_readers == [] and runner.replays == 3


@pytest.mark.parametrize("when", ["before patch()", "after patch()"])
def test_dynamically_quantized_models_are_refused_naming_the_cause(when):
    # quantize_dynamic scales each activation tensor by its own range: a packed prefill or a prefix hit changes the
    # tokens (and a layer without parameters had raised a bare StopIteration)
    from tiny_models import left_padded_batch, tiny_model

    model = tiny_model("llama")
    ids, mask = left_padded_batch([9, 4], seed=1)
    kw = dict(attention_mask=mask, max_new_tokens=3, do_sample=False)
    if when == "after patch()":
        astrai_hf.patch(model, max_tokens=256)
    quantized = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8,
                                                       inplace=when == "after patch()")
    with pytest.raises(NotImplementedError, match="torch dynamic quantization"):
        if when == "before patch()":
            astrai_hf.patch(quantized, max_tokens=256)
        else:
            quantized.generate(ids, **kw)
    astrai_hf.unpatch(quantized)
    assert not astrai_hf.is_patched(quantized)
    stock = quantized.generate(ids, **kw)
    pool = PagePool.from_model(quantized, max_tokens=256)  # the pool's device and dtype without parameters
    assert pool.config.layer_devices[0] == torch.device("cpu")
    with astrai_hf.PagedCache(pool, ids, mask) as cache:  # stock attention on a paged cache: the same rectangle
        assert torch.equal(quantized.generate(ids, **kw, past_key_values=cache), stock)


@pytest.mark.parametrize("how", ["int8 LM head only", "float16 everywhere"])
def test_dynamic_quantization_that_keeps_rows_independent_is_patched(how):
    from tiny_models import left_padded_batch, tiny_model

    model = tiny_model("llama")
    ids, mask = left_padded_batch([9, 4], seed=1)
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False)
    spec, dtype = ({"lm_head": torch.ao.quantization.default_dynamic_qconfig}, torch.qint8) if how.startswith(
        "int8") else ({torch.nn.Linear}, torch.float16)
    quantized = torch.ao.quantization.quantize_dynamic(model, spec, dtype=dtype)
    stock = quantized.generate(ids, **kw)
    with astrai_hf.patched(quantized, max_tokens=256):
        for _ in range(2):
            assert torch.equal(quantized.generate(ids, **kw), stock)


@pytest.mark.parametrize("change", ["another model on the pool", "set_weight_bias"])
def test_float16_dynamic_quantization_weights_are_watched(change):
    # the packed weights are neither parameters nor buffers: a model differing from another only in them got its
    # K/V from the prefix cache, and so did a layer whose weights set_weight_bias() replaced
    import warnings

    from tiny_models import left_padded_batch, tiny_model

    ids, mask = left_padded_batch([14, 9], seed=1)
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False)

    def quantized(seed):
        model = tiny_model("llama")
        torch.manual_seed(seed)
        with torch.no_grad():
            for m in model.model.modules():
                if isinstance(m, torch.nn.Linear):
                    m.weight.normal_(0, 0.2)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch deprecates torch.ao.quantization
            return torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.float16)

    a = quantized(1)
    with astrai_hf.patched(a, max_tokens=1024, page_size=4):
        pool = astrai_hf.get_pool(a)
        a.generate(ids, **kw)
        if change == "set_weight_bias":
            b, twin = a, quantized(1)
            weight = torch.randn(twin.model.layers[0].self_attn.k_proj.weight().shape)
            for m in (a, twin):
                m.model.layers[0].self_attn.k_proj.set_weight_bias(weight, None)
            stock = twin.generate(ids, **kw)
        else:
            b = quantized(2)
            stock = b.generate(ids, **kw)
            astrai_hf.patch(b, pool=pool)
        hits = pool.stats()["prefix_hit_tokens"]
        assert torch.equal(b.generate(ids, **kw), stock)
        assert pool.stats()["prefix_hit_tokens"] == hits
        if b is not a:
            astrai_hf.unpatch(b)


def test_a_model_with_a_sparse_buffer_is_patched():
    # its weights version took the storage of every tensor, which a sparse tensor has not
    from tiny_models import left_padded_batch, tiny_model

    model = tiny_model("llama")
    model.register_buffer("extra", (torch.arange(12.0).view(3, 4) / 10).to_sparse())
    ids, mask = left_padded_batch([14, 9], seed=1)
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False)
    stock = model.generate(ids, **kw)
    with astrai_hf.patched(model, max_tokens=512, page_size=4):
        for _ in range(2):
            assert torch.equal(model.generate(ids, **kw), stock)
        assert astrai_hf.get_pool(model).stats()["prefix_hit_tokens"] > 0


SLIDING_SLIDING_FULL = ("sliding_attention", "sliding_attention", "full_attention")


@pytest.mark.parametrize("shared, pattern, sources", [
    (0, None, ()), (2, None, (0, 1, 0, 1)), (3, SLIDING_SLIDING_FULL, (0, 1, 2, 1, 1, 2)),
], ids=["none", "one earlier layer of each type", "two earlier sliding layers"])
def test_kv_sharing_layers_read_their_source_layers_pages(shared, pattern, sources):
    # Gemma 3n E2B/E4B: the last layers attend over the K/V of the last earlier layer of their type; the pool keeps
    # one copy (those layers' storage is the source's, counted once per device too)
    from tiny_models import left_padded_batch

    layout = {} if pattern is None else {"pattern": pattern}
    model = _build("gemma3n", num_kv_shared_layers=shared, **layout)
    n_layers = model.config.num_hidden_layers
    ids, mask = left_padded_batch([9, 4, 13], seed=3)
    with _quiet():
        stock = {n: model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
                                   eos_token_id=None, num_beams=n) for n in (1, 2)}
    pool = PagePool.from_model(model, max_tokens=512, page_size=4)
    assert pool.config.spec.kv_source == sources
    for layer, source in enumerate(sources):
        assert pool.storage.k[layer] is pool.storage.k[source] and pool.storage.v[layer] is pool.storage.v[source]
    unshared = PagePool.from_model(_build("gemma3n", num_kv_shared_layers=0, **layout), max_tokens=512, page_size=4)
    assert pool.stats()["kv_bytes_total"] == unshared.stats()["kv_bytes_total"] * (n_layers - shared) // n_layers
    assert sum(pool.stats()["kv_bytes_by_device"].values()) == pool.stats()["kv_bytes_total"]
    astrai_hf.patch(model, pool=pool)
    for _ in range(2):  # the second round is served from the prefix cache
        for n, ref in stock.items():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
                                 eos_token_id=None, num_beams=n)
            assert torch.equal(out, ref), n
    assert pool.stats()["prefix_hit_tokens"] > 0 and pool.stats()["num_used_pages"] == 0


def test_a_pool_of_another_kv_sharing_layout_is_refused():
    for pool_shared, model_shared in [(0, 2), (2, 0)]:
        pool = PagePool.from_model(_build("gemma3n", num_kv_shared_layers=pool_shared), max_tokens=512)
        with pytest.raises(ValueError, match="kv_source"):
            astrai_hf.patch(_build("gemma3n", num_kv_shared_layers=model_shared), pool=pool)


@pytest.mark.parametrize("name", ["diffllama", "jetmoe", "gpt_neox_japanese"])
def test_families_that_change_kv_after_the_cache_run_on_a_paged_cache_without_patch(name):
    # the refusal's advice: stock attention over K/V gathered from the pool equals stock generate() (GPT-NeoX-
    # Japanese .view()s the K/V the cache returns: non-contiguous ones had raised a RuntimeError at 2 rows)
    model = _build(name)
    ids = _IDS.clone()
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    ids[0, :3] = 0
    kw = {**_KW, "attention_mask": mask}
    stock = model.generate(ids, **kw)
    pool = PagePool.from_model(model, max_tokens=512, page_size=4)
    with astrai_hf.PagedCache(pool) as cache:
        out = model.generate(ids, **kw, **{astrai_hf.cache_kwarg(model): cache})
    assert torch.equal(out, stock)
    assert pool.stats()["num_used_pages"] == 0


def test_the_latent_attention_refusal_names_the_latent_rank():
    with pytest.raises(NotImplementedError, match=r"kv_lora_rank=16"):
        astrai_hf.patch(_build("deepseek_v3"), max_tokens=512)


def test_a_refusal_names_the_layer_kinds_the_config_gives():
    from tiny_models import tiny_model

    # every layer has self-attention, of a kind of its own (DeepSeek-V3.2's indexer): it had read "a hybrid model
    # ... the other layers keep a state", naming other layers that did not exist
    model = tiny_model("llama")
    model.config.layer_types = ["indexed_attention", "indexed_attention"]
    with pytest.raises(NotImplementedError, match=r"layers of a kind paged attention does not serve \(indexed_atte"):
        astrai_hf.patch(model, max_tokens=512)
    # Jamba's mamba layer, which transformers names linear_attention in layer_types, beside an attention layer
    with pytest.raises(NotImplementedError, match=r"hybrid model: self-attention in layers \[1\] of 2; the other "
                                                  r"layers \(linear_attention in config.layer_types\) keep a state"):
        astrai_hf.patch(_build("jamba"), max_tokens=512)


@pytest.mark.parametrize("keep", [[0], [2], [2, 0]], ids=["first", "last", "reordered"])
def test_layers_removed_without_updating_the_config_are_refused_saying_so(keep):
    # a pruning recipe: the message had called the model a hybrid whose other layers keep no K/V
    from tiny_models import left_padded_batch, tiny_model

    def pruned(fix):
        m = tiny_model("llama", num_hidden_layers=3)
        m.model.layers = torch.nn.ModuleList([m.model.layers[i] for i in keep])
        if fix:
            m.config.num_hidden_layers = len(keep)
            for i, layer in enumerate(m.model.layers):
                layer.self_attn.layer_idx = i
        return m

    found = ", ".join(map(str, sorted(keep)))
    with pytest.raises(NotImplementedError, match=rf"config.num_hidden_layers is 3 but {len(keep)} layers hold "
                                                  rf"self-attention modules of layer_idx \[{found}\] \(layers added"):
        astrai_hf.patch(pruned(fix=False), max_tokens=256)
    if sorted(keep) != list(range(len(keep))):  # the count updated, the layer_idx not
        half = pruned(fix=False)
        half.config.num_hidden_layers = len(keep)
        with pytest.raises(NotImplementedError, match=rf"its {len(keep)} layers hold self-attention modules of "
                                                      rf"layer_idx \[{found}\], not 0 to {len(keep) - 1}"):
            astrai_hf.patch(half, max_tokens=256)
    ids, mask = left_padded_batch([5, 9], seed=1)
    kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False)
    model = pruned(fix=True)  # as the message says
    ref = model.generate(ids, **kw)
    with astrai_hf.patched(model, max_tokens=256, page_size=4) as patched:
        assert torch.equal(patched.generate(ids, **kw), ref)


@pytest.mark.parametrize("config_updated", [True, False])
@pytest.mark.parametrize("when", ["before patch()", "after patch()"])
def test_a_layer_repeated_by_reference_is_refused_saying_so(config_updated, when):
    # layer-repeat experiments put one layer module in two places: both store their K/V as its one layer_idx (stock's
    # cache breaks on it too); after patch() the walk of the modules met it once, and the call failed deep inside
    # with "the cache holds 3 rows but the input has 1"
    from tiny_models import left_padded_batch, tiny_model

    model = tiny_model("llama", num_hidden_layers=4)

    def repeat():
        layers = model.model.layers
        model.model.layers = torch.nn.ModuleList([layers[0], layers[1], layers[1], layers[2], layers[3]])
        if config_updated:
            model.config.num_hidden_layers = 5

    ids, mask = left_padded_batch([3, 7, 5], seed=1)
    message = (r"its layers 1 and 2 hold one attention module \(a layer repeated in the list by reference\), whose K/V "
               r"both would store as layer_idx 1; give each place a copy of its own \(copy.deepcopy\)")
    if when == "before patch()":
        repeat()
        with pytest.raises(NotImplementedError, match=message):
            astrai_hf.patch(model, max_tokens=512, page_size=4)
        assert not astrai_hf.is_patched(model)
        return
    astrai_hf.patch(model, max_tokens=512, page_size=4)
    try:
        model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
        repeat()
        with pytest.raises(NotImplementedError, match=re.escape("(it changed since patch()): ") + message):
            model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
        assert astrai_hf.get_pool(model).stats()["num_used_pages"] == 0
    finally:
        astrai_hf.unpatch(model)


@pytest.mark.parametrize("arch", ["gemma2", "qwen2", "llama"])
@pytest.mark.parametrize("when", ["before patch()", "after patch()"])
def test_layers_swapped_without_renumbering_across_sliding_and_full_are_refused(arch, when):
    # stock masks a layer by the kind of its place in config.layer_types (and its default cache keeps a layer's
    # tokens by the kind of its layer_idx: it fails once a prompt outgrows the window); paged attention had applied
    # its module's layer_idx's window, and the tokens differed; a swap among layers of one kind gives stock's tokens
    from tiny_models import left_padded_batch, tiny_model

    def swapped(model):
        model.model.layers = torch.nn.ModuleList([model.model.layers[1], model.model.layers[0],
                                                  *model.model.layers[2:]])
        return model

    ids, mask = left_padded_batch([20, 13], seed=1)
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False)
    model = tiny_model(arch)
    types = getattr(model.config, "layer_types", None) or ["full_attention"] * model.config.num_hidden_layers
    refused = types[0] != types[1]
    if when == "after patch()":
        astrai_hf.patch(model, max_tokens=512, page_size=4)
        model.generate(ids, **kw)
    message = rf"its layer 0 holds the attention module of layer_idx 1, a {types[1]} layer at a place config.layer_types makes {types[0]}"
    try:
        if refused:
            with pytest.raises(NotImplementedError, match=message):
                swapped(model)
                if when == "before patch()":
                    astrai_hf.patch(model, max_tokens=512, page_size=4)
                model.generate(ids, **kw)
        else:
            want = swapped(tiny_model(arch)).generate(ids, **kw)
            swapped(model)
            if when == "before patch()":
                astrai_hf.patch(model, max_tokens=512, page_size=4)
            assert torch.equal(model.generate(ids, **kw), want)
    finally:
        pool = astrai_hf.get_pool(model) if astrai_hf.is_patched(model) else None
        astrai_hf.unpatch(model)
    assert pool is None or pool.stats()["num_used_pages"] == 0
    assert refused == (arch != "llama")


@pytest.mark.parametrize("family, heads", [("gpt_bigcode", 1), ("persimmon", 4)])
def test_a_num_key_value_heads_the_family_ignores_is_named_with_the_fix(family, heads):
    # these families compute their own KV head count; a stray config field sized the pool (the message had said
    # to build the pool with PagePool.from_model(model), which patch() had done)
    config = T.AutoConfig.for_model(family, vocab_size=96, hidden_size=64, n_embd=64, intermediate_size=128,
                                    num_hidden_layers=2, n_layer=2, num_attention_heads=4, n_head=4,
                                    max_position_embeddings=256, n_positions=256, pad_token_id=0,
                                    num_key_value_heads=2)
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(3, 96, (1, 10), generator=torch.Generator().manual_seed(0))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False)
    ref = model.generate(ids, **kw)
    with astrai_hf.patched(model, max_tokens=512) as patched:
        with pytest.raises(ValueError, match=rf"produced K/V with {heads} heads .*the model's config names 2 KV heads where its attention computes {heads}.*"
                                             rf"set model.config.num_key_value_heads = {heads} and build the pool"):
            patched.generate(ids, **kw)
        assert astrai_hf.get_pool(patched).stats()["num_used_pages"] == 0
        patched.config.num_key_value_heads = heads
        astrai_hf.patch(patched, max_tokens=512)
        assert torch.equal(patched.generate(ids, **kw), ref)


def test_a_layer_module_that_hands_attention_to_a_child_is_patched():
    # DBRX's DbrxNormAttentionNorm holds the layer_idx and calls its child DbrxAttention, which uses the
    # AttentionInterface: judged by the child, it is patched (tokens as stock's)
    torch.manual_seed(0)
    config = T.DbrxConfig(d_model=64, n_heads=4, n_layers=2, vocab_size=96, max_seq_len=64, pad_token_id=0,
                          attn_config={"kv_n_heads": 2, "clip_qkv": 8.0},
                          ffn_config={"ffn_hidden_size": 64, "moe_num_experts": 2, "moe_top_k": 1})
    config.attn_config.rope_theta = 10000.0  # (read by DBRX's rotary module, not set by its config on 5.24)
    with _quiet():
        model = T.DbrxForCausalLM(config).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(3.0)
    stock = model.generate(_IDS, **_KW)
    pool = PagePool.from_model(model, max_tokens=512)
    with astrai_hf.patched(model, pool=pool):
        assert torch.equal(model.generate(_IDS, **_KW), stock)
        assert torch.equal(model.generate(_IDS, **_KW), stock)  # (a prefix hit)
        assert pool.stats()["num_used_pages"] == 0


def _gemma3_text():
    cfg = T.Gemma3TextConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=5,
                             max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                             layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    torch.manual_seed(0)
    model = T.Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(3.0)
    return model


def test_bidirectional_attention_set_in_the_config_after_loading_is_refused_or_run_as_stock():
    # Gemma 3 reads config.use_bidirectional_attention at every forward to build its mask, while its attention
    # modules keep is_causal=True from loading: a flag set afterwards was served causally, with no error
    model = _gemma3_text()
    ids = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(2))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, eos_token_id=None)
    causal = model.generate(ids, **kw)
    model.config.use_bidirectional_attention = True
    stock = model.generate(ids, **kw)
    assert not torch.equal(stock, causal)
    with pytest.raises(NotImplementedError, match="use_bidirectional_attention"):
        astrai_hf.patch(model, max_tokens=512)
    model.config.use_bidirectional_attention = False
    pool = PagePool.from_model(model, max_tokens=512, page_size=4)
    astrai_hf.patch(model, pool=pool)
    assert torch.equal(model.generate(ids, **kw), causal)  # fills the prefix cache with causal K/V
    model.config.use_bidirectional_attention = True  # set after patch()
    for _ in range(2):
        assert torch.equal(model.generate(ids, **kw), stock)
    name = astrai_hf.cache_kwarg(model)
    for _ in range(2):
        with astrai_hf.PagedCache(pool, ids, kw["attention_mask"]) as cache:
            assert torch.equal(model.generate(ids, **kw, **{name: cache}), stock)
    model.config.use_bidirectional_attention = False
    assert torch.equal(model.generate(ids, **kw), causal)
    assert pool.stats()["num_used_pages"] == 0

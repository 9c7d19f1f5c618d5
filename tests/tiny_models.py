"""Tiny random-weight models of each supported architecture, built from configs (nothing downloaded)."""

from __future__ import annotations

import torch
import transformers as T

VOCAB = 96
PAD, BOS, EOS = 0, 1, 2

_COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, max_position_embeddings=256,
)

SPECS = {
    "llama": (T.LlamaConfig, T.LlamaForCausalLM, dict(num_key_value_heads=2)),
    "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM, dict(
        num_key_value_heads=2, num_hidden_layers=3, use_sliding_window=True, sliding_window=5, max_window_layers=1)),
    "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM, dict(num_key_value_heads=2, head_dim=16)),
    "mistral": (T.MistralConfig, T.MistralForCausalLM, dict(num_key_value_heads=1, sliding_window=5)),
    "gemma2": (T.Gemma2Config, T.Gemma2ForCausalLM, dict(
        num_key_value_heads=2, head_dim=16, sliding_window=5, attn_logit_softcapping=5.0, final_logit_softcapping=30.0)),
    "gemma3": (T.Gemma3TextConfig, T.Gemma3ForCausalLM, dict(
        num_key_value_heads=2, head_dim=16, sliding_window=5, num_hidden_layers=3,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"])),
    "phi3": (T.Phi3Config, T.Phi3ForCausalLM, dict(num_key_value_heads=2, sliding_window=5)),
    "gpt2": (T.GPT2Config, T.GPT2LMHeadModel, dict(n_embd=64, n_layer=2, n_head=4, n_positions=256)),
    "opt": (T.OPTConfig, T.OPTForCausalLM, dict(ffn_dim=128, word_embed_proj_dim=64)),
    "gpt_neox": (T.GPTNeoXConfig, T.GPTNeoXForCausalLM, dict()),
    "falcon": (T.FalconConfig, T.FalconForCausalLM, dict(new_decoder_architecture=True, num_kv_heads=2)),
}

ARCHS = [name for name in SPECS if name != "falcon"]


def tiny_model(arch: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> T.PreTrainedModel:
    """A 2-3 layer random model of ``arch`` with peaked logits (so greedy decoding has clear winners).
    ``overrides`` replace config fields (e.g. ``max_position_embeddings``)."""
    config_cls, model_cls, extra = SPECS[arch]
    kwargs = {**_COMMON, **extra, **overrides}
    if arch == "gpt2":
        for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            kwargs.pop(k)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs)).eval().to(dtype)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(3.0)
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = None  # fixed output lengths
    return model


def left_padded_batch(lengths, seed: int = 0):
    """Random prompts of the given real lengths, left-padded into one batch: (input_ids, attention_mask)."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for r, n in enumerate(lengths):
        ids[r, width - n:] = torch.randint(3, VOCAB, (n,), generator=g)
        mask[r, width - n:] = 1
    return ids, mask


def paged_and_reference(model, pool, ids, mask, max_new_tokens: int = 6):
    """Greedy ``generate()`` of ``model`` patched with ``pool``, and of the unpatched model with ``DynamicCache``:
    (paged tokens, reference tokens). The model is unpatched again afterwards."""
    import astrai_hf

    greedy = dict(attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False)
    ref = model.generate(ids, past_key_values=T.DynamicCache(), **greedy)
    astrai_hf.patch(model, pool=pool)
    try:
        return model.generate(ids, **greedy), ref
    finally:
        astrai_hf.unpatch(model)


def reads_the_host(model):
    """A module's forward of the kind people wrap to watch a model (it reads a value back to the host every call);
    returns the values read and a function that undoes the wrap."""
    seen, mlp = [], model.model.layers[0].mlp

    def watched(x, _forward=mlp.forward):
        out = _forward(x)
        seen.append(out.abs().max().item())
        return out

    mlp.forward = watched
    return seen, lambda: vars(mlp).pop("forward")

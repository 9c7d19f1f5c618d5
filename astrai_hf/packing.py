"""Packed prefill: run a left-padded prefill on its real tokens only, as one ragged sequence.

``generate()`` hands the model a rectangle ``[B, q]`` in which row ``r`` has ``q - n_r`` padding columns. A patched
forward instead feeds ``[1, N]`` with ``N = sum(n_r)`` (each row's real tokens back to back, each with its own
positions), paged attention keeps the rows apart with ``qo_indptr`` (varlen attention, the ragged layout of
continuous-batching engines such as vLLM and FlashInfer), and only each row's last token goes through the LM head
(``logits_to_keep`` as an index tensor). The logits come back as ``[B, 1, vocab]``, what ``generate()`` reads.
Runs of identical rows (``num_return_sequences`` / beams) are computed once and their logits repeated.

With ``prefill_chunk_tokens`` the packed sequence is fed in pieces of at most that many tokens, so a very long
prompt never needs activations for all its tokens at once; pages for the whole prompt are allocated up front.
"""

from __future__ import annotations

import torch

from .interrupts import interrupts_deferred
from .metadata import StepMetadata
from .pool import has_caller_hooks

_ALL_OUTPUTS = ("output_hidden_states", "output_attentions")


def last_logits_only(kwargs: dict) -> bool:
    """Whether a forward asks for the last position's logits alone: ``logits_to_keep=1``, an int (as
    ``generate()`` passes it). An index tensor, even ``tensor([1])``, picks positions by index (column 1, not
    the last), and a numpy or 0-dim integer indexes too, dropping the position axis."""
    value = kwargs.get("logits_to_keep")
    return isinstance(value, int) and value == 1


def wants_packing(model, kwargs: dict, step: StepMetadata, input_ids, *, drop_padding: bool,
                  chunk_tokens: int | None) -> bool:
    """Whether this forward (of a model whose family may be packed) can run packed and gains from it.

    Packing needs: a multi-token step fed as ``input_ids`` by keyword, with ``position_ids``; only the last
    position's logits asked for (``logits_to_keep=1``, as ``generate()`` asks); no hidden states or attentions of
    every position asked for; no forward hooks of the caller's (:func:`~astrai_hf.pool.has_caller_hooks`).
    It gains when padding or duplicate rows would be dropped (``drop_padding``), or when the step is longer than
    ``chunk_tokens``.
    """
    if input_ids is None or input_ids.dim() != 2 or input_ids.shape[1] < 2 or step.is_packed:
        return False
    if not last_logits_only(kwargs) or kwargs.get("return_dict") is False:
        return False
    start = step.logical_len - input_ids.shape[1]
    if kwargs.get("position_ids") is None and any(
            p != start or s != step.logical_len for p, s in zip(step.prev_lens, step.seq_lens)):
        # padding, and positions of the model's own counting: the column index for most families (padding
        # included), the mask's for OPT, which packed rows cannot tell apart; generate() always passes them
        return False
    config = model.config
    for name in _ALL_OUTPUTS:
        if kwargs.get(name) or (kwargs.get(name) is None and getattr(config, name, False)):
            return False
    if kwargs.get("inputs_embeds") is not None or kwargs.get("token_type_ids") is not None:
        return False
    B, q = input_ids.shape
    real = sum(s - p for s, p in zip(step.seq_lens[:: step.group], step.prev_lens[:: step.group]))
    if real == 0:  # a chunk of padding only (generate(prefill_chunk_size=...) on a left-padded prompt): nothing to pack
        return False
    if not ((drop_padding and real < B * q) or (chunk_tokens is not None and real > chunk_tokens)):
        return False
    if has_caller_hooks(model):  # a hook of the caller's may index the rows and positions of stock's rectangle
        return False
    # an id outside the vocabulary under the mask (a pad token added to the tokenizer, the embeddings not
    # resized): the rectangle embeds it, and fails, as stock does; packed, it would never be read
    return not ids_outside_vocabulary(model, input_ids)


def ids_outside_vocabulary(model, input_ids: torch.Tensor) -> bool:
    """Whether ``input_ids`` (any shape, integer) hold an id outside ``[0, num_embeddings)`` of the model's input
    embeddings, which stock's forward fails on (``IndexError``) even under the mask: a step that skips such a
    column (packed, or fed after a prefix-cache hit) must not run instead. Where the size is unknown (``model``
    None, or no embedding table), only negative ids (``-100`` padding) count. One host read (a device sync)."""
    try:
        size = getattr(model.get_input_embeddings(), "num_embeddings", None)
    except (AttributeError, NotImplementedError):
        size = None
    if input_ids.numel() == 0:
        return False
    if not isinstance(size, int):
        return bool(input_ids.min() < 0)
    return not bool(0 <= input_ids.min() and input_ids.max() < size)


PADDING_CHECK = "warn_if_padding_and_no_attention_mask"


class padding_check_skipped:
    """Within it, the forward of each of the modules ``refs`` refer to (weakly: a model's
    ``WatchedModules.mask_checks``, its ``PreTrainedModel`` modules) skips transformers' check for padding without
    an attention mask, which GPT-2's forward runs on its input ids.

    A packed prefill and a decode step of the graph runner pass no mask: paged attention reads each row's padding
    from the cache. The check would read the ids back to the host and warn wherever the pad token id is fed (a
    bucket's padded row, a finished row, a pad token id that is also the eos token's), though the call gave a
    mask, as stock's forwards, given it, never warn. It is shadowed on the instances, not the class, so only this
    model's forwards skip it; an attribute of that name already on an instance is restored after.
    """

    def __init__(self, refs: list):
        self.modules = [m for m in (ref() for ref in refs) if m is not None]

    def __enter__(self):
        self.held = [module.__dict__.get(PADDING_CHECK) for module in self.modules]
        try:
            with interrupts_deferred():  # (a Ctrl-C midway would leave some shadowed for good)
                for module in self.modules:
                    module.__dict__[PADDING_CHECK] = _skip_padding_check
        except BaseException:  # (a Ctrl-C held back, raised here: the with block's exit does not run)
            self.__exit__()
            raise

    def __exit__(self, *exc):
        with interrupts_deferred():
            for module, held in zip(self.modules, self.held):
                if held is None:
                    module.__dict__.pop(PADDING_CHECK, None)
                else:
                    module.__dict__[PADDING_CHECK] = held


def _skip_padding_check(input_ids, attention_mask) -> None:
    return None


def packed_forward(forward, kwargs: dict, cache, state, step: StepMetadata, input_ids: torch.Tensor,
                   chunk_tokens: int | None):
    """Run the step ``step`` (already planned by ``cache``) packed, in chunks of at most ``chunk_tokens`` tokens.

    Returns:
        the last chunk's model output, with ``logits`` replaced by [B, 1, vocab]: each input row's logits at its
        last real token.
    """
    B, q = input_ids.shape
    g = step.group
    packed = step.pack()
    lens = torch.tensor(packed.qo_lens, device=input_ids.device)
    keep = torch.arange(q, device=input_ids.device)[None, :] >= (q - lens)[:, None]  # [R, q] real columns
    ids = input_ids[::g][keep][None]  # [1, N]: rows back to back
    positions = kwargs.get("position_ids")
    if positions is None:  # no padding (see wants_packing): each row's own positions are the columns
        positions = torch.cat([torch.arange(p, s) for p, s in zip(packed.prev_lens, packed.seq_lens)])
        positions = positions.to(input_ids.device)[None]
    else:
        positions = positions.expand(B, q)[::g][keep][None]
    N = ids.shape[1]
    ends = packed.qo_indptr[1:]  # row r's last token sits at ends[r] - 1
    chunk = chunk_tokens or N
    logits, out = [], None
    for start in range(0, N, chunk):
        stop = min(start + chunk, N)
        sub = packed.chunk(start, stop)
        last = [e - 1 - start for e in ends if start < e <= stop]
        cache._step, cache._step_layers = sub, set()
        state.step = sub
        with padding_check_skipped(state.watched.mask_checks):
            out = forward(
                **{
                    **kwargs,
                    "input_ids": ids[:, start:stop],
                    "position_ids": positions[:, start:stop],
                    "attention_mask": None,
                    "logits_to_keep": torch.tensor(last, dtype=torch.long, device=ids.device),
                }
            )
        logits.append(out.logits[0])
    rows = torch.cat(logits)  # [R, vocab], rows in order: every row ends in exactly one chunk
    if g > 1:
        rows = rows.repeat_interleave(g, dim=0)
    out.logits = rows[:, None]
    return out

"""Quickstart: the same tokens with PagedCache as with stock transformers, and the pool's statistics.

Run: .venv/bin/python examples/quickstart.py   (CPU is fine; uses the embedded SmolLM2-135M-Instruct)
"""

import torch

import astrai_hf
from astrai_hf import PagedCache, PagePool
from astrai_hf.models import load_model

model, tokenizer = load_model()
chats = [[{"role": "user", "content": q}] for q in ("What is the capital of France?", "Name a primary colour.")]
texts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)  # left-padded

stock = model.generate(**inputs, max_new_tokens=24, do_sample=False)

pool = PagePool.from_model(model, max_tokens=4096, page_size=16)
# unpatched model: stock attention over K/V gathered from the pool; the prompt tells the cache its padding
with PagedCache(pool, inputs["input_ids"], inputs["attention_mask"]) as cache:
    # the cache keyword: `cache=` on transformers 5.24 and later, `past_key_values=` before
    unpatched = model.generate(**inputs, max_new_tokens=24, do_sample=False, **{astrai_hf.cache_kwarg(model): cache})
    print("stored tokens per row (no padding):", cache.seq_lens, "| pages:", pool.stats()["num_used_pages"])

astrai_hf.patch(model, pool=pool)  # the one line: paged attention inside generate()
patched = model.generate(**inputs, max_new_tokens=24, do_sample=False)
astrai_hf.unpatch(model)

print("identical tokens:", torch.equal(stock, unpatched), torch.equal(stock, patched))
for row in tokenizer.batch_decode(patched[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True):
    print("->", row.strip())
print("pool after the calls:", {k: v for k, v in pool.stats().items() if k.startswith("num_")})

"""Tensor parallelism: every rank loads its share of the model with transformers' plan and keeps the K/V of its own
heads in its own pool; the tokens are those of one process.

Run (CPU, gloo; the embedded SmolLM2-135M-Instruct has 3 KV heads, so it splits over 3 ranks, not 2), after
examples/quickstart.py or `astrai-hf demo` has converted the embedded model once:
    .venv/bin/python -m torch.distributed.run --nproc_per_node 3 examples/tensor_parallel.py
On GPUs use as many ranks as GPUs, a number that divides the model's KV heads.
"""

import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer, DistributedConfig

import astrai_hf
from astrai_hf.models import embedded_model_path

path = embedded_model_path()
model = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_plan="auto")).eval()
tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
rank = dist.get_rank()

chats = [[{"role": "user", "content": q}] for q in ("What is the capital of France?", "Name a primary colour.")]
texts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)

astrai_hf.patch(model, max_tokens=4096, page_size=16)  # on every rank, with the same arguments
out = model.generate(**inputs, max_new_tokens=24, do_sample=False)
pool = astrai_hf.get_pool(model)
print(f"rank {rank}: {pool.config.spec.num_kv_heads} of {model.config.num_key_value_heads} KV heads, "
      f"KV bytes by device {pool.stats()['kv_bytes_by_device']}")
if rank == 0:
    for row in tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True):
        print("->", row.strip())
dist.destroy_process_group()

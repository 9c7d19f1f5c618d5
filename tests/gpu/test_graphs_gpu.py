"""CUDA-graph decode against eager decode on a CUDA device, in bf16. Skipped without CUDA.

The model is the embedded SmolLM2-135M-Instruct when its file is installed, else its architecture with random
weights. Eager decode steps and replayed ones run the same Triton decode kernel (attention/__init__.py), so their
tokens must be equal; where they are not, the message gives the first step that differs and the gap between the
two tokens' logits there.
"""

import pytest
import torch

import astrai_hf
from astrai_hf import PagePool
from tiny_models import reads_the_host

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GRAPH_ATOL = 0.01  # logits, bf16: a replayed graph against the same kernels launched without one
NEW = 24


@pytest.fixture(scope="module")
def model():
    from astrai_hf.bench_gpu import load

    model, _ = load("cuda", torch.bfloat16, random_weights=False)
    return model


def _prompts(model, batch, seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 40, (batch,), generator=g).tolist()
    width = max(lengths)
    ids = torch.full((batch, width), model.config.pad_token_id or 0, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, n in enumerate(lengths):
        ids[r, width - n:] = torch.randint(3, model.config.vocab_size, (n,), generator=g)
        mask[r, width - n:] = 1
    return ids.cuda(), mask.cuda()


def _generate(model, pool, ids, mask, graphs):
    astrai_hf.patch(model, pool=pool, cuda_graphs=graphs)
    try:
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
        runner = next(iter(model._astrai_patch_state.runners.values()), None) if graphs else None
        replays = runner.replays if runner is not None else 0
    finally:
        astrai_hf.unpatch(model)
    assert pool.stats()["num_used_pages"] == 0
    return out, replays


def _same_tokens(graph_out, eager_out, width):
    """Assert every row's new tokens are equal; on a difference, name the row, the step and the logit gap."""
    for r in range(graph_out.sequences.shape[0]):
        a, b = graph_out.sequences[r, width:], eager_out.sequences[r, width:]
        if not torch.equal(a, b):
            step = int((a != b).nonzero()[0])
            logits = eager_out.logits[step][r].float()
            raise AssertionError(f"row {r} differs at step {step}: tokens {int(a[step])} and {int(b[step])}, logits "
                                 f"{float(logits[a[step]]):.4f} and {float(logits[b[step]]):.4f} in the eager run")


@pytest.mark.parametrize("batch", [1, 2, 3, 4, 5, 6, 7, 8, 9, 17])
def test_graph_replay_equals_eager(model, batch):
    pool = PagePool.from_model(model, max_tokens=32 * 128, page_size=16, prefix_cache=False)
    ids, mask = _prompts(model, batch, seed=batch)
    eager, _ = _generate(model, pool, ids, mask, graphs=False)
    graph, replays = _generate(model, pool, ids, mask, graphs=True)
    assert replays == NEW - 1  # every decode step replayed a graph
    _same_tokens(graph, eager, ids.shape[1])


def test_a_then_b_then_a_and_returned_outputs_are_not_mutated(model):
    pool = PagePool.from_model(model, max_tokens=32 * 128, page_size=16, prefix_cache=False)
    a, b = _prompts(model, 3, seed=11), _prompts(model, 5, seed=12)
    want_a, _ = _generate(model, pool, *a, graphs=False)
    want_b, _ = _generate(model, pool, *b, graphs=False)
    astrai_hf.patch(model, pool=pool, cuda_graphs=True)
    try:
        kw = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, output_logits=True,
                  return_dict_in_generate=True)
        first = model.generate(a[0], attention_mask=a[1], **kw)
        kept_tokens = first.sequences.clone()
        kept_logits = [t.clone() for t in first.logits]
        second = model.generate(b[0], attention_mask=b[1], **kw)
        third = model.generate(a[0], attention_mask=a[1], **kw)
    finally:
        astrai_hf.unpatch(model)
    assert torch.equal(first.sequences, kept_tokens)  # later replays did not touch what was returned
    assert all(torch.equal(x, y) for x, y in zip(first.logits, kept_logits))
    assert torch.equal(third.sequences, first.sequences)  # the same graphs, the same answers
    _same_tokens(first, want_a, a[0].shape[1])
    _same_tokens(second, want_b, b[0].shape[1])
    assert pool.stats()["num_used_pages"] == 0


def test_capture_graphs_up_front_then_generate_replays_them(model):
    pool = PagePool.from_model(model, max_tokens=32 * 128, page_size=16, max_reqs=24, prefix_cache=False)
    batches = [_prompts(model, b, seed=20 + b) for b in (3, 9)]
    wants = [_generate(model, pool, ids, mask, graphs=False)[0] for ids, mask in batches]
    astrai_hf.patch(model, pool=pool, cuda_graphs=True)
    try:
        seconds = astrai_hf.capture_graphs(model)
        runner = next(iter(model._astrai_patch_state.runners.values()))
        assert list(seconds) == [24, 16, 8, 4, 2, 1] == runner.captured  # largest first, every bucket
        print("capture seconds per bucket:", {b: round(s, 3) for b, s in seconds.items()})
        for (ids, mask), want in zip(batches, wants):
            replays = runner.replays
            got = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True)
            assert runner.replays == replays + NEW - 1
            _same_tokens(got, want, ids.shape[1])
        assert runner.captured == [24, 16, 8, 4, 2, 1]  # nothing captured inside generate()
    finally:
        astrai_hf.unpatch(model)
    assert pool.stats()["num_used_pages"] == 0


@pytest.mark.parametrize("batch", [1, 3, 9, 17])
def test_graph_replay_equals_the_same_kernels_run_without_a_graph(model, batch):
    """Replay against the runner's stand-in on the same device: the same Triton kernels over the same workspace,
    launched one by one instead of from a graph. The two should agree to the last bit; a stale workspace buffer or
    a wrong address frozen into a graph moves logits by far more than ``GRAPH_ATOL`` (dropping the newest key
    moved them by 0.065-0.088 on this model), which a comparison of tokens alone can miss."""
    from astrai_hf.graphs import DecodeGraphRunner

    pool = PagePool.from_model(model, max_tokens=32 * 128, page_size=16, prefix_cache=False)
    ids, mask = _prompts(model, batch, seed=30 + batch)
    outs = []
    for use_cuda_graphs in (False, True):
        astrai_hf.patch(model, pool=pool, cuda_graphs=True)
        state = model._astrai_patch_state
        runner = state.runners[id(pool)] = DecodeGraphRunner(model, state.forward, pool,
                                                             use_cuda_graphs=use_cuda_graphs)
        try:
            outs.append(model.generate(ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW,
                                       do_sample=False, output_logits=True, return_dict_in_generate=True))
            assert runner.replays == NEW - 1
        finally:
            astrai_hf.unpatch(model)
    assert pool.stats()["num_used_pages"] == 0
    eager, graph = outs
    width = ids.shape[1]
    differs = (eager.sequences[:, width:] != graph.sequences[:, width:]).any(0).nonzero()
    steps = int(differs[0]) + 1 if len(differs) else NEW  # compare logits up to the first step whose tokens differ
    worst = max(float((a.float() - b.float()).abs().max()) for a, b in zip(eager.logits[:steps], graph.logits[:steps]))
    print(f"batch {batch}: largest logit difference, graph against no graph, {worst:.4g} over {steps} steps")
    assert worst <= GRAPH_ATOL


def test_a_pool_on_cuda_without_an_index_serves_the_model_on_cuda_0(model):
    # torch.device("cuda") != torch.device("cuda:0"), which the model's layers report
    pool = PagePool.from_model(model, max_tokens=2048, device="cuda")
    assert all(d == torch.device("cuda", torch.cuda.current_device()) for d in pool.config.layer_devices)
    ids, mask = _prompts(model, 2, seed=5)
    out, _ = _generate(model, pool, ids, mask, graphs=False)
    assert out.sequences.shape == (2, ids.shape[1] + NEW)


def test_eager_decode_on_cuda_runs_the_triton_kernel(model, monkeypatch):
    from astrai_hf.attention import triton_kernels

    calls = []
    decode = triton_kernels.decode_attention
    monkeypatch.setattr(triton_kernels, "decode_attention", lambda *a, **k: calls.append(a[0].shape[0]) or decode(*a, **k))
    pool = PagePool.from_model(model, max_tokens=32 * 128, page_size=16, prefix_cache=False)
    ids, mask = _prompts(model, 3, seed=40)
    stores = []
    store = triton_kernels.store_kv
    monkeypatch.setattr(triton_kernels, "store_kv", lambda k, *a, **kw: stores.append(k.shape[0]) or store(k, *a, **kw))
    _generate(model, pool, ids, mask, graphs=False)
    assert calls == [3] * (NEW - 1) * model.config.num_hidden_layers
    assert stores[-model.config.num_hidden_layers:] == [3] * model.config.num_hidden_layers  # K and V in one launch


def test_a_parameter_given_a_new_tensor_after_capture_is_read_by_the_next_call(model):
    # a graph holds the address of each tensor it read: replayed after the final norm got a new weight tensor, it
    # had computed with the old one; the next call captures again
    pool = PagePool.from_model(model, max_tokens=32 * 128, page_size=16, prefix_cache=False)
    ids, mask = _prompts(model, 3, seed=50)
    before, _ = _generate(model, pool, ids, mask, graphs=True)
    old = model.model.norm.weight
    model.model.norm.weight = torch.nn.Parameter(old.detach().flip(0), requires_grad=False)
    try:
        astrai_hf.patch(model, pool=pool, cuda_graphs=True)
        try:
            model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)  # captures
            first = next(iter(model._astrai_patch_state.runners.values()))
            model.model.norm.weight = torch.nn.Parameter(old.detach().flip(0) * 0.5 + old.detach() * 0.5,
                                                         requires_grad=False)
            graph_out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW,
                                       do_sample=False, output_logits=True, return_dict_in_generate=True)
            runner = next(iter(model._astrai_patch_state.runners.values()))
            assert runner is not first and runner.replays == NEW - 1
        finally:
            astrai_hf.unpatch(model)
        eager_out, _ = _generate(model, pool, ids, mask, graphs=False)
        _same_tokens(graph_out, eager_out, ids.shape[1])
        assert not torch.equal(graph_out.sequences, before.sequences)
    finally:
        model.model.norm.weight = old


def test_a_forward_cuda_refuses_to_capture_runs_eagerly_and_later_captures_work(model):
    # a module's forward reading a value back to the host each step (as a watch of the activations does): CUDA
    # refuses it on a capturing stream. The decode steps run eagerly instead, the stream current before the capture
    # is current again, and once the wrap is gone the next call captures and replays on the same device
    pool = PagePool.from_model(model, max_tokens=32 * 128, page_size=16, prefix_cache=False)
    ids, mask = _prompts(model, 3, seed=60)
    eager_out, _ = _generate(model, pool, ids, mask, graphs=False)
    seen, undo = reads_the_host(model)
    try:
        refused_out, replays = _generate(model, pool, ids, mask, graphs=True)
    finally:
        undo()
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    assert replays == 0 and len(seen) >= NEW
    _same_tokens(refused_out, eager_out, ids.shape[1])
    graph_out, replays = _generate(model, pool, ids, mask, graphs=True)
    assert replays == NEW - 1
    _same_tokens(graph_out, eager_out, ids.shape[1])

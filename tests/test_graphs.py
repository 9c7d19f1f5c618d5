"""DecodeGraphRunner on the CPU stand-in (replay = the captured forward run again over the same static buffers):
decode through the runner equals eager decode token for token."""

import collections
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

import astrai_hf
from astrai_hf import PagePool
from astrai_hf.graphs import bucket_sizes
from tiny_models import left_padded_batch, tiny_model

pytestmark = pytest.mark.equivalence


def _runner(model):
    state = model._astrai_patch_state
    (runner,) = state.runners.values()
    return runner


def _generate(model, ids, mask, *, graphs, pool=None, seed=0, **kwargs):
    pool = pool or PagePool.from_model(model, max_tokens=4096, page_size=4, prefix_cache=False)
    astrai_hf.patch(model, pool=pool, cuda_graphs=graphs)
    try:
        torch.manual_seed(seed)
        out = model.generate(ids, attention_mask=mask, **kwargs)
        runner = _runner(model) if graphs else None
        return out, runner
    finally:
        astrai_hf.unpatch(model)
        assert pool.stats()["num_used_pages"] == 0 and pool.stats()["num_reqs_used"] == 0


def test_buckets():
    assert bucket_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert bucket_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert bucket_sizes(3) == [1, 2, 3]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2", "gpt2", "gpt_neox"])
@pytest.mark.parametrize("mode", ["greedy", "sample", "beams"])
def test_runner_equals_eager(arch, mode):
    model = tiny_model(arch)
    ids, mask = left_padded_batch([5, 1, 12], seed=1)
    kwargs = {"greedy": dict(do_sample=False), "sample": dict(do_sample=True, top_k=10),
              "beams": dict(do_sample=False, num_beams=2)}[mode]
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=9, **kwargs) if mode != "sample" else None
    eager, _ = _generate(model, ids, mask, graphs=False, max_new_tokens=9, **kwargs)
    out, runner = _generate(model, ids, mask, graphs=True, max_new_tokens=9, **kwargs)
    assert torch.equal(out, eager)
    if ref is not None:
        assert torch.equal(out, ref)
    assert runner.replays == 8  # every decode step went through the runner


@pytest.mark.parametrize("batch", [1, 2, 3, 4, 5, 6, 7, 8, 9, 17])
def test_batch_sizes_padded_to_buckets(batch):
    model = tiny_model("llama")
    ids, mask = left_padded_batch([1 + (3 * r) % 11 for r in range(batch)], seed=batch)
    eager, _ = _generate(model, ids, mask, graphs=False, do_sample=False, max_new_tokens=5)
    out, runner = _generate(model, ids, mask, graphs=True, do_sample=False, max_new_tokens=5)
    assert torch.equal(out, eager)
    assert runner.captured == [min(b for b in runner.buckets if b >= batch)]


def test_batch_of_8_then_3_and_static_addresses():
    model = tiny_model("qwen3")
    pool = PagePool.from_model(model, max_tokens=4096, page_size=4, prefix_cache=False)
    astrai_hf.patch(model, pool=pool, cuda_graphs=True)
    try:
        results = []
        for lengths in ([9, 3, 14, 1, 6, 8, 2, 11], [4, 13, 7], [9, 3, 14, 1, 6, 8, 2, 11]):
            ids, mask = left_padded_batch(lengths, seed=len(lengths))
            ws = _runner(model).workspace if results else None
            before = None if ws is None else [t.data_ptr() for t in (ws.input_ids, ws.position_ids, ws.req_rows,
                                                                    ws.seq_lens, ws.slot_mapping)]
            results.append((ids, mask, model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=6)))
            ws = _runner(model).workspace
            if before is not None:
                assert before == [t.data_ptr() for t in (ws.input_ids, ws.position_ids, ws.req_rows, ws.seq_lens,
                                                         ws.slot_mapping)]
        assert _runner(model).captured == [8, 4]
    finally:
        astrai_hf.unpatch(model)
    for ids, mask, out in results:
        assert torch.equal(out, model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=6))


def test_workspace_pads_only_rows_a_larger_batch_wrote():
    """Rows past the batch point at the trash (token 0, position 0, the trash row, one token, slot 0); a step of the
    same batch size as the one before writes no padding again."""
    from astrai_hf.graphs import DecodeWorkspace

    ws = DecodeWorkspace(8, pad_row=99, device=torch.device("cpu"))
    pads = []
    real_pad = ws.pad
    ws.pad = lambda start, stop: (pads.append((start, stop)), real_pad(start, stop))

    def step(B, base):
        # (indices in one [3, B] block, as a patched decode step's are, or lengths only on the host)
        meta = types.SimpleNamespace(prev_lens=[base] * B, seq_lens=[base + 1] * B,
                                     req_rows=torch.arange(B), slot_mapping=torch.arange(B) + 100, decode_indices=None)
        if base % 2:
            meta.decode_indices = torch.stack([meta.slot_mapping, meta.req_rows, torch.full((B,), base + 1)])
        ws.fill(meta, torch.full((B, 1), 7), None, next(b for b in (1, 2, 4, 8) if b >= B))

    step(6, 10)
    step(6, 11)
    assert pads == []  # nothing but trash past row 6 from the start
    step(3, 12)
    assert pads == [(3, 6)]  # the rows the batch of 6 wrote (bucket 4 reads row 3)
    # (a step whose indices are on the host alone: each of the three taken from its own field)
    assert ws.seq_lens[:3].eq(13).all() and ws.req_rows[:3].tolist() == [0, 1, 2]
    assert ws.slot_mapping[:3].tolist() == [100, 101, 102] and ws.position_ids[:3].eq(12).all()
    step(3, 13)
    assert pads == [(3, 6)]
    assert ws.input_ids[3:].eq(0).all() and ws.position_ids[3:].eq(0).all() and ws.req_rows[3:].eq(99).all()
    assert ws.seq_lens[3:].eq(1).all() and ws.slot_mapping[3:].eq(0).all()
    assert ws.input_ids[:3].eq(7).all() and ws.position_ids[:3].eq(13).all() and ws.seq_lens[:3].eq(14).all()
    step(8, 14)
    ws.pad(0, 8)  # as capture_graphs does before it captures a bucket
    assert ws.filled == 0 and ws.req_rows.eq(99).all()


def test_returned_logits_are_not_overwritten_by_the_next_replay():
    model = tiny_model("llama")
    ids, mask = left_padded_batch([4, 7], seed=3)
    kwargs = dict(do_sample=False, max_new_tokens=6, output_logits=True, return_dict_in_generate=True)
    ref = model.generate(ids, attention_mask=mask, **kwargs)
    out, runner = _generate(model, ids, mask, graphs=True, **kwargs)
    assert runner.replays == 5
    for got, want in zip(out.logits, ref.logits):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert len({t.data_ptr() for t in out.logits}) == len(out.logits)  # each step's logits are its own


def test_falls_back_to_eager_above_the_largest_bucket_and_for_multi_token_steps():
    model = tiny_model("llama")
    pool = PagePool.from_model(model, max_tokens=4096, page_size=4, prefix_cache=False)
    ids, mask = left_padded_batch([3, 5, 2], seed=4)
    ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=4)
    astrai_hf.patch(model, pool=pool, cuda_graphs=True)
    try:
        model.generate(ids[:1], attention_mask=mask[:1], do_sample=False, max_new_tokens=2)
        runner = _runner(model)
        runner.max_batch, runner.buckets = 2, [1, 2]
        replays = runner.replays
        assert torch.equal(model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=4), ref)
        assert runner.replays == replays  # batch 3 > the largest bucket (2): every step ran eager
    finally:
        astrai_hf.unpatch(model)
    # prompt lookup: verify steps carry several tokens per row and run eager; plain decode steps replay
    kwargs = dict(do_sample=False, prompt_lookup_num_tokens=2, max_new_tokens=8)
    one, runner = _generate(model, ids[:1], mask[:1], graphs=True, **kwargs)
    assert torch.equal(one, model.generate(ids[:1], attention_mask=mask[:1], **kwargs))


@pytest.mark.slow
def test_embedded_model_through_the_runner():
    from astrai_hf.models import embedded_gguf, load_model

    try:
        embedded_gguf()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    model, tokenizer = load_model()
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                           tokenize=False)
             for q in ("What is the capital of France?", "List three prime numbers.", "Hi")]
    inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16)
    pool = PagePool.from_model(model, max_tokens=4096, page_size=16, max_seq_len=512)
    out, runner = _generate(model, ids, mask, graphs=True, pool=pool, do_sample=False, max_new_tokens=16)
    assert torch.equal(out, ref) and runner.replays == 15 and runner.captured == [4]


def test_capture_graphs_captures_every_bucket_largest_first_then_generate_only_replays():
    model = tiny_model("llama")
    pool = PagePool.from_model(model, max_tokens=4096, page_size=4, max_reqs=20, prefix_cache=False)
    batches = [left_padded_batch([2 + (5 * r) % 9 for r in range(b)], seed=b) for b in (3, 9, 1)]
    refs = [model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=5) for ids, mask in batches]
    astrai_hf.patch(model, pool=pool, cuda_graphs=True)
    try:
        # every slot but the trash slot, bit for bit (the storage is uninitialised memory: it may hold NaNs)
        slot0_k = pool.storage.k[0][1:].clone().view(torch.int32)
        seconds = astrai_hf.capture_graphs(model)
        runner = _runner(model)
        assert list(seconds) == [20, 16, 8, 4, 2, 1] == runner.captured
        assert torch.equal(pool.storage.k[0][1:].view(torch.int32), slot0_k)  # capture wrote only the trash slot
        assert pool.stats()["num_used_pages"] == 0 and pool.stats()["num_reqs_used"] == 0
        assert astrai_hf.capture_graphs(model) == {}  # nothing left to capture
        for (ids, mask), ref in zip(batches, refs):
            replays = runner.replays
            assert torch.equal(model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=5), ref)
            assert runner.replays == replays + 4
        assert runner.captured == [20, 16, 8, 4, 2, 1]  # generate() captured nothing more
    finally:
        astrai_hf.unpatch(model)
    assert pool.stats()["num_used_pages"] == 0
    # unpatch() frees the graphs and their workspace (device memory) at once, not when the runner is collected
    assert runner.graphs == {} and runner.workspace is None


def test_capture_graphs_refuses_an_unpatched_or_eager_model():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="not patched"):
        astrai_hf.capture_graphs(model)
    with astrai_hf.patched(model, max_tokens=256, cuda_graphs=False):
        with pytest.raises(ValueError, match="cuda_graphs=False"):
            astrai_hf.capture_graphs(model)
    with astrai_hf.patched(model, max_tokens=256):  # the default off CUDA, which the message says
        with pytest.raises(ValueError, match=r"the default for a model not on one CUDA device.*off CUDA that is an "
                                             r"eager stand-in, which captures nothing"):
            astrai_hf.capture_graphs(model)


@pytest.mark.parametrize("batch", [3, 4])  # padded up to its bucket, and filling it
def test_a_cache_of_the_callers_through_the_runner_fills_and_serves_the_prefix_cache(batch):
    model = tiny_model("llama")
    ids, mask = left_padded_batch([12, 7, 9, 5][:batch], seed=3)
    eager, _ = _generate(model, ids, mask, graphs=False, do_sample=False, max_new_tokens=5)
    pool = PagePool.from_model(model, max_tokens=4096, page_size=4)
    astrai_hf.patch(model, pool=pool, cuda_graphs=True)
    try:
        hits = []
        for _ in range(2):
            before = pool.stats()["prefix_hit_tokens"]
            with astrai_hf.PagedCache(pool, ids, mask) as cache:
                out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=5,
                                     **{astrai_hf.cache_kwarg(model): cache})
            assert torch.equal(out, eager)
            hits.append(pool.stats()["prefix_hit_tokens"] - before)
        assert _runner(model).replays > 0
    finally:
        astrai_hf.unpatch(model)
    assert hits[0] == 0 and hits[1] > 0
    assert pool.stats()["num_used_pages"] == 0 and pool.stats()["num_reqs_used"] == 0


def test_a_decode_step_asking_for_logits_by_index_runs_eager_and_gets_them():
    # logits_to_keep as an index tensor is not the int 1 a graph's output holds; it had raised "Boolean value of
    # Tensor with more than one value is ambiguous"
    from transformers import DynamicCache

    model = tiny_model("llama", seed=3)
    ids, mask = left_padded_batch([3, 5], seed=3)
    name = astrai_hf.cache_kwarg(model)
    pool = PagePool.from_model(model, max_tokens=1024, page_size=4)

    def two_steps(cache):
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, use_cache=True, **{name: cache})
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            step_mask = torch.cat([mask, torch.ones_like(tok)], 1)
            return model(input_ids=tok, attention_mask=step_mask, use_cache=True, logits_to_keep=torch.tensor([0, 0]),
                         **{name: cache}).logits

    try:
        dynamic = DynamicCache(config=model.config)
    except TypeError:  # (older releases take no config)
        dynamic = DynamicCache()
    ref = two_steps(dynamic)
    with astrai_hf.patched(model, pool=pool, cuda_graphs=True), astrai_hf.PagedCache(pool, prefix_cache=False) as c:
        got = two_steps(c)
    assert got.shape == ref.shape == (2, 2, 96)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    assert pool.stats()["num_used_pages"] == 0


@pytest.mark.parametrize("arch", ["gpt2", "llama", "opt"])
@pytest.mark.parametrize("padded", [True, False])
def test_a_hand_loop_without_positions_through_the_runner_gives_stocks_logits(arch, padded):
    # the model counts positions itself (from the cache's length, padding included; OPT from the mask): the
    # workspace had filled the rows' real lengths, other positions for a padded row (other tokens on gpt2)
    from transformers import DynamicCache

    model = tiny_model(arch)
    ids, mask = left_padded_batch([2, 12] if padded else [12, 12], seed=0)

    def loop(cache):
        kw = {astrai_hf.cache_kwarg(model): cache, "use_cache": True, "logits_to_keep": 1}
        m, logits = mask, []
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=m, **kw)
            for _ in range(6):
                tok = out.logits[:, -1].argmax(-1, keepdim=True)
                m = torch.cat([m, torch.ones_like(tok)], 1)
                out = model(input_ids=tok, attention_mask=m, **kw)
                logits.append(out.logits[:, -1])
        return torch.stack(logits, 1)

    want = loop(DynamicCache(config=model.config))
    pool = PagePool.from_model(model, max_tokens=1024, page_size=4, prefix_cache=False)
    with astrai_hf.patched(model, pool=pool, cuda_graphs=True), astrai_hf.PagedCache(pool) as cache:
        got = loop(cache)
        replays = _runner(model).replays
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert (replays > 0) == (not padded)  # a padded batch with no positions runs eager
    assert pool.stats()["num_used_pages"] == 0


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_decode_through_the_runner_says_nothing_stock_does_not(monkeypatch, arch):
    # the runner asked its output `"past_key_values" in out`, on which transformers 5.24's ModelOutput logs a
    # deprecation warning; GPT-2's forward warns of padding where a pad token id comes with no attention mask,
    # which the runner's forward passes none of (paged attention reads each row's padding from its cache).
    # Spies on every call of warning_once (it logs once per process)
    import transformers.modeling_utils as modeling_utils
    import transformers.utils.generic as generic

    said = []
    for module in (generic, modeling_utils):
        monkeypatch.setattr(module.logger, "warning_once", lambda *a, **k: said.append(a))
    model = tiny_model(arch)
    assert model.config.pad_token_id == 0
    ids, mask = left_padded_batch([5, 9, 3], seed=3)  # 3 rows: bucket 4 pads a row, fed token 0
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert said == []
    out, runner = _generate(model, ids, mask, graphs=True, max_new_tokens=4, do_sample=False)
    assert torch.equal(out, ref) and runner.replays > 0
    assert said == []


def test_a_wrapped_gpt2_through_the_runner_says_nothing_of_padding(monkeypatch):
    # the check runs in the inner GPT2Model, which neither the wrapper nor its base_model is: every module with the
    # check skips it in the runner's forward
    import transformers
    import transformers.modeling_utils as modeling_utils

    class Wrapper(transformers.GPT2PreTrainedModel, transformers.GenerationMixin):
        def __init__(self, inner):
            super().__init__(inner.config)
            self.inner = inner

        def forward(self, input_ids=None, past_key_values=None, attention_mask=None, position_ids=None,
                    logits_to_keep=0, **kwargs):
            return self.inner(input_ids=input_ids, past_key_values=past_key_values, attention_mask=attention_mask,
                              position_ids=position_ids, logits_to_keep=logits_to_keep, **kwargs)

    said = []
    monkeypatch.setattr(modeling_utils.logger, "warning_once", lambda *a, **k: said.append(a))
    model = Wrapper(tiny_model("gpt2")).eval()
    assert model.base_model is model
    ids, mask = left_padded_batch([5, 9, 3], seed=3)  # bucket 4 pads a row, fed token 0, the pad token
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert said == []
    out, runner = _generate(model, ids, mask, graphs=True, max_new_tokens=4, do_sample=False)
    assert torch.equal(out, ref) and runner.replays > 0
    assert said == []
    assert "warn_if_padding_and_no_attention_mask" not in vars(model.inner.transformer)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "runner"])
def test_a_decode_step_reads_nothing_back_from_the_device_in_astrai_hf_code(monkeypatch, graphs):
    """Host reads of tensor values (``item()``, ``tolist()``, ``bool()``, ``torch.equal``, ``nonzero``) made by
    astrai-hf's own code, counted over a call of 3 new tokens and one of 9: a decode step adds none (on a GPU each
    would wait for the device; generate()'s own stopping check is transformers' and not counted)."""
    import collections
    import traceback

    from torch.utils._python_dispatch import TorchDispatchMode

    reads = collections.Counter()

    def note():
        for frame in reversed(traceback.extract_stack()[:-2]):
            if "astrai_hf" in frame.filename or "transformers" in frame.filename:
                if "astrai_hf" in frame.filename:
                    reads[f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}"] += 1
                return

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.split(".")[0] in ("_local_scalar_dense", "equal", "nonzero", "is_nonzero"):
                note()
            return func(*args, **(kwargs or {}))

    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: (note(), tolist(self))[1])
    model = tiny_model("llama")
    ids, mask = left_padded_batch([3, 7, 5], seed=4)
    counts = []
    for new in (3, 9):
        reads.clear()
        with Reads():
            _generate(model, ids, mask, graphs=graphs, do_sample=False, max_new_tokens=new, min_new_tokens=new)
        counts.append(dict(reads))
    assert counts[0] == counts[1]


def test_the_capture_path_gives_eagers_tokens_with_a_stand_in_for_cudas_graph_api(monkeypatch):
    """CUDA's graph API replaced by a stand-in whose replay runs the captured forward again into the captured
    output's tensors (as a replay recomputes its static outputs): the runner's capture path itself (warm-up on a
    side stream, capture into the shared memory pool, on the pool's device, garbage collection off meanwhile) runs
    on a CPU and gives eager's tokens."""
    import contextlib
    import gc

    from astrai_hf import attention, graphs
    from astrai_hf.patch import paged_attention_on

    capturing, devices, replays = {}, [], []

    class Stream:
        def wait_stream(self, other):
            pass

    class CUDAGraph:
        def replay(self):
            replays.append(1)
            self.rerun()

    @contextlib.contextmanager
    def graph(g, pool=None, stream=None, capture_error_mode="global"):
        assert pool is not None and not gc.isenabled()
        capturing["graph"] = g
        try:
            yield
        finally:
            capturing.clear()

    real_forward = graphs.DecodeGraphRunner._forward

    def forward(self, *args):
        out = real_forward(self, *args)
        g = capturing.get("graph")
        if g is not None:  # the capture: a replay recomputes into this output's tensors, paged attention and all
            def rerun():
                with paged_attention_on(args[3], args[4], self.pool):
                    out["logits"].copy_(real_forward(self, *args)["logits"])

            g.rerun = rerun
        return out

    real_on_device = attention.on_device
    for name, value in dict(Stream=Stream, current_stream=Stream, stream=lambda s: contextlib.nullcontext(),
                            graph_pool_handle=object, CUDAGraph=CUDAGraph, graph=graph).items():
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(graphs.DecodeGraphRunner, "_forward", forward)
    monkeypatch.setattr(attention, "on_device", lambda device: devices.append(device) or real_on_device(device))

    model = tiny_model("llama")
    ids, mask = left_padded_batch([5, 1, 12], seed=4)
    kw = dict(attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    want = model.generate(ids, **kw)
    pool = PagePool.from_model(model, max_tokens=1024, page_size=4, prefix_cache=False)
    astrai_hf.patch(model, pool=pool, cuda_graphs=True)
    try:
        model.generate(ids[:, -2:], attention_mask=mask[:, -2:], max_new_tokens=2)  # makes the runner
        runner = _runner(model)
        runner.use_cuda_graphs, runner.graphs = True, {}  # (what a CUDA pool gets)
        got = model.generate(ids, **kw)
    finally:
        astrai_hf.unpatch(model)
    assert torch.equal(got, want)
    assert list(runner.capture_seconds) == [4] and devices == [pool.config.layer_devices[0]]
    assert len(replays) == 5 and gc.isenabled()  # every decode step replayed, the capturing one too
    assert pool.stats()["num_used_pages"] == 0


def test_a_steps_indices_come_as_one_block_only_with_one_new_token_per_row():
    """The workspace takes a decode step's slot_mapping, req_rows and seq_lens as one [3, B] block; a step of two
    columns whose padding leaves B new tokens in all (here 1, 2 and 0) gets none, as its rows would not line up."""
    model = tiny_model("llama")
    pool = PagePool.from_model(model, max_tokens=256, page_size=4, prefix_cache=False)
    with astrai_hf.PagedCache(pool) as cache:
        ids, mask = torch.tensor([[0, 5], [6, 7], [0, 0]]), torch.tensor([[0, 1], [1, 1], [0, 0]])
        step = cache.plan_step(3, 2, attention_mask=mask, input_ids=ids, paged=True)
        assert step.seq_lens == [1, 2, 0] and step.decode_indices is None
        step = cache.plan_step(3, 1, attention_mask=torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], 1),
                               input_ids=torch.tensor([[1], [2], [3]]), paged=True)
        assert step.seq_lens == [2, 3, 1]
        assert torch.equal(step.decode_indices, torch.stack([step.slot_mapping, step.req_rows, torch.tensor([2, 3, 1])]))
        assert torch.equal(step.on(torch.device("cpu")).seq_lens_t, torch.tensor([2, 3, 1]))


_DEFERRED = collections.Counter()  # steps that deferred their writes, and steps that could not (tests/run counts)


def _positions(mask):
    return (mask.cumsum(-1) - 1).clamp(min=0)


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 9), min_size=1, max_size=4), steps=st.integers(1, 6),
       page_size=st.sampled_from([1, 2, 4]), shared=st.booleans(), samples=st.sampled_from([1, 3]),
       seed=st.integers(0, 2**16))
def test_deferred_table_writes_equal_the_writes_a_plan_makes(lengths, steps, page_size, shared, samples, seed):
    """A decode step planned for the runner leaves its req_to_token entries and token ids to the graph, or to
    ``step.send()``; sent, they equal what the plan writes itself, on random batches. Rows that decode from one
    prompt each (``samples`` of them, as ``num_return_sequences`` does) share its last page: their first decode step
    copies it and writes at plan time, deferring nothing. A prompt served from the prefix cache (``shared``)."""
    model = tiny_model("llama")
    pools = [PagePool.from_model(model, max_tokens=512, page_size=page_size, prefix_cache=shared) for _ in range(2)]
    g = torch.Generator().manual_seed(seed)
    ids, mask = left_padded_batch(lengths, seed=seed)
    if shared:  # every row's prompt cached by an earlier call
        for pool in pools:
            with astrai_hf.PagedCache(pool) as cache:
                cache.plan_step(len(lengths), ids.shape[1], attention_mask=mask, input_ids=ids, paged=True)
                cache._rows.known = cache._pending_known
    caches = [astrai_hf.PagedCache(pool, ids, mask) if shared else astrai_hf.PagedCache(pool) for pool in pools]
    try:
        for cache in caches:
            width = ids.shape[1] - cache.get_seq_length()
            cache.plan_step(len(lengths), width, attention_mask=mask, input_ids=ids[:, -width:], paged=True,
                            position_ids=_positions(mask)[:, -width:])
        B = len(lengths) * samples
        mask = mask.repeat_interleave(samples, 0)
        for t in range(steps):
            mask = torch.cat([mask, torch.ones(B, 1, dtype=torch.long)], 1)
            new = torch.randint(3, 90, (B, 1), generator=g)
            kw = dict(attention_mask=mask, input_ids=new, paged=True, position_ids=_positions(mask)[:, -1:])
            planned = caches[0].plan_step(B, 1, **kw)
            before = pools[1].req_to_token.table.clone(), pools[1].req_to_token.token_ids.clone()
            deferred = caches[1].plan_step(B, 1, defer_writes=True, **kw)
            copies = t == 0 and samples > 1 and page_size > 1 and any(n % page_size for n in lengths)
            assert (deferred.deferred is None) == copies
            _DEFERRED[deferred.deferred is not None] += 1
            if deferred.deferred is not None:
                assert deferred.req_rows is None and deferred.decode_indices.device.type == "cpu"
            if deferred.deferred is not None and (t or samples == 1):  # (rows expanded for samples: copied rows)
                assert torch.equal(pools[1].req_to_token.table, before[0])
                assert torch.equal(pools[1].req_to_token.token_ids, before[1])
            deferred.send()
            assert deferred.deferred is None
            for name in ("table", "token_ids"):
                assert torch.equal(getattr(pools[1].req_to_token, name), getattr(pools[0].req_to_token, name)), t
            assert torch.equal(deferred.slot_mapping, planned.slot_mapping)
            assert torch.equal(deferred.req_rows, planned.req_rows)
            assert torch.equal(deferred.decode_indices, planned.decode_indices)
            assert (deferred.prev_lens, deferred.seq_lens, deferred.row_starts) == (
                planned.prev_lens, planned.seq_lens, planned.row_starts)
    finally:
        for cache in caches:
            cache.release()
    for pool in pools:
        assert pool.stats()["num_used_pages"] == 0


def test_the_workspace_takes_indices_sent_from_the_host_as_one_padded_block():
    """On an accelerator a step that deferred its table writes sends its [3, B] indices from the host: the workspace
    copies its whole [3, max_batch] block in one transfer, rows past the batch padded (slot 0, the trash row,
    length 1), also after a larger batch. (The host block stands in here for the CPU copy a CUDA workspace keeps.)"""
    from astrai_hf.graphs import DecodeWorkspace

    from astrai_hf.graphs import GraphStep

    ws = DecodeWorkspace(8, pad_row=9, device=torch.device("cpu"))
    ws._host_indices = ws.indices.clone()
    pad = torch.tensor([0, 9, 1])[:, None]
    address = ws.indices.data_ptr()
    gstep = GraphStep(ws, 8, table=torch.zeros(10, 4, dtype=torch.int32))  # what a captured graph reads
    # (each size again right after a smaller one: the block sent whole keeps the rows past it padded)
    for B in (8, 3, 3, 5, 1, 1, 8):
        sent = torch.stack([torch.arange(B) + 100, torch.arange(B), torch.arange(B) + 2])
        step = types.SimpleNamespace(decode_indices=sent, prev_lens=list(range(B)))
        ws.fill(step, torch.arange(B)[:, None] + 10, None, 8)
        assert torch.equal(ws.indices[:, :B], sent)
        assert torch.equal(ws.indices[:, B:], pad.expand(3, 8 - B)), B
        assert torch.equal(ws.input_ids[B:], torch.zeros(8 - B, 1, dtype=torch.long))
        # copied into the buffers a graph reads, not bound to new ones
        assert ws.indices.data_ptr() == address
        assert torch.equal(torch.stack([gstep.slot_mapping, gstep.req_rows, gstep.seq_lens_t]), ws.indices)


def test_a_replayed_decode_step_sends_three_copies_to_the_device_outside_its_graph():
    """Around a replay astrai-hf's per-step device work is the input ids, the positions and one block of indices
    (the table writes happen inside the graph); counted by the host-work benchmark, whose replay is free."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "benchmarks" / "host_step.py"
    spec = importlib.util.spec_from_file_location("host_step", path)
    host_step = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(host_step)
    for batch, r in host_step.measure(batches=(1, 3), new_tokens=8, runs=1).items():
        assert r["astrai_device_ops"] == 3 and r["astrai_ops_by_name"].get("copy_") == 3, (batch, r)

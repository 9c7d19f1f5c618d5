"""The runner's CUDA-graph path on a CPU, under a stand-in for CUDA's graph API whose replay runs no Python (see
graph_tape.py): what a real replay would read (the tensors and Python decisions of the capture) is what this replay
reads, so a step that depends on Python running, or a graph gone stale, shows here as on a GPU."""

import contextlib

import pytest
import torch

import astrai_hf
import graph_tape
from astrai_hf import PagePool
from tiny_models import ARCHS, left_padded_batch, reads_the_host, tiny_model

pytestmark = pytest.mark.equivalence


@pytest.fixture
def captured(monkeypatch):
    """The graphs captured, in order, with every runner capturing through the stand-in (as on CUDA)."""
    return graph_tape.install_capturing(monkeypatch)


def _runner(model):
    (runner,) = model._astrai_patch_state.runners.values()
    return runner


@contextlib.contextmanager
def _patched(model, max_tokens=1024):
    """``model`` patched with graphs for the block; every page back in the pool when it is left."""
    astrai_hf.patch(model, max_tokens=max_tokens, page_size=4, cuda_graphs=True)
    pool = astrai_hf.get_pool(model)
    try:
        yield model
        assert pool.stats()["num_used_pages"] == 0
    finally:
        astrai_hf.unpatch(model)


def _steer(model, scale=0.5):
    """A forward hook shifting the residual stream after layer 0 (activation steering); returns its handle."""
    steer = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(5)) * scale
    return model.model.layers[0].register_forward_hook(
        lambda m, a, out: (out[0] + steer, *out[1:]) if isinstance(out, tuple) else out + steer)


@torch.no_grad()
def test_logits_a_replay_returned_are_not_overwritten_by_the_next(captured):
    # a loop of one's own keeping each step's logits: the graph's output buffer is the next replay's too, so what
    # a step hands back must be a copy of it
    model = tiny_model("llama")
    ids, mask = left_padded_batch([6, 6], seed=0)
    with _patched(model):
        with astrai_hf.PagedCache(astrai_hf.get_pool(model), prefix_cache=False) as cache:
            kw = {astrai_hf.cache_kwarg(model): cache, "use_cache": True, "logits_to_keep": 1}
            out, kept = model(input_ids=ids, attention_mask=mask, **kw), []
            for _ in range(4):
                token = out.logits[:, -1].argmax(-1, keepdim=True)
                mask = torch.cat([mask, torch.ones_like(token)], 1)
                out = model(input_ids=token, attention_mask=mask, position_ids=mask.sum(1, keepdim=True) - 1, **kw)
                kept.append((out.logits, out.logits.clone()))
        assert [g.replays for g in captured] == [4]  # every decode step through the graph
    assert all(torch.equal(a, b) for a, b in kept)


@pytest.mark.parametrize("arch", ARCHS)
def test_replays_that_run_no_python_give_stocks_tokens(captured, arch):
    stock = tiny_model(arch)
    batches = [left_padded_batch([5, 1, 12], seed=4), left_padded_batch([7, 3], seed=5)]
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)
    want = [stock.generate(ids, attention_mask=mask, **kw) for ids, mask in batches]
    model = tiny_model(arch)
    with _patched(model):
        got = [model.generate(ids, attention_mask=mask, **kw) for ids, mask in batches]
        runner = _runner(model)
        assert runner.captured == [4, 2] and len(captured) == 2
        assert [g.replays for g in captured] == [5, 5]  # every decode step replayed (a capture does not replay)
        for a, b in zip(got, want):
            assert torch.equal(a, b)


def test_batch_sizes_1_to_9_and_17_then_8_then_3_and_beams_replay_as_stock(captured):
    stock, model = tiny_model("llama"), tiny_model("llama")
    with _patched(model, max_tokens=4096):
        for batch in [*range(1, 10), 17, 8, 3]:
            ids, mask = left_padded_batch([3 + (7 * i) % 11 for i in range(batch)], seed=batch)
            kw = dict(attention_mask=mask, max_new_tokens=5, min_new_tokens=5, do_sample=False)
            assert torch.equal(model.generate(ids, **kw), stock.generate(ids, **kw)), batch
        ids, mask = left_padded_batch([6, 2], seed=1)
        kw = dict(attention_mask=mask, max_new_tokens=6, num_beams=3, num_return_sequences=2, do_sample=False)
        assert torch.equal(model.generate(ids, **kw), stock.generate(ids, **kw))
        assert sorted(set(_runner(model).captured)) == [1, 2, 4, 8, 16, 24]
        assert len(captured) == 6


def _new_tensors(model):
    g = torch.Generator().manual_seed(1)
    model.load_state_dict({k: torch.randn(v.shape, generator=g) * 0.5 for k, v in model.state_dict().items()},
                          assign=True)


def _in_place(model):
    g = torch.Generator().manual_seed(1)
    model.load_state_dict({k: torch.randn(v.shape, generator=g) * 0.5 for k, v in model.state_dict().items()})


def _param_data(model):
    weight = model.model.layers[0].mlp.down_proj.weight
    weight.data = torch.randn(weight.shape, generator=torch.Generator().manual_seed(2))


def _transposed(model):
    weight = model.model.layers[0].self_attn.o_proj.weight  # (square) the same storage, read another way
    weight.data = weight.data.t()


def _new_lm_head(model):
    torch.manual_seed(3)
    model.lm_head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False)


def _forward_replaced(model):
    mlp = model.model.layers[0].mlp
    mlp.forward = lambda x, _f=type(mlp).forward: 3.0 * _f(mlp, x)  # a module's forward set on the instance


def _resized(model):
    torch.manual_seed(4)
    model.resize_token_embeddings(model.config.vocab_size + 40, mean_resizing=False)
    with torch.no_grad():
        model.lm_head.weight[-40:].normal_(0, 1.0)  # new tokens that win the argmax now and then


CHANGES = {
    "load_state_dict(assign=True)": _new_tensors,
    "param.data = ...": _param_data,
    "param.data = param.data.t()": _transposed,
    "a module assigned anew": _new_lm_head,
    "resize_token_embeddings()": _resized,
    "a forward set on a module": _forward_replaced,
    "load_state_dict() in place": _in_place,
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_model_changed_after_its_graphs_were_captured_gets_them_captured_again(captured, change):
    # a graph holds the addresses of the tensors it read and the Python decisions of its capture: replayed after a
    # parameter got a new tensor (on a GPU the old one's memory is freed) or a hook was added, it computed the model
    # as it was. Values written in place are read by a replay: those keep the graphs.
    stock, model = tiny_model("llama"), tiny_model("llama")
    ids, mask = left_padded_batch([5, 1, 12], seed=4)
    kw = dict(attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    before = stock.generate(ids, **kw)
    CHANGES[change](stock)
    want = stock.generate(ids, **kw)
    assert not torch.equal(want, before)  # the change changes the tokens
    with _patched(model):
        assert torch.equal(model.generate(ids, **kw), before)
        first = _runner(model)
        CHANGES[change](model)
        assert torch.equal(model.generate(ids, **kw), want)
        graph = captured[-1]
        assert all(graph.reads(p) for p in model.parameters())  # the graph replayed reads the model's tensors now
        kept = change.endswith("in place")
        assert (_runner(model) is first) == kept and len(captured) == (1 if kept else 2)
        assert torch.equal(model.generate(ids, **kw), want) and len(captured) == (1 if kept else 2)


def test_a_hook_added_inside_a_loop_of_ones_own_and_removed_after_it_leaves_no_stale_graph(captured):
    # a bucket captured inside the loop held the hook; once it was removed the model matched what the first graph
    # was captured over, so nothing looked again, and later calls replayed the hook
    from astrai_hf import PagedCache

    stock, model = tiny_model("llama"), tiny_model("llama")
    with _patched(model):
        ids, mask = left_padded_batch([5, 1, 12], seed=4)
        model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)  # captures bucket 4
        with torch.no_grad(), PagedCache(astrai_hf.get_pool(model), prefix_cache=False) as cache:
            kw = {astrai_hf.cache_kwarg(model): cache, "use_cache": True}
            out = model(input_ids=torch.tensor([[5, 6, 7, 8]]), **kw)
            hook = _steer(model, scale=1.0)
            for _ in range(3):  # captures bucket 1, the hook in it
                out = model(input_ids=out.logits[:, -1:].argmax(-1), logits_to_keep=1, **kw)
            hook.remove()
        for lengths, seed in (([6], 7), ([5, 1, 12], 4)):
            ids, mask = left_padded_batch(lengths, seed=seed)
            kw = dict(attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False)
            assert torch.equal(model.generate(ids, **kw), stock.generate(ids, **kw)), lengths


def test_a_peft_adapter_disabled_after_capture_gets_the_graphs_captured_again(captured):
    peft = pytest.importorskip("peft")

    def lora(model):
        torch.manual_seed(6)
        config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        return peft.get_peft_model(model, config).eval()

    stock = lora(tiny_model("llama"))
    ids, mask = left_padded_batch([5, 9], seed=1)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    adapted = stock.generate(**kw)
    with stock.disable_adapter():
        plain = stock.generate(**kw)
    assert not torch.equal(adapted, plain)
    with _patched(tiny_model("llama")) as base:
        model = lora(base)
        assert torch.equal(model.generate(**kw), adapted)
        with model.disable_adapter():
            assert torch.equal(model.generate(**kw), plain)
        assert torch.equal(model.generate(**kw), adapted)
        assert len(captured) == 3


def test_a_capture_reads_nothing_back_to_the_host(captured, monkeypatch):
    # the stand-in refuses host reads during a capture, as CUDA refuses them on a capturing stream. GPT-2's forward
    # checks its input ids for the pad token where no attention mask is given (the runner gives none): transformers
    # skips the check when it sees a capture, and the runner skips it in its own forward, also where transformers
    # does not see the capture (a release before the check looked)
    stock, model = tiny_model("gpt2", pad_token_id=0), tiny_model("gpt2", pad_token_id=0)
    ids, mask = left_padded_batch([5, 9], seed=1)
    kw = dict(attention_mask=mask, max_new_tokens=3, do_sample=False)
    want = stock.generate(ids, **kw)
    with _patched(model):
        assert torch.equal(model.generate(ids, **kw), want)
    assert len(captured) == 1
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # transformers' check runs then
    with _patched(model):
        assert torch.equal(model.generate(ids, **kw), want)
        assert _runner(model).uncapturable is None
    assert len(captured) == 2


UNCAPTURABLE = {
    # dynamic RoPE scaling compares the longest position with its cached length on the host each forward
    "dynamic RoPE": lambda: tiny_model("llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
    # longrope picks its frequencies by the longest position: on the host before transformers 5.2x, on the device
    # (torch.where, a capturable step) since
    "longrope": lambda: tiny_model("phi3", original_max_position_embeddings=16, rope_scaling={
        "rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8, "factor": 4.0}),
    "a forward reading the host": lambda: (m := tiny_model("llama"), reads_the_host(m))[0],
}


@pytest.mark.parametrize("case", list(UNCAPTURABLE))
def test_a_forward_cuda_cannot_capture_runs_its_decode_steps_eagerly(captured, case, caplog):
    # CUDA refuses a read back to the host on a capturing stream; generate() raised that error, leaving the current
    # stream the capture's own (torch's graph context does not restore it when ending the capture fails)
    stock, model = UNCAPTURABLE[case](), UNCAPTURABLE[case]()
    batches = [left_padded_batch([5, 1, 12], seed=4), left_padded_batch([7], seed=5)]  # crossing 16 positions
    kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False)
    want = [stock.generate(ids, attention_mask=mask, **kw) for ids, mask in batches]
    stream = torch.cuda.current_stream()
    with _patched(model), caplog.at_level("WARNING", logger="astrai_hf.graphs"):
        for _ in range(2):
            for (ids, mask), w in zip(batches, want):
                assert torch.equal(model.generate(ids, attention_mask=mask, **kw), w)
        assert torch.cuda.current_stream() is stream
        runner = _runner(model)
        refused = [r for r in caplog.records if "cannot be captured" in r.getMessage()]
        if runner.uncapturable is None:  # (longrope on a release that picks its frequencies on the device)
            assert runner.captured == [4, 1] and not refused
            return
        assert runner.captured == [] and len(captured) == 0 and runner.replays == 0
        assert len(refused) == 1 and type(model).__name__ in refused[0].getMessage()  # once, not per step
        assert astrai_hf.capture_graphs(model) == {}


def test_capture_graphs_on_a_forward_cuda_cannot_capture_warns_and_generate_runs_eagerly(captured, caplog):
    stock, model = UNCAPTURABLE["dynamic RoPE"](), UNCAPTURABLE["dynamic RoPE"]()
    ids, mask = left_padded_batch([5, 9], seed=1)
    kw = dict(attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    with _patched(model), caplog.at_level("WARNING", logger="astrai_hf.graphs"):
        assert astrai_hf.capture_graphs(model) == {}
        assert "cannot be captured as a CUDA graph" in caplog.text
        assert "_local_scalar_dense" in _runner(model).uncapturable
        assert torch.equal(model.generate(ids, **kw), stock.generate(ids, **kw))
    assert len(captured) == 0


def test_once_the_host_read_is_gone_the_next_call_captures(captured):
    # a refusal holds for the model as it was: removing the forward that read the host changes the model, and
    # the next call captures and replays
    stock, model = tiny_model("llama"), tiny_model("llama")
    ids, mask = left_padded_batch([5, 1, 12], seed=4)
    kw = dict(attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    want = stock.generate(ids, **kw)
    with _patched(model):
        seen, undo = reads_the_host(model)
        assert torch.equal(model.generate(ids, **kw), want)
        assert _runner(model).uncapturable is not None and len(captured) == 0 and seen
        undo()
        assert torch.equal(model.generate(ids, **kw), want)
        runner = _runner(model)
        assert runner.uncapturable is None and runner.captured == [4] and runner.replays == 5


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
def test_a_ctrl_c_during_a_capture_reaches_the_caller_and_refuses_nothing(captured, interrupt):
    # the stand-in fails ending a capture whose body raised, as CUDA may: the interrupt was taken for CUDA refusing
    # the step, swallowed, and every later decode step of the model ran eagerly (the graphs already captured too)
    stock, model = tiny_model("llama"), tiny_model("llama")
    one, three = left_padded_batch([4], seed=7), left_padded_batch([4, 2, 6], seed=7)
    kw = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False)
    want = [stock.generate(ids, attention_mask=mask, **kw) for ids, mask in (one, three)]
    armed, mlp = [False], model.model.layers[0].mlp

    def interrupted(x, _forward=mlp.forward):  # (a Ctrl-C arriving while the graph is recorded)
        if armed[0] and torch.cuda.is_current_stream_capturing():
            raise interrupt()
        return _forward(x)

    mlp.forward = interrupted
    stream = torch.cuda.current_stream()
    with _patched(model):
        assert torch.equal(model.generate(one[0], attention_mask=one[1], **kw), want[0])
        armed[0] = True
        with pytest.raises(interrupt):
            model.generate(three[0], attention_mask=three[1], **kw)
        armed[0] = False
        runner = _runner(model)
        assert torch.cuda.current_stream() is stream and runner.uncapturable is None
        assert astrai_hf.get_pool(model).stats()["num_used_pages"] == 0
        for (ids, mask), w in zip((three, one), want[::-1]):
            assert torch.equal(model.generate(ids, attention_mask=mask, **kw), w)
        # both buckets replay (4 decode steps, and the last token of a prompt met whole in the prefix cache)
        assert runner.captured == [1, 4] and [g.replays for g in captured] == [4 + 5, 5]


def test_a_ctrl_c_while_a_capture_ends_leaves_the_callers_stream_current(captured):
    # an interrupt inside torch's graph context as it ends the capture (the capture ended, its stream still the
    # current one): not a RuntimeError of CUDA's, it passed the handler that sets the caller's stream again
    stock, model = tiny_model("llama"), tiny_model("llama")
    ids, mask = left_padded_batch([4, 2, 6], seed=7)
    kw = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False)
    want = stock.generate(ids, attention_mask=mask, **kw)
    graph, armed = torch.cuda.graph, [True]
    end = graph.__exit__

    def interrupted_end(self, *exc):
        end(self, *exc)
        if armed[0]:
            armed[0] = False
            torch.cuda.set_stream(self.stream)  # (torch's context sets the caller's stream after ending the capture)
            raise KeyboardInterrupt

    graph.__exit__ = interrupted_end
    stream = torch.cuda.current_stream()
    with _patched(model):
        with pytest.raises(KeyboardInterrupt):
            model.generate(ids, attention_mask=mask, **kw)
        assert torch.cuda.current_stream() is stream
        assert astrai_hf.get_pool(model).stats()["num_used_pages"] == 0
        assert torch.equal(model.generate(ids, attention_mask=mask, **kw), want)
        assert torch.cuda.current_stream() is stream
        runner = _runner(model)
        # (4 decode steps, and the last token of the prompt, met whole in the prefix cache the first call filled)
        assert runner.uncapturable is None and runner.captured == [4] and runner.replays == 5


def test_a_ctrl_c_as_the_warm_up_stream_is_left_leaves_the_callers_stream_current(captured, monkeypatch):
    # the warm-up before a capture runs on a side stream; an interrupt inside its context's exit, before that set
    # the caller's stream again, left the side stream current
    model = tiny_model("llama")
    ids, mask = left_padded_batch([4, 2, 6], seed=7)
    kw = dict(attention_mask=mask, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    want = tiny_model("llama").generate(ids, **kw)
    stream_context, armed = torch.cuda.stream, [True]

    class interrupted_exit(stream_context):
        def __exit__(self, *exc):
            if armed[0] and exc[0] is None:
                armed[0] = False
                raise KeyboardInterrupt
            return super().__exit__(*exc)

    monkeypatch.setattr(torch.cuda, "stream", interrupted_exit)
    stream = torch.cuda.current_stream()
    with _patched(model):
        with pytest.raises(KeyboardInterrupt):
            model.generate(ids, **kw)
        assert torch.cuda.current_stream() is stream
        assert astrai_hf.get_pool(model).stats()["num_used_pages"] == 0
        assert torch.equal(model.generate(ids, **kw), want)
        assert torch.cuda.current_stream() is stream


def test_a_model_whose_capture_a_ctrl_c_stopped_is_freed_when_deleted(captured):
    # the interrupt, kept in a local of the capture's frame to be raised after the capture ended, was held by the
    # traceback through that frame: a cycle that kept the model and its pool until the garbage collector ran
    import gc
    import weakref

    model = tiny_model("llama")
    ids, mask = left_padded_batch([4, 2, 6], seed=7)
    mlp = model.model.layers[0].mlp

    def interrupted(x, _forward=mlp.forward):
        if torch.cuda.is_current_stream_capturing():
            raise KeyboardInterrupt
        return _forward(x)

    mlp.forward = interrupted
    gc.collect()
    gc.disable()
    try:
        astrai_hf.patch(model, max_tokens=1024, page_size=4, cuda_graphs=True)
        with pytest.raises(KeyboardInterrupt):
            model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
        refs = [weakref.ref(model), weakref.ref(astrai_hf.get_pool(model))]
        del model, mlp, interrupted
        assert [ref() is None for ref in refs] == [True, True]
    finally:
        gc.enable()


@pytest.mark.parametrize("first", ["a tuple asked for", "generate()"])
def test_a_decode_step_that_asks_for_a_tuple_gets_one_and_leaves_no_broken_graph(captured, first):
    # a graph hands back the output it was captured with: a tuple step captured the bucket (and every later call of
    # that batch size failed on out["logits"]), or got the ModelOutput a generate() captured
    from transformers import DynamicCache

    stock, model = tiny_model("llama"), tiny_model("llama")
    ids, mask = left_padded_batch([7], seed=5)
    gk = dict(attention_mask=mask, max_new_tokens=6, do_sample=False)
    want = stock.generate(ids, **gk)

    def tuple_step(m, cache):
        kw = {astrai_hf.cache_kwarg(m): cache, "use_cache": True}
        out = m(input_ids=torch.tensor([[5, 6, 7, 8]]), **kw)
        return m(input_ids=out.logits[:, -1:].argmax(-1), position_ids=torch.tensor([[4]]), logits_to_keep=1,
                 return_dict=False, **kw)

    with torch.no_grad():
        ref = tuple_step(stock, DynamicCache())
    with _patched(model):
        if first == "generate()":
            assert torch.equal(model.generate(ids, **gk), want)
        with torch.no_grad(), astrai_hf.PagedCache(astrai_hf.get_pool(model), prefix_cache=False) as cache:
            got = tuple_step(model, cache)
        assert isinstance(got, tuple) and torch.equal(got[0], ref[0])
        assert torch.equal(model.generate(ids, **gk), want)


def test_a_graph_captured_under_autocast_is_not_replayed_without_it_nor_the_other_way(captured):
    # autocast's state is not part of a bucket's key: a graph captured under bf16 autocast computed a later float32
    # call's decode steps in bf16; steps under autocast run eagerly now
    stock, model = tiny_model("llama"), tiny_model("llama")
    batches = [left_padded_batch([3 + (5 * i + s) % 13 for i in range(6)], seed=s) for s in (1, 2)]
    kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with _patched(model):
        for (ids, mask), autocast in zip(batches * 2, (True, False, False, True)):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                want = stock.generate(ids, attention_mask=mask, **kw)
                got = model.generate(ids, attention_mask=mask, **kw)
            assert torch.equal(got.sequences, want.sequences)
            if not autocast:  # (under autocast eager bf16 rounds differently from stock: the README's caveat)
                for a, b in zip(got.logits, want.logits):
                    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        assert _runner(model).captured == [8] and len(captured) == 1


def test_a_pool_of_ones_own_is_freed_with_its_runner_once_nothing_uses_it(captured):
    # the model's patch state kept a runner per pool it had run on, holding the pool (its K/V storage), its
    # workspace and its graphs for as long as the model stayed patched
    import gc
    import weakref

    stock, model = tiny_model("llama"), tiny_model("llama")
    ids, mask = left_padded_batch([5, 9], seed=1)
    kw = dict(attention_mask=mask, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    want = stock.generate(ids, **kw)
    with _patched(model):
        refs = []
        for _ in range(3):
            pool = PagePool.from_model(model, max_tokens=1024, page_size=4)
            with astrai_hf.PagedCache(pool, prefix_cache=False) as cache:
                assert torch.equal(model.generate(ids, **kw, **{astrai_hf.cache_kwarg(model): cache}), want)
            refs.append(weakref.ref(pool))
            del pool, cache
        gc.collect()
        assert [r() for r in refs] == [None] * 3 and len(captured) == 3
        assert list(model._astrai_patch_state.runners) == []
        assert torch.equal(model.generate(ids, **kw), want)  # the model's own pool keeps its runner
        assert len(model._astrai_patch_state.runners) == 1


def _hooks_of_the_caller(model, strengths):
    """Three hooks of the kinds people write: a per-row steering strength (a tensor of one value per row), a hook
    that centres the residual stream over the batch (it mixes rows), and a probe keeping what it saw."""
    layers = model.model.layers
    steer = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(5))
    seen = []

    def hidden(out):
        return out[0] if isinstance(out, tuple) else out

    def replace(out, h):
        return (h, *out[1:]) if isinstance(out, tuple) else h

    return seen, [
        layers[0].register_forward_hook(lambda m, a, out: replace(out, hidden(out) + strengths[:, None, None] * steer)),
        layers[1].register_forward_hook(lambda m, a, out: replace(out, hidden(out) - hidden(out).mean(0))),
        layers[1].register_forward_hook(lambda m, a, out: seen.append(hidden(out).detach())),
    ]


def test_hooks_of_the_callers_run_at_every_decode_step_on_the_batchs_rows(captured):
    # a batch of 3 padded to its bucket of 4 showed hooks 4 rows: a per-row strength failed on the size, a hook
    # mixing rows gave other tokens, and a probe ran at the capture only, its record overwritten by later replays
    # (prompts of one length: a hook mixing rows would mix in padding positions, which are not stock's, README)
    stock, model = tiny_model("llama"), tiny_model("llama")
    ids, mask = left_padded_batch([7, 7, 7], seed=4)
    kw = dict(attention_mask=mask, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    strengths = torch.tensor([0.5, -1.0, 2.0])
    seen, handles = _hooks_of_the_caller(stock, strengths)
    want, want_seen = stock.generate(ids, **kw), [t.clone() for t in seen]
    with _patched(model):
        plain = model.generate(ids, **kw)  # captures bucket 4
        got_seen, handles = _hooks_of_the_caller(model, strengths)
        assert torch.equal(model.generate(ids, **kw), want)
        assert [t.shape for t in got_seen] == [t.shape for t in want_seen]
        for a, b in zip(got_seen, want_seen):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
        runner = _runner(model)
        assert "hooks" in runner.uncapturable and runner.replays == 0
        for h in handles:
            h.remove()
        assert torch.equal(model.generate(ids, **kw), plain)  # captured again, replayed
        assert _runner(model).replays == 4 and len(captured) == 2


def _undoable_forward(model):
    _forward_replaced(model)
    return lambda: vars(model.model.layers[0].mlp).pop("forward")


@pytest.mark.parametrize("change", ["a forward hook", "a forward set on a module"])
def test_a_change_made_after_a_loops_first_step_leaves_no_stale_first_graph(captured, change):
    # the first capture took the model's layout (changed) with the pool's stamp of the loop's first step (before
    # the change): once the change was undone that stamp matched again, and later calls replayed the changed graph
    from astrai_hf import PagedCache

    stock, model = tiny_model("llama"), tiny_model("llama")
    ids, mask = left_padded_batch([6], seed=7)
    kw = dict(attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    with _patched(model):
        with torch.no_grad(), PagedCache(astrai_hf.get_pool(model), prefix_cache=False) as cache:
            loop = {astrai_hf.cache_kwarg(model): cache, "use_cache": True}
            out = model(input_ids=torch.tensor([[5, 6, 7, 8]]), **loop)
            undo = _steer(model, scale=1.0).remove if change == "a forward hook" else _undoable_forward(model)
            for _ in range(3):
                out = model(input_ids=out.logits[:, -1:].argmax(-1), logits_to_keep=1, **loop)
            undo()
        for _ in range(2):
            assert torch.equal(model.generate(ids, **kw), stock.generate(ids, **kw))
        # the model as it is now, captured and replayed: 7 decode steps, then 8 (the second prompt, wholly cached,
        # leaves its last token to a one-token step)
        assert _runner(model).replays == 7 + 8


def test_a_change_made_inside_a_loop_of_ones_own_drops_the_graphs_captured_before_it(captured):
    # a bucket captured inside the loop, after the change, takes the model's layout anew: the graphs captured
    # before the change must go with the old layout (the next call's check sees the model as the layout has it)
    from astrai_hf import PagedCache

    stock, model = tiny_model("llama"), tiny_model("llama")
    ids, mask = left_padded_batch([5, 1, 12], seed=4)
    kw = dict(attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    with _patched(model):
        assert torch.equal(model.generate(ids, **kw), stock.generate(ids, **kw))  # captures bucket 4
        with torch.no_grad(), PagedCache(astrai_hf.get_pool(model), prefix_cache=False) as cache:
            loop = {astrai_hf.cache_kwarg(model): cache, "use_cache": True}
            out = model(input_ids=torch.tensor([[5, 6, 7, 8]]), **loop)
            _forward_replaced(model)
            _forward_replaced(stock)
            for _ in range(3):  # captures bucket 1, with the change
                out = model(input_ids=out.logits[:, -1:].argmax(-1), logits_to_keep=1, **loop)
        assert len(captured) == 2
        assert torch.equal(model.generate(ids, **kw), stock.generate(ids, **kw))  # bucket 4 captured again
        assert len(captured) == 3


def test_a_padded_bucket_leaves_the_last_request_row_of_the_pool_untouched(captured):
    # a bucket's padding rows read and write the trash row of req_to_token, one past the last usable row: a call
    # holding that last row (the lower ones held by another cache) keeps its K/V
    from astrai_hf import PagedCache, PagePool

    model = tiny_model("llama")
    ids, mask = left_padded_batch([7, 3, 10], seed=1)  # 3 rows: the bucket of 4 pads one
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False)
    want = model.generate(ids, **kw)
    pool = PagePool.from_model(model, max_tokens=1024, page_size=4, max_reqs=8, prefix_cache=False)
    assert pool.req_to_token.trash_row == 8
    astrai_hf.patch(model, pool=pool, cuda_graphs=True)
    try:
        other_ids, other_mask = left_padded_batch([4] * 5, seed=2)
        with PagedCache(pool, other_ids, other_mask) as held:  # rows 0-4
            model.generate(other_ids, attention_mask=other_mask, max_new_tokens=1,
                           **{astrai_hf.cache_kwarg(model): held})
            assert torch.equal(model.generate(ids, **kw), want)  # rows 5, 6 and 7
            assert pool.stats()["num_reqs_used"] == 5 and len(captured) == 1
    finally:
        astrai_hf.unpatch(model)
    assert pool.stats()["num_used_pages"] == 0


def test_mrope_positions_of_a_text_call_run_the_decode_steps_eagerly(captured):
    # Qwen2-VL's generate() passes positions [4, B, 1] (text plus three M-RoPE axes): the workspace expanded them
    # to [B, 1] and every text call with graphs on failed
    from test_inputs import _qwen2_vl

    stock, model = _qwen2_vl(), _qwen2_vl()
    ids, mask = left_padded_batch([12, 3], seed=1)
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    with _patched(model):
        assert torch.equal(model.generate(ids, **kw), stock.generate(ids, **kw))


def test_captures_run_on_a_stream_of_the_runners_device_that_other_threads_cannot_break(captured, monkeypatch):
    # torch's default capture stream is made once per process, on the device current at the first capture: a model
    # on a second GPU captured on the first one's stream (nothing captured, its kernels launched eagerly); and in
    # the default global mode a CUDA call of another thread's generate() failed during a capture
    from astrai_hf import attention

    @contextlib.contextmanager
    def on_device(device):
        before, graph_tape.current_device[0] = graph_tape.current_device[0], str(device)
        try:
            yield
        finally:
            graph_tape.current_device[0] = before

    monkeypatch.setattr(attention, "on_device", on_device)
    stock, model = tiny_model("llama"), tiny_model("llama")
    ids, mask = left_padded_batch([5, 1, 12], seed=4)
    kw = dict(attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    with _patched(model):
        assert torch.equal(model.generate(ids, **kw), stock.generate(ids, **kw))
        device = str(_runner(model).device)
    assert [(g.stream.device, g.capture_error_mode) for g in captured] == [(device, "thread_local")]
    assert graph_tape.current_device[0] == "cuda:0" != device


@pytest.mark.parametrize("lengths", [[4, 7, 5], [4, 7, 5, 2]])  # padded to bucket 4; bucket 4 itself
def test_token_types_fed_every_decode_step_run_the_steps_eagerly(captured, lengths):
    # generate() hands GPT-2 the token types (zeros too add an embedding) afresh each step: the capture kept the
    # first step's, of the batch's rows (a batch padded to its bucket failed on the shapes; on CUDA a replay read
    # the freed tensor of the capture's step)
    stock, model = tiny_model("gpt2"), tiny_model("gpt2")
    ids, mask = left_padded_batch(lengths, seed=2)
    # (all zeros: read as plain text, so the call is paged; other types leave the patched path)
    kw = dict(attention_mask=mask, token_type_ids=torch.zeros_like(ids), max_new_tokens=6, min_new_tokens=6, do_sample=False)
    want = stock.generate(ids, **kw)
    with _patched(model):
        assert torch.equal(model.generate(ids, **kw), want)
        assert captured == [] and all(r.replays == 0 for r in model._astrai_patch_state.runners.values())
        # without them the same model replays
        kw.pop("token_type_ids")
        assert torch.equal(model.generate(ids, **kw), stock.generate(ids, **kw))
        assert _runner(model).replays == 5


@pytest.mark.parametrize("unplanned", ["output_attentions", "a hole in the mask"])
def test_a_forward_the_runner_does_not_run_after_replays_plans_its_own_step(captured, unplanned):
    # a replay runs no Python: the cache still held the replayed step with no layer stored, and the next forward
    # that the model's own attention runs (attention weights asked for, a mask with a hole) wrote through its plan
    from transformers import DynamicCache

    def loop(m, cache):
        kw = {astrai_hf.cache_kwarg(m): cache, "use_cache": True, "logits_to_keep": 1}
        ids = torch.randint(3, 90, (2, 6), generator=torch.Generator().manual_seed(1))
        mask, logits = torch.ones(2, 6, dtype=torch.long), []
        with torch.no_grad():
            out = m(input_ids=ids, attention_mask=mask, **kw)
            for t in range(5):
                mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
                extra = {}
                if t == 3 and unplanned == "output_attentions":
                    extra = {"output_attentions": True}
                elif t == 3:
                    mask[1, 2] = 0
                out = m(input_ids=out.logits[:, -1:].argmax(-1), attention_mask=mask,
                        position_ids=torch.full((2, 1), 6 + t), **extra, **kw)
                logits.append(out.logits[:, -1].clone())
        return logits

    stock = tiny_model("llama", attn_implementation="eager")
    model = tiny_model("llama", attn_implementation="eager")
    want = loop(stock, DynamicCache(config=stock.config))
    with _patched(model):
        with astrai_hf.PagedCache(astrai_hf.get_pool(model), prefix_cache=False) as cache:
            got = loop(model, cache)
        assert _runner(model).replays >= 2
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def _mixtral(**overrides):
    import transformers as T

    torch.manual_seed(0)
    config = T.MixtralConfig(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                             max_position_embeddings=256, pad_token_id=0, **overrides)
    return T.MixtralForCausalLM(config).eval()


@pytest.mark.parametrize("outputs", ["config.output_hidden_states", "router logits by default"])
def test_outputs_besides_the_logits_come_from_each_step_with_the_batchs_rows(captured, outputs):
    # a graph handed back the hidden states or router logits of its capture: the bucket's rows, and overwritten by
    # every later replay
    from transformers import DynamicCache

    def build():
        if outputs == "router logits by default":
            return _mixtral(output_router_logits=True)
        m = tiny_model("llama")
        m.config.output_hidden_states = True
        return m

    def loop(m, cache):
        kw = {astrai_hf.cache_kwarg(m): cache, "use_cache": True}
        ids = torch.randint(3, 90, (3, 5), generator=torch.Generator().manual_seed(1))
        outs = []
        with torch.no_grad():
            out = m(input_ids=ids, **kw)
            for t in range(3):
                out = m(input_ids=out.logits[:, -1:].argmax(-1), position_ids=torch.full((3, 1), 5 + t),
                        logits_to_keep=1, **kw)
                outs.append(out)
        return outs

    def extra(out):
        return out.hidden_states[-1] if outputs.endswith("hidden_states") else out.router_logits[0]

    stock, model = build(), build()
    want = loop(stock, DynamicCache(config=stock.config))
    with _patched(model):
        with astrai_hf.PagedCache(astrai_hf.get_pool(model), prefix_cache=False) as cache:
            got = loop(model, cache)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=1e-5)
        torch.testing.assert_close(extra(a), extra(b), rtol=0, atol=1e-5)


@pytest.mark.parametrize("first", ["early exit", "plain"])
def test_early_exit_drafts_and_plain_steps_each_run_the_depth_of_their_step(captured, first):
    # early exit lowers config.num_hidden_layers while it drafts: a graph captured in a draft (1 layer) had been
    # replayed by the next plain call's steps, and one captured by a plain call (2 layers) by the drafts
    import copy

    model = tiny_model("llama")
    # drafts of up to 6 tokens, none cut for confidence (generate() reads these from the drafting model's config)
    model.generation_config.num_assistant_tokens = 6
    model.generation_config.num_assistant_tokens_schedule = "constant"
    model.generation_config.assistant_confidence_threshold = 0.0
    stock = copy.deepcopy(model)
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 9, 5, 6, 7, 8, 5]])
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=14, return_dict_in_generate=True,
              output_scores=True)
    calls = [dict(assistant_early_exit=1, do_sample=False), dict(do_sample=False)]
    if first == "plain":
        calls = [calls[1], dict(assistant_early_exit=1, do_sample=True)]
    with _patched(model):
        for call in calls:
            torch.manual_seed(3)
            want = stock.generate(ids, **call, **kw)
            torch.manual_seed(3)
            got = model.generate(ids, **call, **kw)
            assert torch.equal(got.sequences, want.sequences), call
            for a, b in zip(got.scores, want.scores):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-4)
        assert _runner(model).replays > 0
    assert model.config.num_hidden_layers == stock.config.num_hidden_layers

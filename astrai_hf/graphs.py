"""DecodeGraphRunner: the decode step of a patched ``generate()`` replayed from a CUDA graph per batch-size bucket.

A decode step (one new token per row) is captured once per *bucket* (1, 2, 4, 8, then steps of 8) over a
:class:`DecodeWorkspace`: static, fixed-address buffers for everything that changes from step to step (input ids,
positions, each row's ``req_to_token`` row, ``seq_lens``, ``slot_mapping``). A batch is padded up to its bucket; padded
rows read and write only the trash page (slot 0). Graphs are captured lazily, on a bucket's first decode
step, or all at once, largest first, by :func:`astrai_hf.capture_graphs`, into one memory pool shared by all
buckets (the scheme of vLLM, SGLang's ``cuda_graph_runner`` and nano-vllm). Steps it cannot replay (several
tokens per row, a batch above the largest bucket, outputs besides the logits asked for, M-RoPE positions) run eager,
and so do all decode steps of a model whose forward cannot be captured (it reads a tensor back to the host, as
dynamic RoPE scaling does to compare the longest position with its cached length), returns tensors besides the
logits, or runs forward hooks of the caller's (which stock runs at every step, on the batch's rows). A model changed
since its graphs were captured (a parameter given a new tensor, a hook added, an adapter switched) has them captured
again at its next call (:meth:`DecodeGraphRunner.still_fits`).

Attention inside a captured step reads lengths and page tables from the workspace only: the Triton split-KV decode
kernel on CUDA (its grid never depends on lengths), else a static-shape torch path over the table's full width.

Without CUDA (tests), the same runner works as a stand-in: "capture" runs the forward over the static buffers, and
"replay" runs it again over the same buffers, so everything but the graph itself is exercised.
"""

from __future__ import annotations

import collections
import inspect
import logging
import weakref

import torch

from .attention.reference import attend
from .cache import autocast_on
from .metadata import StepMetadata
from .packing import last_logits_only, padding_check_skipped
from .pool import ModelLayout, has_caller_hooks, holds_tensor
from .storage import gather_kv

logger = logging.getLogger(__name__)


class CaptureRefused(RuntimeError):
    """The model's decode step could not be captured as a CUDA graph (CUDA refused an operation of its forward on a
    capturing stream: a read back to the host, a synchronisation). The step runs eagerly instead; see
    :attr:`DecodeGraphRunner.uncapturable`."""


def bucket_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 up to ``max_batch`` (which is always the last bucket)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 8))
    return sorted(set(sizes + [max_batch]))


class DecodeWorkspace:
    """Static per-step decode inputs for up to ``max_batch`` rows, allocated once at fixed addresses.

    Attributes:
        input_ids, position_ids: [max_batch, 1] int64.
        slot_mapping: [max_batch] int64, where each row's new K/V goes (padded rows: slot 0, the trash page).
        req_rows: [max_batch] int64, the ``req_to_token`` row of each batch row (padded rows: ``pad_row``).
        seq_lens: [max_batch] int64, tokens per row including this step's (padded rows: 1).
        indices: [3, max_batch] int64, whose rows are ``slot_mapping``, ``req_rows`` and ``seq_lens`` (filled by
            one copy from a step's ``decode_indices``, from the host where the step deferred its table writes: a
            captured step writes each row's ``req_to_token`` entry and token id itself).
    """

    def __init__(self, max_batch: int, pad_row: int, device: torch.device):
        self.max_batch, self.pad_row, self.device = max_batch, pad_row, device
        self.input_ids = torch.zeros(max_batch, 1, dtype=torch.long, device=device)
        self.position_ids = torch.zeros(max_batch, 1, dtype=torch.long, device=device)
        self._pad_column = torch.tensor([0, pad_row, 1], dtype=torch.long)[:, None]
        padded = self._pad_column.repeat(1, max_batch)
        self.indices = padded.to(device)
        self.slot_mapping, self.req_rows, self.seq_lens = self.indices
        self.filled = 0  # rows 0 .. filled - 1 may hold a real row's inputs; the rest point at the trash
        # on an accelerator, the indices block as the host last sent it whole (a step that deferred its table
        # writes), the rows past that batch padded: the copy covers the contiguous block, one transfer, where a
        # [3, B] slice of it is strided (a transfer and a copy kernel)
        self._host_indices = padded if device.type != "cpu" else None
        self._host_filled = 0

    def fill(self, step: StepMetadata, input_ids: torch.Tensor, position_ids: torch.Tensor | None, bucket: int) -> None:
        """Copy one step's inputs in (non-blocking) and point rows ``B ..`` at the trash (only those an earlier,
        larger batch wrote: at a steady batch size a step pads nothing). ``bucket`` is the graph's batch size."""
        B = input_ids.shape[0]
        self.input_ids[:B].copy_(input_ids, non_blocking=True)
        if position_ids is None:
            position_ids = torch.tensor(step.prev_lens, dtype=torch.long).view(B, 1)
        self.position_ids[:B].copy_(position_ids.expand(B, 1), non_blocking=True)
        sent = step.decode_indices
        if sent is not None and self._host_indices is not None and sent.device.type == "cpu":
            block = self._host_indices
            block[:, :B] = sent
            if self._host_filled > B:
                block[:, B : self._host_filled] = self._pad_column
            self._host_filled = B
            self.indices.copy_(block, non_blocking=True)  # (pageable: staged before the call returns)
        elif sent is not None:
            self.indices[:, :B].copy_(sent, non_blocking=True)
        else:
            self.req_rows[:B].copy_(step.req_rows, non_blocking=True)
            self.seq_lens[:B].copy_(torch.tensor(step.seq_lens), non_blocking=True)
            self.slot_mapping[:B].copy_(step.slot_mapping, non_blocking=True)
        if self.filled > B:  # (past the bucket too: one pad of every stale row, then none while B stays)
            self.pad(B, self.filled)
        self.filled = max(self.filled, B)

    def pad(self, start: int, stop: int) -> None:
        """Point rows ``start .. stop - 1`` at the trash: token 0 at position 0, reading the trash row of
        ``req_to_token`` (one token) and writing slot 0."""
        self.input_ids[start:stop].zero_()
        self.position_ids[start:stop].zero_()
        self.req_rows[start:stop].fill_(self.pad_row)
        self.seq_lens[start:stop].fill_(1)
        self.slot_mapping[start:stop].zero_()
        if stop >= self.filled:
            self.filled = min(self.filled, start)


# forward arguments (and config fields) asking for outputs besides the logits
_OTHER_OUTPUTS = ("output_hidden_states", "output_attentions", "output_router_logits")
# the forward arguments a replay serves: the workspace's inputs, the cache, and settings can_run() checks; any other
# (token_type_ids, the cache_position transformers 5.17 makes for remote code, an argument of the caller's) would
# be read as it was at the capture, at the bucket's size, every replay
_REPLAYED_KWARGS = frozenset(("input_ids", "position_ids", "attention_mask", "cache", "past_key_values", "use_cache",
                              "return_dict", "logits_to_keep", *_OTHER_OUTPUTS))


class GraphStep:
    """The metadata a captured decode step hands to ``cache.update()`` and attention: views of the workspace.
    ``layers``: the layers that stored K/V in the step's capture."""

    paged = True
    is_packed = False
    graph = True
    q_len = 1
    write_src = None
    group = 1

    def __init__(self, workspace: DecodeWorkspace, bucket: int, table: torch.Tensor):
        self.slot_mapping = workspace.slot_mapping[:bucket]
        self.req_rows = workspace.req_rows[:bucket]
        self.seq_lens_t = workspace.seq_lens[:bucket]
        self.table = table
        self.bucket = bucket
        self.layers: frozenset[int] = frozenset()

    def on(self, device: torch.device) -> "GraphStep":
        return self


def graph_decode_attention(query, k_cache, v_cache, step: GraphStep, *, scaling, sliding_window, softcap):
    """Decode attention reading only device buffers (capturable).

    Args:
        query: [B, H, 1, D]. Returns [B, 1, H, D] in the query's dtype.
    """
    from .attention import triton_decode, triton_on

    if triton_on(query.device):  # the kernel eager decode runs too (attention/__init__.py)
        return triton_decode(query, k_cache, v_cache, step.table, step.req_rows, step.seq_lens_t,
                             scaling=scaling, sliding_window=sliding_window, softcap=softcap)
    B, H, _, D = query.shape
    if scaling is None:
        scaling = D**-0.5
    W = step.table.shape[1]
    slots = step.table.index_select(0, step.req_rows).long().reshape(-1)  # [B * W]
    keys, values = gather_kv(k_cache, slots, B, W), gather_kv(v_cache, slots, B, W)
    t = torch.arange(W, device=query.device)[None, :]
    seq = step.seq_lens_t.long()[:, None]
    allowed = t < seq
    if sliding_window is not None:
        allowed &= t >= seq - sliding_window
    out = attend(query, keys, values, allowed[:, None, None, :], False, scaling, softcap)
    return out.transpose(1, 2).contiguous()


def length_readers(model: torch.nn.Module) -> list[str]:
    """Class names of ``model``'s attention modules whose ``forward`` calls ``get_seq_length()`` on the cache
    (Llama 4's NoPE layers count their query positions from it): each step they compute on a host integer, which
    a replayed graph would keep from its capture."""
    from .pool import attention_modules

    names = []
    for cls in dict.fromkeys(type(m) for m in attention_modules(model, every_copy=True)):
        for klass in cls.__mro__:  # a subclass's forward may call its parent's
            if "forward" not in vars(klass) or klass.__module__.startswith("torch."):
                continue
            try:
                source = inspect.getsource(vars(klass)["forward"])
            except (OSError, TypeError):
                continue
            if "get_seq_length" in source:
                names.append(cls.__name__)
                break
    return names


def _output_for_caller(out, logits: torch.Tensor, cache):
    """A new ModelOutput of ``out``'s class and keys, with ``logits`` and ``cache`` in place of the captured ones (a
    caller keeping an output of an earlier step sees it unchanged). Built item by item: its class's ``__init__``
    checks every field and costs several times more, at every decode step."""
    result = out.__class__.__new__(out.__class__)
    collections.OrderedDict.__init__(result)
    for name, value in out.items():
        result[name] = logits if name == "logits" else cache if name in ("cache", "past_key_values") else value
    return result


class DecodeGraphRunner:
    """Runs the decode steps of a patched model from per-bucket graphs over one :class:`DecodeWorkspace`.

    Args:
        model: the patched model; ``forward`` is its unwrapped forward.
        pool: the pool whose ``req_to_token`` table and storage the graphs read (one runner per pool).
        max_batch: the largest bucket (default: the pool's ``max_reqs``, at most 64).
        use_cuda_graphs: capture real CUDA graphs (CUDA only); False gives the eager stand-in.
    """

    def __init__(self, model, forward, pool, *, max_batch: int | None = None, use_cuda_graphs: bool | None = None):
        # (the model holds the runner; the pool is held by its caches and its owner, and freed when they let go:
        # the patch state drops the runner then)
        self._model, self.forward, self._pool = weakref.ref(model), forward, weakref.ref(pool)
        self.device = device = pool.config.layer_devices[0]
        self.use_cuda_graphs = device.type == "cuda" if use_cuda_graphs is None else use_cuda_graphs
        if self.use_cuda_graphs and device.type != "cuda":
            raise ValueError(f"CUDA graphs need the model on a CUDA device, the pool is on {device}")
        self.max_batch = max_batch or min(pool.config.max_reqs, 64)
        self.buckets = bucket_sizes(self.max_batch)
        # padded rows read the table's trash row (every entry slot 0) and write slot 0
        with torch.inference_mode(False):  # written by every later step, inside inference_mode() or not
            self.workspace = DecodeWorkspace(self.max_batch, pool.req_to_token.trash_row, device)
        self.graphs: dict[int, object] = {}
        # the layers a forward runs, all the pool's (early exit's drafts lower config.num_hidden_layers for a
        # while): graphs are captured and replayed at this depth only, a step at another runs eagerly (a replay
        # also counts its tokens stored in every layer)
        self.num_layers = pool.config.spec.num_layers
        # a layer that asks the cache for its length gets a Python int, which a graph would keep from its capture
        self.length_readers = length_readers(model)
        if self.length_readers:
            logger.debug("decode runner: %s read the cache length in their forward; decode steps run eagerly",
                         ", ".join(self.length_readers))
        self._mempool = None
        self._capture_stream = None  # a stream of the runner's device that captures run on
        self.replays = 0  # decode steps run through the runner
        self.captured: list[int] = []  # buckets captured, in order
        self.capture_seconds: dict[int, float] = {}  # bucket -> seconds its capture took (warm-up included)
        # (the model's ModelLayout when the first graph was captured, the pool's weights stamp it was last seen at)
        self._layout: tuple[ModelLayout, object] | None = None
        # why the model's decode step cannot be captured (CUDA refused an operation of its forward during a capture),
        # or None: every decode step then runs eagerly, until the model changes (a new runner tries again)
        self.uncapturable: str | None = None
        self.warn_refusal = True  # a refused capture logs a warning (else at info: a runner before this one warned)

    @property
    def model(self):
        """The patched model (None once it is gone)."""
        return self._model()

    @property
    def pool(self):
        """The pool the graphs read (None once it is gone)."""
        return self._pool()

    def close(self) -> None:
        """Drop the graphs and the workspace."""
        self.workspace, self.graphs = None, {}

    def still_fits(self, model) -> bool:
        """Whether the captured graphs still compute what ``model`` does: a graph holds the addresses of the tensors
        and the Python decisions (hooks, adapters, module code) of its capture, so a parameter given a new tensor
        (``load_state_dict(assign=True)``, ``resize_token_embeddings()``, ``param.data = ...``, a module assigned
        anew), a hook added or removed, or an adapter switched makes them stale (see
        :class:`~astrai_hf.pool.ModelLayout`). Values written in place keep them: a replay reads them.

        Looks again only when the pool's :meth:`~astrai_hf.pool.PagePool.check_weights` saw a change since the
        last look (its :attr:`~astrai_hf.pool.PagePool.weights_stamp` moved); call it after that check.
        """
        if self._layout is None:
            return True
        layout, stamp = self._layout
        now = self.pool.weights_stamp
        if now is stamp:
            return True
        if not layout.matches(model):
            return False
        self._layout = layout, now
        return True

    def bucket_for(self, batch: int) -> int | None:
        return next((b for b in self.buckets if b >= batch), None)

    def has_graph(self, batch: int) -> bool:
        """Whether a batch of ``batch`` rows replays a captured CUDA graph (no Python runs in its forward)."""
        entry = self.graphs.get(self.bucket_for(batch))
        return entry is not None and entry[0] is not None

    def can_run(self, step: StepMetadata, kwargs: dict, input_ids) -> bool:
        """A one-token-per-row step of a plain forward that fits a bucket: besides the inputs the workspace holds
        (ids, positions; the mask is the cache's), no forward argument but the cache, ``use_cache``,
        ``return_dict`` and ``logits_to_keep=1`` (a step with token types, say, runs eagerly)."""
        if self.workspace is None or input_ids is None or input_ids.shape[1] != 1 or step.is_packed:
            return False
        if self.length_readers or self.uncapturable is not None:
            return False
        if step.group != 1 or self.bucket_for(input_ids.shape[0]) is None:
            return False
        if not last_logits_only(kwargs):
            return False
        for name, value in kwargs.items():
            if value is not None and name not in _REPLAYED_KWARGS:
                return False
        model = self.model
        # outputs besides the logits (asked for by the call or by the config): a graph hands back those of its
        # capture, of the bucket's rows (the config's fields read from its dict, where it keeps them, some behind a
        # property as `_output_attentions`: its attribute lookup costs microseconds, at every step)
        fields = vars(model.config) if model is not None else {}
        if any(kwargs.get(k, fields.get(k, fields.get("_" + k))) for k in _OTHER_OUTPUTS):
            return False
        if fields.get("num_hidden_layers", self.num_layers) != self.num_layers:  # (a composite config: its text's)
            return False
        position_ids = kwargs.get("position_ids")
        if position_ids is not None and position_ids.dim() != 2:  # M-RoPE's [3 or 4, B, 1]: [B, 1] in the workspace
            return False
        return_dict = kwargs.get("return_dict")
        if return_dict is None and model is not None:
            return_dict = getattr(model.config, "return_dict", True)
        if return_dict is False:  # a tuple asked for: a graph hands back the output it was captured with
            return False
        if autocast_on(self.pool):
            # a graph keeps the dtypes of its capture: autocast's state is not part of a bucket's key, so steps
            # under it run eagerly (and a graph captured without it is never replayed under it)
            return False
        if position_ids is None and any(p != step.logical_len - 1 for p in step.prev_lens):
            # padding, and positions of the model's own counting (the cache's length for most families, the
            # mask's for OPT), which the workspace cannot know; generate() always passes them
            return False
        return all(s - p == 1 for s, p in zip(step.seq_lens, step.prev_lens))

    def run(self, cache, step: StepMetadata, kwargs: dict, input_ids: torch.Tensor, state):
        """Run one decode step through the bucket's graph; returns the model output with this step's logits
        ([B, 1, vocab], a fresh tensor the next replay does not touch) and ``cache``.

        Raises:
            CaptureRefused: the bucket's graph was to be captured and CUDA refused the forward; the step's K/V may
                be stored already (the warm-up run stored them), so the caller runs the step again, eagerly.
        """
        B = input_ids.shape[0]
        bucket = self.bucket_for(B)
        ws = self.workspace
        ws.fill(step, input_ids, kwargs.get("position_ids"), bucket)
        entry = self.graphs.get(bucket)
        if entry is None:
            entry = self.graphs[bucket] = self._capture(bucket, cache, kwargs, state)
            self.captured.append(bucket)
        graph, static_out, gstep = entry
        if graph is not None:
            graph.replay()
            out = static_out
            # every layer stored this step (a replay runs no Python): a forward that plans no step of its own (one
            # asking for attention weights) makes the cache plan its next one
            cache._step, cache._step_layers = gstep, set(gstep.layers)
        else:  # stand-in: run the forward again over the same static buffers
            out = self._forward(bucket, cache, kwargs, state, gstep)
            self._check_outputs(out, bucket)
        step.deferred = None  # (written by the graph)
        self.replays += 1
        if cache._pending_known is not None:  # every layer stored this step (a replay runs no Python)
            cache._rows.known, cache._pending_known = cache._pending_known, None
        return _output_for_caller(out, out["logits"][:B].clone(), cache)

    def capture_all(self, cache, kwargs: dict, state) -> dict[int, float]:
        """Capture every bucket not captured yet, largest first, with every row padded (rows read the trash row
        of ``req_to_token`` and write the trash slot, so no sequence's K/V is touched).

        Args:
            cache: a PagedCache on this runner's pool, passed to the forward (its ``update()`` runs during
                capture; it holds no rows).
            kwargs: the forward's other arguments as ``generate()`` passes them in a decode step (the cache,
                ``use_cache``, ``return_dict``, ``logits_to_keep=1``).
            state: the model's patch state, with paged attention switched on.

        Returns:
            ``{bucket: seconds}`` for the buckets captured by this call, largest first (0.0 on the stand-in); empty
            when the model's forward cannot be captured (:attr:`uncapturable` says why, and a warning was logged).
        """
        if self.workspace is None:
            raise RuntimeError("this DecodeGraphRunner was closed")
        done = {}
        for bucket in sorted(self.buckets, reverse=True):
            if bucket in self.graphs or self.uncapturable is not None:
                continue
            self.workspace.pad(0, bucket)
            try:
                self.graphs[bucket] = self._capture(bucket, cache, kwargs, state)
            except CaptureRefused:
                break
            self.captured.append(bucket)
            done[bucket] = self.capture_seconds.get(bucket, 0.0)
        return done

    def _forward(self, bucket: int, cache, kwargs: dict, state, gstep: GraphStep):
        ws = self.workspace
        # each row's new slot and token id into its req_to_token row, at column seq_lens - 1 (padded rows write the
        # trash row's column 0: slot 0, token 0, as it holds); a step planned with its writes deferred has made
        # none, the others made the same
        table, rows = self.pool.req_to_token, ws.req_rows[:bucket]
        cols = ws.seq_lens[:bucket] - 1
        table.write(rows, cols, ws.slot_mapping[:bucket])
        table.write_ids(rows, cols, ws.input_ids[:bucket, 0])
        state.step, cache._step, cache._step_layers = gstep, gstep, set()
        args = {k: v for k, v in kwargs.items() if k not in ("input_ids", "position_ids", "attention_mask")}
        with padding_check_skipped(state.watched.mask_checks):
            out = self.forward(input_ids=ws.input_ids[:bucket], position_ids=ws.position_ids[:bucket],
                               attention_mask=None, **args)
        gstep.layers = frozenset(cache._step_layers)
        return out

    def _check_outputs(self, out, bucket: int) -> None:
        """Decline the bucket (:meth:`_decline`) when the forward's output holds tensors besides the logits (a
        model that returns router logits or an auxiliary loss by default): a replay would hand back those of the
        capture, of the bucket's rows."""
        extra = [k for k, v in out.items() if k not in ("logits", "cache", "past_key_values") and holds_tensor(v)]
        if extra:
            self._decline(bucket, f"its forward returns {', '.join(extra)} besides the logits")

    def _decline(self, bucket: int, reason: str) -> None:
        """Run the model's decode steps eagerly from now on (until it changes), for ``reason``; raises
        :class:`CaptureRefused`."""
        self.graphs.pop(bucket, None)
        self.uncapturable = reason
        model = self.model
        name = type(model).__name__ if model is not None else "the model"
        logger.info("%s: %s, so its decode steps run eagerly", name, reason)
        raise CaptureRefused(f"{name} (bucket {bucket}): {reason}")

    def _capture(self, bucket: int, cache, kwargs: dict, state):
        import time

        start = time.perf_counter()
        model = self.model
        self._note_layout(model)
        if has_caller_hooks(model):
            # a hook of the caller's would run at the capture only, shown the bucket's padded rows, and what it
            # records would be overwritten by later replays; stock runs it at every step on the batch's rows
            self._decline(bucket, "forward hooks of the caller's run in its forward")
        gstep = GraphStep(self.workspace, bucket, self.pool.req_to_token.table)
        if not self.use_cuda_graphs:
            logger.debug("decode runner: bucket %d ready (eager stand-in)", bucket)
            return None, None, gstep
        import gc

        from .attention import on_device

        # a PagedCache collected mid-capture would free its table rows with host-to-device copies, which break
        # the capture (or land in the graph): no garbage collection until the graph is captured
        collecting = gc.isenabled()
        gc.disable()
        interrupted = None
        # on the pool's device, also when another one is current (a model on cuda:1): the streams below must be the
        # ones its kernels run on (a replay sets the device it was captured on by itself)
        try:
            with on_device(self.device):
                before = torch.cuda.current_stream()
                try:
                    graph, static_out, interrupted = self._warm_up_and_capture(bucket, cache, kwargs, state, gstep,
                                                                               before)
                except BaseException:  # (a Ctrl-C as a stream context ends, before it set the caller's stream back)
                    torch.cuda.set_stream(before)
                    raise
                if interrupted is not None:  # ending the capture failed on it: no refusal of CUDA's
                    # raised outside the handler: its context would be CUDA's error, whose traceback holds the
                    # frame that ended the capture, which holds the interrupt: a cycle keeping the model and pool
                    torch.cuda.set_stream(before)
                    raise interrupted
        finally:
            interrupted = None  # (held by the traceback's frame, it would make a cycle keeping the model and pool)
            if collecting:
                gc.enable()
        self.capture_seconds[bucket] = time.perf_counter() - start
        logger.info("decode runner: captured bucket %d in %.3f s", bucket, self.capture_seconds[bucket])
        return graph, static_out, gstep

    def _warm_up_and_capture(self, bucket: int, cache, kwargs: dict, state, gstep, before):
        """A warm-up forward on a side stream, then the capture: ``(graph, static outputs, interrupt)``, the last a
        Ctrl-C (or SystemExit) that stopped the capture, for the caller to raise once CUDA's error is handled."""
        side = torch.cuda.Stream()
        side.wait_stream(before)
        with torch.cuda.stream(side):  # warm-up outside the graph (allocator, cuBLAS handles)
            warm = self._forward(bucket, cache, kwargs, state, gstep)
        before.wait_stream(side)
        self._check_outputs(warm, bucket)
        if self._mempool is None:
            self._mempool = torch.cuda.graph_pool_handle()
        if self._capture_stream is None:
            # (torch's default capture stream is one per process, made on the device current at the first
            # capture: a model on another device would capture nothing on it, its kernels launched eagerly)
            self._capture_stream = torch.cuda.Stream()
        graph, static_out, interrupted = torch.cuda.CUDAGraph(), None, None
        try:
            # thread_local: a CUDA call another thread makes meanwhile (a model on a pool of its own, in its own
            # generate()) neither fails nor breaks this capture (as torch.compile's graphs capture)
            with torch.cuda.graph(graph, pool=self._mempool, stream=self._capture_stream,
                                  capture_error_mode="thread_local"):
                try:
                    static_out = self._forward(bucket, cache, kwargs, state, gstep)
                except BaseException as inner:
                    if not isinstance(inner, Exception):  # Ctrl-C, SystemExit: the caller's
                        interrupted = inner
                    raise
            for name in ("cache", "past_key_values"):  # (each replay hands back the step's own cache; the
                if static_out.get(name) is not None:  # capture's would keep its pool alive)
                    static_out[name] = None
        except RuntimeError as e:  # (torch's AcceleratorError is one too)
            if interrupted is None:
                self._refused(bucket, e, before)
        try:
            return graph, static_out, interrupted
        finally:
            interrupted = None  # (held by the traceback's frame, it would make a cycle keeping the model and pool)

    def _note_layout(self, model) -> None:
        """Take what the graphs hold fixed (checked by :meth:`still_fits` before later calls) at the first capture,
        and drop the graphs captured when the model changed since, inside a call (a hook added within a loop of
        one's own): those are stale now, and the one about to be captured is once the change is undone.

        Either way the pool looks at the model again first, and the layout is paired with the stamp of that look.
        The pool's check before the call's first step ran before such a change: paired with its stamp, the layout
        would match again once the change is undone, and a graph captured with the change would be replayed
        without it. The look also drops the prefixes the change made stale."""
        if self._layout is not None and self._layout[0].matches(model):
            return
        if self._layout is not None:
            logger.info("decode runner: the model changed since its graphs were captured; dropping %d of them",
                        len(self.graphs))
            self.graphs = {}
        self.pool.check_weights(model)
        self._layout = ModelLayout(model), self.pool.weights_stamp

    def _refused(self, bucket: int, error: RuntimeError, stream) -> None:
        """A capture CUDA refused: the model's decode steps run eagerly from now on; raises :class:`CaptureRefused`.

        The warm-up run before the capture succeeded, so the forward itself works: what failed is an operation CUDA
        does not allow on a capturing stream (a read back to the host, such as dynamic RoPE's length check, or a
        synchronisation). torch's ``graph`` context does not leave its capture stream when ending the capture
        fails, so the stream current before it is set again here.
        """
        torch.cuda.set_stream(stream)
        self.graphs.pop(bucket, None)
        model = self.model
        name = type(model).__name__ if model is not None else "the model"
        cause = error  # (ending the capture raises an error of its own, in whose context the refused operation's is)
        while isinstance(cause.__context__, Exception):
            cause = cause.__context__
        self.uncapturable = f"{type(cause).__name__}: {cause}".splitlines()[0]
        logger.log(logging.WARNING if self.warn_refusal else logging.INFO,
                   "%s's decode step cannot be captured as a CUDA graph (%s); its decode steps run eagerly. "
                   "patch(model, cuda_graphs=False) runs them so without trying", name, self.uncapturable)
        raise CaptureRefused(f"capturing the decode step of {name} (bucket {bucket}) failed: "
                             f"{self.uncapturable}") from error

"""The loaded model of a generation artifact: its VM functions, its parameters on the device, TVM's paged
KV cache (one, or two for a model with windowed and global layers) and the runtime's ``vm.builtin.kv_state_*``
handles that add, fork and remove sequences. It runs one call a time; what to call is the scheduler's."""

from __future__ import annotations

import math
from pathlib import Path

from autosched.errors import UsageError
from autosched.tvm_adapter import tensor_view

# Sequence ids of the padding rows of a decode step, far from those of requests (0, 1, 2, ...).
PAD_SEQUENCE_IDS = 1 << 40


def check_kv_pages(kv_pages) -> None:
    """``kv_pages``: a whole number of pages, at least 1 (None: the default)."""
    if isinstance(kv_pages, bool) or not isinstance(kv_pages, int) or kv_pages < 1:
        raise UsageError(f"kv_pages must be a whole number of pages, at least 1 (got {kv_pages!r}); leave it out for "
                         "room for max_batch sequences of max_seq_len tokens")


class Staging:
    """Device tensors that a call's host inputs (token ids, positions, sampling parameters) are copied into,
    kept from call to call and grown as needed. A fresh TVM tensor per call would cost a ``cudaMalloc``, and
    dropping it a ``cudaFree``, which waits for all the work queued on the GPU: the step just launched, before
    the host could launch the sampling after it."""

    def __init__(self, device, uploads=None):
        self.device = device
        self._buffers: dict[tuple[str, str], object] = {}
        self._uploads = uploads  # a function giving a cuda_events.PinnedUploads, or None (see put's wait)

    def empty(self, name: str, shape: tuple, dtype):
        """A device tensor of ``shape`` and ``dtype``: a view of the buffer kept for ``name``, grown as needed;
        valid until the next call for ``name``."""
        import numpy as np
        import tvm

        dtype = np.dtype(dtype)
        key, size = (name, dtype.str), math.prod(shape)
        base = self._buffers.get(key)
        if base is None or base.shape[0] < size:
            grown = max(size, 2 * (base.shape[0] if base is not None else 0), 64)
            base = self._buffers[key] = tvm.runtime.empty((grown,), dtype, self.device)
        return tensor_view(base, shape)

    def put(self, name: str, array, wait: bool = True):
        """``array`` (numpy) on the device, in the buffer kept for ``name``: valid until the next ``put`` of
        ``name``. The copy waits for the work queued before it, as TVM's copies do; ``wait=False``: it is queued
        behind that work and the host goes on (on a GPU with its driver: :class:`~.cuda_events.PinnedUploads`),
        for an input of work queued behind a step still running."""
        import numpy as np

        array = np.ascontiguousarray(array)
        view = self.empty(name, array.shape, array.dtype)
        uploads = None if wait or self._uploads is None else self._uploads()
        if uploads is not None:
            uploads.upload(array, view)
        else:
            view.copyfrom(array)
        return view


class LoadedModel:
    """A generation artifact's functions, parameters and KV cache, on ``device``."""

    def __init__(self, vm, params: list, manifest: dict, device, kv_pages: int | None = None):
        import tvm

        from autosched.target import use_all_cpu_threads
        from autosched.tvm_adapter import kv_cache_runtime

        if kv_pages is not None:
            check_kv_pages(kv_pages)
        m = manifest
        if m["target"]["kind"] == "llvm":
            use_all_cpu_threads()  # as the kernels were tuned and timed; before the first kernel runs
        self.manifest, self.vm, self.device = m, vm, device
        self.on_gpu = m["target"]["kind"] == "cuda"
        # One TVM array of the parameters, made once: a Python list would be converted at every call.
        self.params = tvm.runtime.convert(list(params))
        self.vocab = m["decoder"]["vocab"]
        self.max_seq_len, self.max_batch, self.page_size = m["max_seq_len"], m["max_batch"], m["page_size"]
        self.eos_token_ids = frozenset(m.get("eos_token_ids", []))
        self.decode_batches = frozenset(m.get("decode_batches", []))
        self.prefill_chunks = tuple(m.get("prefill_chunks", []))
        # Proposal counts k whose speculative verification has static functions (build --speculate).
        self.static_proposals = frozenset(m.get("speculate", []))
        # Decode functions that wait for the step before inside the call (barrier.py); older builds: before it.
        self.step_barrier = bool(m.get("step_barrier"))
        self._marks = None  # TokenMarks, made at the first use on a GPU (after TVM made the CUDA context current)
        # Phi-3's longrope: transformers re-reads a sequence with the long factors when it grows past the
        # original context (Phi3ForCausalLM.prepare_inputs_for_generation drops the cache then).
        scaling = m["decoder"].get("rope_scaling") or {}
        self.rope_switch = scaling.get("original_max_position_embeddings") if scaling.get("rope_type") == "longrope" else None
        # A model with a sliding window: its windowed layers attend over the window (TVM's sliding layers, whose
        # prefill calls take up to a window of a sequence's tokens). Builds from before them kept each sequence's
        # window - 1 tokens before the newest (TVM's per-sequence window), exact only a token a call past it.
        self.window = m["decoder"].get("sliding_window") or 0
        self.window_chunk = max(1, min(m.get("window_chunk") or 1, self.window or 1))
        self._window_per_sequence = bool(self.window) and not m.get("window_chunk")
        pages_per_seq = -(-self.max_seq_len // self.page_size)
        self.kv_pages = kv_pages or pages_per_seq * self.max_batch
        shape = self._shape = tvm.runtime.ShapeTuple
        # Room for the padding rows of a decode step beside max_batch live sequences.
        seqs = self.max_batch + max(self.decode_batches, default=1) - 1
        decoder = m["decoder"]
        layers = decoder.get("sliding_layers") or []
        two = bool(self.window) and 0 < len(layers) < decoder["layers"]
        # The cache's scratch space holds one prefill call: a prompt, or a static chunk of packed prompts.
        prefill_tokens = max((self.max_seq_len, *self.prefill_chunks))
        sizes = (shape([seqs]), shape([self.kv_pages * self.page_size]), shape([prefill_tokens]), shape([self.page_size]))
        # TVM's per-sequence window support (older builds): it also has the kernels rotate q and k (RoPE inline);
        # the sliding layers of newer builds need neither, the cache rotating q and k as it appends them.
        per_sequence = int(self._window_per_sequence)
        self.caches = [vm["create_paged_kv_cache"](*sizes, shape([per_sequence if not two else 0]))]
        if two:  # windowed and global layers: a cache for each (the windowed one second), driven together
            self.caches.append(vm["create_window_cache"](*sizes, shape([per_sequence])))
        runtime = kv_cache_runtime()

        def each(role):  # the runtime function, on every cache
            function = runtime[role]
            return lambda *args: [function(cache, *args) for cache in self.caches][0]

        self._add, self._fork, self.remove = each("add_sequence"), each("fork_sequence"), each("remove_sequence")
        self._begin, self._end, self.popn = each("begin_forward"), each("end_forward"), each("popn")
        self._clear = each("clear")
        self._free_pages = runtime["free_pages"]  # of the main cache
        self._enable_window = runtime["enable_sliding_window"]
        self._pad_ids: list[int] = []
        self._uploads = None  # PinnedUploads, made at the first use on a GPU (as _marks)
        self.staging = Staging(device, self.pinned_uploads)
        self._functions: dict[str, object] = {}
        self.total_pages = self.free_pages()  # TVM's cache has a page more than asked for
        self.sample_tokens = self.function("sample_tokens")
        self.greedy_tokens = self.function("greedy_tokens")

    @classmethod
    def load(cls, artifact_dir: str | Path, kv_pages: int | None = None) -> LoadedModel:
        """The model of a ``build --generate`` artifact, read with TVM's runtime alone."""
        from tvm import relax

        from autosched.artifact import load_generation_artifact

        if kv_pages is not None:
            check_kv_pages(kv_pages)
        executable, params, manifest, device = load_generation_artifact(artifact_dir)
        return cls(relax.VirtualMachine(executable, device), params, manifest, device, kv_pages)

    def function(self, name: str):
        """The artifact's function ``name``, or None where an older build lacks it."""
        try:
            return self.vm[name]
        except (AttributeError, KeyError, RuntimeError):
            return None

    # ---- the cache's sequences ---------------------------------------------------------------------

    def add(self, seq_id: int, parent: int | None = None, fork_at: int = -1) -> None:
        """A new sequence: empty, or forked from ``parent``'s first ``fork_at`` tokens (-1: all of them), whose
        pages it shares."""
        if parent is not None:
            self._fork(parent, seq_id, fork_at)
            return
        self._add(seq_id)
        if self._window_per_sequence:  # on the windowed cache (the last); it counts the tokens before the newest
            self._enable_window(self.caches[-1], seq_id, self.window - 1, 0)

    def clear(self) -> None:
        """Every sequence out of the cache, every page free: a clean cache after a call that failed midway."""
        self._clear()
        self._pad_ids = []

    def token_marks(self):
        """CUDA events after decode steps' tokens (:class:`~.cuda_events.TokenMarks`); None on the CPU or
        without a CUDA driver, where waiting for a step means waiting for everything queued."""
        if self._marks is None and self.on_gpu:
            from .cuda_events import TokenMarks

            self._marks = TokenMarks.open() or False
        return self._marks or None

    def pinned_uploads(self):
        """Copies to the device that do not wait for the work queued (:class:`~.cuda_events.PinnedUploads`); None
        on the CPU or without a CUDA driver."""
        if self._uploads is None and self.on_gpu:
            from .cuda_events import PinnedUploads

            self._uploads = PinnedUploads.open() or False
        return self._uploads or None

    def free_pages(self) -> int:
        return int(self._free_pages(self.caches[0]))

    def padding_ids(self, pads: int) -> list[int]:
        """The ids of ``pads`` empty sequences for padding rows (added to the cache once, kept empty)."""
        while len(self._pad_ids) < pads:
            self._pad_ids.append(PAD_SEQUENCE_IDS + len(self._pad_ids))
            self._add(self._pad_ids[-1])
        return self._pad_ids[:pads]

    # ---- one call ----------------------------------------------------------------------------------

    def forward(self, function: str, seq_ids: list[int], lengths: list[int], ids, prefill: bool,
                every_position: bool = False, logit_positions=None, wait=None):
        """Run ``function`` over ``ids`` (the tokens of ``seq_ids``, ``lengths`` each, packed; host ids, or a
        device tensor of them); returns the logits on the device (one row per sequence: the last token's; a
        prefill's rows at ``logit_positions`` of the packed tokens where given, as an evaluation reads them;
        with ``every_position``, a row for every token fed, as a speculative step's verification reads them).
        ``wait``: what a decode function's barrier calls before the step reads the cache, to wait there for the
        step before (:mod:`.barrier`)."""
        import numpy as np

        from .barrier import BARRIER

        self._begin(self._shape(seq_ids), self._shape(lengths))
        on_device = hasattr(ids, "numpy") and not isinstance(ids, np.ndarray)
        input_ids = ids if on_device else self.staging.put("ids", np.asarray(ids, dtype="int32"))
        if wait is not None:
            BARRIER.queue(wait)
        call = self._functions.get(function)
        if call is None:
            call = self._functions[function] = self.vm[function]
        if prefill:
            if logit_positions is not None:
                positions = logit_positions
            elif every_position:
                positions = np.arange(len(ids), dtype="int32")
            else:
                positions = np.cumsum(lengths, dtype="int32") - 1
            last = self.staging.put("positions", np.asarray(positions, dtype="int32"))
            logits, *self.caches = call(input_ids, last, *self.caches, self.params)
        else:
            logits, *self.caches = call(input_ids, *self.caches, self.params)
        self._end()
        return logits


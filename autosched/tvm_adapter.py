"""Every private or fragile TVM (and torch) API autosched relies on, in one module.

Each function here names what it needs from TVM 0.27 (or torch) and hides how it is obtained: a private
module, function or attribute, a constructor called through the FFI, a schedule-state edit, a method of TVM's
replaced in a subclass or for the length of a block. ``tests/test_tvm_adapter.py`` pins the behaviour of
each, so a TVM upgrade that changes one fails there first, and is a change to this file.
"""

from __future__ import annotations

import _imp
import contextlib
import inspect
import json
import os
import subprocess
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from tvm import s_tir
    from tvm.s_tir.schedule import SBlockRV

# Deferred imports: tvm, torch (imported where used: `autosched --help` stays fast).

# Pass options that split a loop's last, guarded iteration off (conditions wrapped in ``likely``), so the
# rest runs without the guard; the rows space needs them to keep a row's tail vectorised.
LOOP_PARTITION = {"s_tir.LoopPartition": {"partition_const_loop": True}}


def cache_frozen_frame_lookups() -> None:
    """Make TVMScript's parsing under an import cheap: TVMScript calls ``inspect.stack()`` for each function
    it parses, and for each frame of Python's import machinery (``<frozen importlib._bootstrap>``, a file
    that does not exist) ``inspect.getmodule`` scans all of ``sys.modules`` and finds nothing. Importing
    TVM's tensor intrinsics (hundreds of functions, which dlight's matmul rule imports on first use) runs that
    scan for every frame of every function parsed, over every module loaded (all of torch's, where torch is): the
    longer the more is loaded. The scan's answer, no module, is cached here up front:
    ``getmodule`` returns the same None, without the scan."""
    try:  # every frozen module's frame file name, e.g. <frozen importlib._bootstrap>, <frozen runpy>
        filenames = {_imp.get_frozen_object(name).co_filename for name in _imp._frozen_module_names()}
    except (AttributeError, ImportError):  # not CPython 3.11+: the import machinery's two
        filenames = {"<frozen importlib._bootstrap>", "<frozen importlib._bootstrap_external>"}
    for filename in filenames:
        inspect.modulesbyfile.setdefault(filename, filename)  # a module name that is never in sys.modules


def block_realize(sch: s_tir.Schedule, block: SBlockRV):
    """The ``SBlockRealize`` of ``block``: its iterator bindings and its predicate (dlight's helper)."""
    from tvm.s_tir.dlight.analysis.common_analysis import get_sblockrealize

    return get_sblockrealize(sch, block)


def set_block_predicate(sch: s_tir.Schedule, block: SBlockRV, predicate: Any) -> bool:
    """Replace the predicate of ``block`` in place; False, and nothing changed, unless the block is the only
    statement of its innermost loop. No schedule primitive sets a predicate; this edits the schedule state
    (``ScheduleState.replace``), keeping the block, so its handles stay valid."""
    from tvm import s_tir, tirx

    loops = sch.get_loops(block)
    if not loops:
        return False
    loop = sch.get(loops[-1])
    realize = loop.body
    if not isinstance(realize, s_tir.SBlockRealize):
        return False
    guarded = s_tir.SBlockRealize(realize.iter_values, predicate, realize.block)
    new_loop = tirx.For(loop.loop_var, loop.min, loop.extent, loop.kind, guarded, loop.thread_binding, loop.annotations)
    sch.state.replace(sch.get_sref(loops[-1]), new_loop, {realize.block: realize.block})
    return True


def feature_tune_context(tvm_target: Any):
    """A MetaSchedule ``TuneContext`` that carries only ``tvm_target``, for its feature extractor.

    ``TuneContext.__init__`` imports ``tvm.s_tir.tensor_intrin``, which parses hundreds of TVMScript
    intrinsics the feature extractor never uses; the FFI constructor, with its
    8 positional arguments (mod, target, space generator, search strategy, task name, threads, seed,
    logger), does not.
    """
    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.meta_schedule import _ffi_api

    ctx = ms.TuneContext.__new__(ms.TuneContext)
    ctx.__init_handle_by_constructor__(_ffi_api.TuneContext, None, tvm_target, None, None, "main", 1, -1, None)
    return ctx


def llm_prefill_kernels():
    """TVM's private module of LLM KV-cache kernel builders (``relax.frontend.nn.llm._kernel_common``), whose
    prefill macros and tile rules the FlashAttention template space uses."""
    from tvm.relax.frontend.nn.llm import _kernel_common

    return _kernel_common


def register_llvm_lowering(op_name: str, lower: Callable, level: int = 99) -> None:
    """Lower ``op_name`` with ``lower`` on every LLVM target compiled after this, process-wide."""
    from tvm import tirx

    tirx.register_intrin_lowering(op_name, target="llvm", f=lower, level=level)


def convert_attention_as_tvm_does(importer: Any, node: Any) -> Any:
    """TVM's own conversion of ``scaled_dot_product_attention`` (a method of the exported-program
    importer): what our attention converter hands over the forms it does not take (dropout, 2-D)."""
    return importer._scaled_dot_product_attention(node)


def convert_layer_norm_as_tvm_does(importer: Any, node: Any) -> Any:
    """TVM's own conversion of ``aten.native_layer_norm`` (a private method of the exported-program
    importer), which our RMSNorm/LayerNorm converter falls back on."""
    return importer._native_layer_norm(node)


# ---- relax.frontend.nn: its tensors, and TVM's paged KV cache -------------------------------------
def relax_expr(tensor: Any) -> Any:
    """The Relax expression behind an ``nn.Tensor`` (its private ``_expr``), for Relax ops ``nn.op`` lacks."""
    return tensor._expr


def nn_tensor(expr: Any, name: str) -> Any:
    """An ``nn.Tensor`` of a Relax expression, named ``name`` in the emitted module (``nn.op.wrap_nested``)."""
    from tvm.relax.frontend.nn import op

    return op.wrap_nested(expr, name)


def tir_paged_kv_cache(*, layers: int, heads: int, kv_heads: int, head_dim: int, dtype: str, target: Any,
                       sizes: tuple, rope_mode: str, rope_scale: float, rope_theta: float, rope_scaling: dict,
                       rotary_dim: int, window: int = 0) -> Any:
    """TVM's paged KV cache with its TIR attention kernels (``TIRPagedKVCache``) over ``layers`` layers of
    multi-head attention with equal q/k and v head dims. ``sizes``: (max batch, max total tokens, prefill
    chunk, page size, sliding window support), the creation function's arguments; ``rope_mode``: "none"
    (q and k arrive rotated, or the model has no RoPE), "normal" (the cache rotates k as it appends), or
    "inline" (the attention kernels rotate). ``window`` > 0: every layer attends over that window (TVM's
    "mha_sliding" layers: decode reads a sequence's last ``window`` keys, and a prefill call's query ``r``
    tokens in sees the last ``window - r - 1`` cached keys beside the call's own, so a call of up to ``window``
    tokens is exact wherever it starts; the cache keeps the whole sequence). Such a cache has one plain layer
    more, which no model layer uses: TVM 0.27's runtime allocates a cache's attention scratch only where one of
    its layers is plain ("mha"), and fails a prefill call of a cache without one."""
    from tvm import relax as rx
    from tvm.relax.frontend.nn.llm.kv_cache import RopeMode, TIRPagedKVCache

    max_batch_size, max_total_seq_len, prefill_chunk_size, page_size, support_sliding_window = sizes
    kinds = ["mha_sliding"] * layers + ["mha"] if window else "mha"
    layers += 1 if window else 0
    cache = TIRPagedKVCache(
        attn_kind=kinds, max_batch_size=max_batch_size, max_total_seq_len=max_total_seq_len,
        prefill_chunk_size=prefill_chunk_size, page_size=page_size, support_sliding_window=support_sliding_window,
        layer_partition=rx.ShapeExpr([0, layers]), num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, qk_head_dim=head_dim, v_head_dim=head_dim, mla_original_qk_head_dim=0,
        mla_original_v_head_dim=0, rope_mode={"none": RopeMode.NONE, "normal": RopeMode.NORMAL,
                                              "inline": RopeMode.INLINE}[rope_mode],
        rope_scale=rope_scale, rope_theta=rope_theta, rope_scaling=rope_scaling, rope_ext_factors=rx.prim_value(0),
        rotary_dim=rotary_dim, enable_disaggregation=False, dtype=dtype, target=target,
        **({"layer_sliding_window_size": window} if window else {}))
    # What TVM bakes into its merge and split-and-rotate kernels (the merge's buffers leave heads and head dim
    # symbolic), on those kernels: what a kernel of ours in their place needs (``attention.dispatch_attention``).
    builder = rx.BlockBuilder.current()
    create = builder.lookup_binding(cache._expr)  # the creation call
    merge, split_rotary = create.args[MERGE_ARG].fields[0], create.args[SPLIT_ROTARY_ARG]
    for func, facts in ((merge, {"h": heads, "d": head_dim}),
                        (split_rotary, {"theta": float(rope_theta), "scale": float(rope_scale),
                                        "rotary_dim": int(rotary_dim), "scaling": dict(rope_scaling)})):
        builder.update_func(func, builder.get()[func].with_attr(FACTS_ATTR, json.dumps(facts)))
    return cache


KV_CACHE_CREATE = "vm.builtin.paged_attention_kv_cache_create"  # the call TIRPagedKVCache emits
ROPE_MODE_ARG = 9  # where the RopeMode is among that call's arguments (0: the builtin's name)
MERGE_ARG = 24  # where its merge kernels are (a tuple; the runtime's ``args[23]``, ``f_merge_inplace``)
SPLIT_ROTARY_ARG = 25  # where its q/k/v split with RoPE is (the runtime's ``args[24]``, ``f_split_rotary``)
FACTS_ATTR = "autosched.facts"  # what those two PrimFuncs compute for (JSON)


def _kv_cache_creations(mod: Any) -> list:
    """Every paged-KV-cache creation call in ``mod``'s Relax functions."""
    from tvm import relax

    calls = []

    def visit(expr):
        if isinstance(expr, relax.Call) and len(expr.args) > ROPE_MODE_ARG and \
                isinstance(expr.args[0], relax.ExternFunc) and expr.args[0].global_symbol == KV_CACHE_CREATE:
            calls.append(expr)

    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, visit)
    return calls


def kv_cache_rope_modes(mod: Any) -> set[int]:
    """The RopeMode (0 none, 1 normal, 2 inline) of every paged-KV-cache creation call in ``mod``'s Relax
    functions, read from the call's arguments by position; -1 for one that is not a constant."""
    modes = set()
    for call in _kv_cache_creations(mod):
        value = getattr(call.args[ROPE_MODE_ARG], "value", None)  # an integer immediate
        modes.add(value if isinstance(value, int) else -1)
    return modes


def kv_cache_kernels(mod: Any, arg: int) -> list[str]:
    """The global names of the PrimFuncs every paged-KV-cache creation call in ``mod`` passes as argument
    ``arg`` (``MERGE_ARG``'s tuple: its fields), in the order of the calls, each name once."""
    import tvm

    names: list[str] = []
    for call in _kv_cache_creations(mod):
        value = call.args[arg]
        for field in getattr(value, "fields", [value]):
            if isinstance(field, tvm.ir.GlobalVar) and field.name_hint not in names:
                names.append(field.name_hint)
    return names


# The runtime functions that drive a paged KV cache, by the names the VM registers them under.
KV_CACHE_RUNTIME = {
    "add_sequence": "vm.builtin.kv_state_add_sequence",
    "fork_sequence": "vm.builtin.kv_state_fork_sequence",
    "remove_sequence": "vm.builtin.kv_state_remove_sequence",
    "begin_forward": "vm.builtin.kv_state_begin_forward",
    "end_forward": "vm.builtin.kv_state_end_forward",
    "popn": "vm.builtin.kv_state_popn",
    "clear": "vm.builtin.kv_state_clear",
    "free_pages": "vm.builtin.attention_kv_cache_get_num_available_pages",
    "enable_sliding_window": "vm.builtin.attention_kv_cache_enable_sliding_window_for_seq",
}


def kv_cache_runtime() -> dict[str, Callable]:
    """The runtime functions of :data:`KV_CACHE_RUNTIME`, each taking the cache object first."""
    import tvm

    return {role: tvm.get_global_func(name) for role, name in KV_CACHE_RUNTIME.items()}


# ---- TVM's worker processes (``tvm.support.popen_pool``): started with variables of ours, killed by pid ------
_ENVIRON_LOCK = threading.Lock()


def popen_worker(initializer=None, initargs: tuple = (), env: dict[str, str] | None = None, **kwargs) -> Any:
    """TVM's ``PopenWorker``, whose process starts (and restarts) with ``env`` added to its environment.

    Variables the CUDA driver reads must be there from the start: it initialises while TVM imports, before any
    initializer runs (seen on a two-H200 host: a runner that set ``CUDA_VISIBLE_DEVICES=1`` in its initializer
    still measured on GPU 0). ``PopenWorker`` passes no environment of its own: its private ``_start`` spawns the
    process, which inherits ours; ours is set around that spawn alone, under a lock, and put back."""
    from tvm.support.popen_pool import PopenWorker

    if not env:
        return PopenWorker(initializer, initargs, **kwargs)

    class _Worker(PopenWorker):
        def _start(self):
            with _ENVIRON_LOCK:
                saved = {k: os.environ.get(k) for k in env}
                os.environ.update(env)
                try:
                    super()._start()
                finally:
                    for k, v in saved.items():
                        if v is None:
                            os.environ.pop(k, None)
                        else:
                            os.environ[k] = v

    return _Worker(initializer, initargs, **kwargs)


def popen_pool(workers: int, timeout: float | None, initializer=None, env: dict[str, str] | None = None,
               stdout=None, stderr=None) -> Any:
    """TVM's ``PopenPoolExecutor`` whose workers are :func:`popen_worker`'s, started with ``env``. The pool makes
    one worker for each of its threads in its private ``_worker_run`` (its ``_worker_map``, under its ``_lock``,
    from the settings it keeps in ``_initializer``, ``_initargs``, ``_maximum_process_uses``, ``_stdout``,
    ``_stderr`` and ``_timeout``): here that method, with the worker made by :func:`popen_worker`."""
    from tvm.support.popen_pool import PopenPoolExecutor

    class _Pool(PopenPoolExecutor):
        def _worker_run(self, fn, args, kwargs):
            with self._lock:
                tid = threading.get_ident()
                if tid not in self._worker_map:
                    self._worker_map[tid] = popen_worker(self._initializer, self._initargs, env,
                                                         maximum_uses=self._maximum_process_uses,
                                                         stdout=self._stdout, stderr=self._stderr)
                worker = self._worker_map[tid]
            worker.send(fn, args, kwargs, self._timeout)
            return worker.recv()

    return _Pool(workers, timeout=timeout, initializer=initializer, stdout=stdout, stderr=stderr)


def worker_process(worker: Any) -> subprocess.Popen | None:
    """The process of a TVM ``PopenWorker`` (its private ``_proc``): None before its first task and after it was
    killed. To kill a worker by its pid where its own ``kill`` would block, closing pipes a reader holds."""
    return worker._proc


def rpc_server_process(server: Any) -> subprocess.Popen:
    """The process of a ``tvm.rpc.Server`` started on this host: the ``PopenWorker`` it runs in (``server.proc``)."""
    return worker_process(server.proc)


# ---- TVM's Relax block builder, runtime tensors and dlight -------------------------------------------------------
@contextlib.contextmanager
def suffixed_functions(suffix: str) -> Iterator[None]:
    """Inside: every function added to a Relax ``BlockBuilder`` (``BlockBuilder.add_func``) is added under its
    name plus ``suffix``, and a PrimFunc's ``global_symbol`` gets the suffix too. TVM's paged KV cache adds its
    kernels under fixed names and symbols, which a second cache in one module would reuse. The method is
    replaced on the class, process-wide, until the block ends: one thread builds at a time."""
    from tvm import relax

    add_func = relax.BlockBuilder.add_func

    def renamed(builder, func, name):
        symbol = func.attrs.get("global_symbol") if getattr(func, "attrs", None) else None
        if symbol is not None:
            func = func.with_attr("global_symbol", f"{symbol}{suffix}")
        return add_func(builder, func, f"{name}{suffix}")

    relax.BlockBuilder.add_func = renamed
    try:
        yield
    finally:
        relax.BlockBuilder.add_func = add_func


def tensor_view(tensor: Any, shape: tuple) -> Any:
    """A view of the first elements of the runtime tensor ``tensor`` as ``shape``, sharing its memory (its
    private ``_create_view``): one allocation serves inputs of every size up to its own."""
    return tensor._create_view(shape)


def is_one(expr: Any) -> bool:
    """Whether ``expr`` is the integer 1, as dlight's matmul rule tests an extent (``dlight.gpu.matmul._is_one``)."""
    from tvm.s_tir.dlight.gpu import matmul

    return matmul._is_one(expr)


def gpu_sleep(cycles: int) -> None:
    """Keep the current CUDA stream busy for about ``cycles`` GPU clock cycles (torch's private ``_sleep``)."""
    import torch

    torch.cuda._sleep(cycles)

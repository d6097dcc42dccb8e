"""The TVM behaviours autosched/tvm_adapter.py relies on, pinned: a TVM upgrade that changes one fails here."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import s_tir, te, tirx

from autosched import tvm_adapter


def _rows(n: int = 20):
    """A row sum: S[i] = sum_k X[i, k], then Y[i, j] = X[i, j] / S[i]."""
    x = te.placeholder((4, n), "float32", name="X")
    k = te.reduce_axis((0, n), name="k")
    s = te.compute((4,), lambda i: te.sum(x[i, k], axis=k), name="S")
    y = te.compute((4, n), lambda i, j: x[i, j] / s[i], name="Y")
    return te.create_prim_func([x, y])


def test_block_realize_gives_the_guard_of_a_non_dividing_split():
    sch = s_tir.Schedule(_rows())
    block = sch.get_sblock("S")
    sch.split(sch.get_loops(block)[-1], [None, 8])
    realize = tvm_adapter.block_realize(sch, block)
    assert isinstance(realize, s_tir.SBlockRealize)
    assert not isinstance(realize.predicate, tirx.IntImm)  # k_0 * 8 + k_1 < 20
    assert len(realize.iter_values) == 2


def test_compute_at_drops_the_guard_of_an_rfactor_block():
    """The TVM 0.27 behaviour the rows space works around (search_spaces/rows.py, guard_row_tail): if this
    fails, compute_at keeps the guard and the workaround can go."""
    sch = s_tir.Schedule(_rows())
    block = sch.get_sblock("S")
    _, lane = sch.split(sch.get_loops(block)[-1], [None, 8])
    rf = sch.rfactor(lane, factor_axis=1)
    assert not isinstance(tvm_adapter.block_realize(sch, rf).predicate, tirx.IntImm)
    row = sch.get_loops(sch.get_sblock("Y"))[0]
    sch.compute_at(sch.get_sblock("S"), row)
    sch.compute_at(rf, sch.get_loops(sch.get_sblock("S"))[0])
    assert isinstance(tvm_adapter.block_realize(sch, rf).predicate, tirx.IntImm)


def test_set_block_predicate_guards_the_block_and_keeps_the_schedule_usable():
    sch = s_tir.Schedule(_rows())
    block = sch.get_sblock("Y")
    _, lane = sch.split(sch.get_loops(block)[-1], [None, 8])
    predicate = tvm_adapter.block_realize(sch, block).predicate
    assert tvm_adapter.set_block_predicate(sch, block, tirx.likely(predicate))
    assert "T.likely" in sch.mod.script()
    sch.vectorize(lane)  # the block handle still works after the state edit
    with tvm.transform.PassContext(opt_level=3, config=tvm_adapter.LOOP_PARTITION):
        lib = tvm.compile(sch.mod, target={"kind": "llvm"})
    x = np.random.default_rng(0).standard_normal((4, 20)).astype("float32")
    y = tvm.runtime.tensor(np.zeros((4, 20), "float32"))
    lib(tvm.runtime.tensor(x), y)
    np.testing.assert_allclose(y.numpy(), x / x.sum(1, keepdims=True), rtol=1e-5)
    # A block that is not the only statement of its innermost loop is left alone.
    sch = s_tir.Schedule(_rows())
    assert not tvm_adapter.set_block_predicate(sch, sch.get_sblock("root"), tirx.const(True, "bool"))


def test_loop_partition_option_exists():
    configs = tvm.transform.PassContext.list_configs()
    assert "s_tir.LoopPartition" in configs


def test_feature_tune_context_serves_metaschedule_features(cpu_target):
    from tvm.s_tir import meta_schedule as ms

    ctx = tvm_adapter.feature_tune_context(cpu_target.tvm_target())
    mod = tvm.IRModule({"main": _rows()})
    candidate = ms.MeasureCandidate(s_tir.Schedule(mod), [])
    features = ms.feature_extractor.PerStoreFeature().extract_from(ctx, [candidate])
    assert len(features) == 1 and features[0].numpy().shape[1] == 164
    assert tvm_ffi.structural_equal(ctx.target, cpu_target.tvm_target())


def test_llm_prefill_kernels_offer_what_the_attention_template_uses():
    kernels = tvm_adapter.llm_prefill_kernels()
    for name in ("_is_prefill_kernel_config_legal", "_make_prefill_macros", "_alloc_mha_qkvo_buffers",
                 "_alloc_softmax_state_buffers", "_get_prefill_load_config", "_get_prefill_tile_size",
                 "_get_prefill_vector_size"):
        assert callable(getattr(kernels, name)), name
    assert len(kernels._make_prefill_macros(64, 64, 32, 64, 32, 4, 2)) >= 4


def test_register_llvm_lowering_applies_to_later_compiles():
    """The fast exp is registered this way (autosched/fastmath.py): after it, the LLVM code of an exp kernel
    has no call of the llvm.exp intrinsic (one libm call per lane) and still computes exp."""
    from autosched.fastmath import install

    x = te.placeholder((64,), "float32", name="X")
    y = te.compute((64,), lambda i: te.exp(x[i]), name="Y")
    install()
    lib = tvm.tirx.build(te.create_prim_func([x, y]), target="llvm")
    assert "llvm.exp" not in lib.inspect_source("ll")
    a = np.linspace(-20, 20, 64).astype("float32")
    out = tvm.runtime.tensor(np.zeros(64, "float32"))
    lib(tvm.runtime.tensor(a), out)
    np.testing.assert_allclose(out.numpy(), np.exp(a), rtol=1e-6)


def test_tvm_converts_attention_on_two_dimensional_tensors():
    """What our converter hands to TVM's: attention on [seq, dim] tensors becomes one R.nn.attention."""
    import torch
    from tvm.relax.frontend.torch import from_exported_program

    from autosched.pipeline.importer import _attention

    class TwoD(torch.nn.Module):
        def forward(self, q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    x = torch.randn(6, 8)
    exported = torch.export.export(TwoD(), (x, x, x))
    table = {op: fn for op, fn in torch.export.default_decompositions().items() if "scaled_dot" not in str(op)}
    with pytest.warns(UserWarning, match="TVM's own converter"):
        mod = from_exported_program(exported.run_decompositions(table), run_ep_decomposition=False,
                                    custom_convert_map={"scaled_dot_product_attention.default": _attention})
    assert "R.nn.attention" in mod.script()


def test_frozen_frame_lookups_give_the_answer_of_the_scan_they_replace(tmp_path, monkeypatch):
    """inspect.getmodule of an import-machinery frame scans sys.modules and finds nothing; the cached answer
    is that same None, and it covers every such frame an import has."""
    import importlib
    import inspect

    (tmp_path / "_frames_at_import.py").write_text("import inspect\nFRAMES = [f.frame for f in inspect.stack(0)]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    frames = importlib.import_module("_frames_at_import").FRAMES
    frozen = [f for f in frames if f.f_code.co_filename.startswith("<frozen")]
    assert frozen, "an import runs through Python's frozen import machinery"
    uncached = {k: v for k, v in inspect.modulesbyfile.items() if not k.startswith("<frozen")}
    monkeypatch.setattr(inspect, "modulesbyfile", uncached)
    scanned = [inspect.getmodule(f, f.f_code.co_filename) for f in frozen]
    tvm_adapter.cache_frozen_frame_lookups()
    assert {f.f_code.co_filename for f in frozen} <= set(inspect.modulesbyfile)
    assert [inspect.getmodule(f, f.f_code.co_filename) for f in frozen] == scanned == [None] * len(frozen)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_layer_norm_is_converted_by_tvms_own_converter(dtype):
    """Our LayerNorm converter hands the work to TVM's private ``_native_layer_norm`` (a bfloat16 input cast to
    float32 around it): the method must exist and give Relax's layer_norm."""
    import torch

    from autosched.pipeline.importer import import_model
    from autosched.pipeline.load import Model

    module = torch.nn.LayerNorm(8).to(getattr(torch, dtype))
    mod, _ = import_model(Model("layer-norm", module, (torch.randn(2, 8, dtype=getattr(torch, dtype)),)),
                          linear_as_gemm=False)
    text = mod.script()
    assert "R.nn.layer_norm" in text
    assert ('R.astype(' in text) == (dtype == "bfloat16")


def test_nn_tensors_wrap_and_unwrap_relax_expressions():
    from tvm import relax
    from tvm.relax.frontend import nn

    class Take(nn.Module):
        def forward(self, x: nn.Tensor, ids: nn.Tensor):
            expr = relax.op.take(tvm_adapter.relax_expr(x), tvm_adapter.relax_expr(ids), axis=0, mode="clip")
            return tvm_adapter.nn_tensor(expr, "picked")

    mod, _ = Take().export_tvm({"forward": {"x": nn.spec.Tensor([4, 3], "float32"),
                                            "ids": nn.spec.Tensor([2], "int32")}})
    assert 'R.take(x, ids, axis=0, mode="clip")' in mod.script()


@pytest.mark.parametrize("rope_mode, code", [("none", 0), ("normal", 1), ("inline", 2)])
def test_a_paged_kv_cache_is_made_with_the_arguments_we_give(rope_mode, code):
    """TIRPagedKVCache's keyword arguments as tir_paged_kv_cache passes them: a cache of 2 layers exports, its
    creation call carries our theta and dtype, and its rope mode where kv_cache_rope_modes reads it."""
    from tvm.relax.frontend import nn

    class Cache(nn.Module):
        def create(self, max_batch: tirx.Var, total: tirx.Var, chunk: tirx.Var, page: tirx.Var, window: tirx.Var):
            return tvm_adapter.tir_paged_kv_cache(
                layers=2, heads=4, kv_heads=2, head_dim=64, dtype="float16", target=tvm.target.Target("llvm"),
                sizes=(max_batch, total, chunk, page, window), rope_mode=rope_mode, rope_scale=1.0,
                rope_theta=12345.0, rope_scaling={}, rotary_dim=64)

    mod, _ = Cache().export_tvm({"create": {name: int for name in ("max_batch", "total", "chunk", "page", "window")}
                                 | {"$": {"param_mode": "none", "effect_mode": "none"}}})
    text = mod["create"].script()
    assert "vm.builtin.paged_attention_kv_cache_create" in text and "12345" in text and "float16" in text
    assert tvm_adapter.kv_cache_rope_modes(mod) == {code}
    # The merge and split-and-rotate kernels where MERGE_ARG and SPLIT_ROTARY_ARG say, with the facts we attach.
    (merge,) = tvm_adapter.kv_cache_kernels(mod, tvm_adapter.MERGE_ARG)
    (rope,) = tvm_adapter.kv_cache_kernels(mod, tvm_adapter.SPLIT_ROTARY_ARG)
    assert "merge" in merge and "rope" in rope
    assert json.loads(str(mod[merge].attrs[tvm_adapter.FACTS_ATTR])) == {"h": 4, "d": 64}
    assert json.loads(str(mod[rope].attrs[tvm_adapter.FACTS_ATTR])) == {"theta": 12345.0, "scale": 1.0,
                                                                        "rotary_dim": 64, "scaling": {}}


def test_a_windowed_paged_kv_cache_has_sliding_layers_of_our_window():
    """A windowed cache: every layer TVM's "mha_sliding" kind, one plain layer more (TVM 0.27 allocates the
    attention scratch only for a cache with a plain layer), and our window where the runtime reads the layers'
    window size (the sixth size of the creation call)."""
    from tvm.relax.frontend import nn
    from tvm.relax.frontend.nn.llm.kv_cache import AttnKind

    class Cache(nn.Module):
        def create(self, max_batch: tirx.Var, total: tirx.Var, chunk: tirx.Var, page: tirx.Var, window: tirx.Var):
            return tvm_adapter.tir_paged_kv_cache(
                layers=3, heads=4, kv_heads=2, head_dim=64, dtype="float32", target=tvm.target.Target("llvm"),
                sizes=(max_batch, total, chunk, page, window), rope_mode="normal", rope_scale=1.0,
                rope_theta=10000.0, rope_scaling={}, rotary_dim=64, window=37)

    mod, _ = Cache().export_tvm({"create": {name: int for name in ("max_batch", "total", "chunk", "page", "window")}
                                 | {"$": {"param_mode": "none", "effect_mode": "none"}}})
    text = mod["create"].script()
    sliding, plain = int(AttnKind.MHA_SLIDING), int(AttnKind.MHA)
    assert f"R.shape([{sliding}, {sliding}, {sliding}, {plain}])" in text
    assert "window, 37])" in text


def test_the_kv_cache_runtime_functions_exist_by_name():
    functions = tvm_adapter.kv_cache_runtime()
    assert set(functions) == set(tvm_adapter.KV_CACHE_RUNTIME)
    assert all(callable(f) for f in functions.values())


PROBE = "AUTOSCHED_ADAPTER_PROBE"


def test_a_popen_worker_starts_and_restarts_with_our_variables_and_leaves_ours_alone(monkeypatch):
    """``PopenWorker._start`` spawns its process, which inherits our environment (popen_worker sets the variables
    around it); after ``kill`` the next task starts another, with them again. ``_proc`` is the process while
    there is one, None otherwise."""
    import os

    monkeypatch.delenv(PROBE, raising=False)
    worker = tvm_adapter.popen_worker(env={PROBE: "child"})
    try:
        assert tvm_adapter.worker_process(worker) is None
        for _ in range(2):
            worker.send(os.getenv, (PROBE,))
            assert worker.recv() == "child" and PROBE not in os.environ
            process = tvm_adapter.worker_process(worker)
            assert process.pid != os.getpid() and process.poll() is None
            worker.kill()
            assert tvm_adapter.worker_process(worker) is None and process.poll() is not None
    finally:
        worker.kill()


def test_a_popen_pool_makes_its_workers_with_our_variables(monkeypatch):
    """``PopenPoolExecutor._worker_run`` makes a worker per thread from the settings the pool keeps; ours makes
    it with popen_worker: each task sees the variables, and the pool's initializer ran in its worker first."""
    import os

    monkeypatch.delenv(PROBE, raising=False)
    pool = tvm_adapter.popen_pool(2, 60, initializer=os.getpid, env={PROBE: "pool"})
    try:
        assert [f.result() for f in [pool.submit(os.getenv, PROBE) for _ in range(4)]] == ["pool"] * 4
        assert PROBE not in os.environ
    finally:
        pool.shutdown()


def test_an_rpc_servers_process_is_its_popen_workers():
    """``tvm.rpc.Server`` runs in a PopenWorker (``server.proc``): its process, to stop or signal by pid."""
    import os

    from tvm import rpc

    server = rpc.Server("127.0.0.1", port=11300, port_end=11400, silent=True)
    try:
        process = tvm_adapter.rpc_server_process(server)
        assert process.pid != os.getpid() and process.poll() is None
    finally:
        server.terminate()
    assert process.wait(timeout=60) is not None


def test_suffixed_functions_rename_what_a_block_builder_adds_inside_the_block_only():
    """``BlockBuilder.add_func`` replaced for the block: a PrimFunc added inside it takes the suffix in its name
    and its global symbol; one added after it keeps its own."""
    from tvm import relax

    builder = relax.BlockBuilder()
    with tvm_adapter.suffixed_functions("_second"):
        inside = builder.add_func(_rows().with_attr("global_symbol", "rows"), "rows")
    after = builder.add_func(_rows(24).with_attr("global_symbol", "other"), "other")
    mod = builder.get()
    assert inside.name_hint == "rows_second" and str(mod[inside].attrs["global_symbol"]) == "rows_second"
    assert after.name_hint == "other" and str(mod[after].attrs["global_symbol"]) == "other"


def test_a_tensor_view_shares_the_first_elements_of_its_tensor():
    base = tvm.runtime.tensor(np.zeros(64, "float32"))
    view = tvm_adapter.tensor_view(base, (2, 3))
    assert tuple(view.shape) == (2, 3)
    view.copyfrom(np.arange(6, dtype="float32").reshape(2, 3))
    np.testing.assert_array_equal(base.numpy()[:7], [0, 1, 2, 3, 4, 5, 0])


def test_is_one_is_dlights_test_of_a_unit_extent():
    assert tvm_adapter.is_one(tirx.IntImm("int32", 1)) and tvm_adapter.is_one(tirx.IntImm("int64", 1))
    assert not tvm_adapter.is_one(tirx.IntImm("int32", 2)) and not tvm_adapter.is_one(tirx.Var("n", "int32"))


def test_torch_has_the_gpu_sleep_the_kernel_timer_uses():
    import torch

    assert callable(torch.cuda._sleep)


@pytest.mark.gpu
def test_gpu_sleep_keeps_the_stream_busy():
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    tvm_adapter.gpu_sleep(1_000_000)
    end.record()
    end.synchronize()
    assert start.elapsed_time(end) > 0


def test_a_cuda_device_offers_what_device_facts_reads():
    """``autosched.target`` reads a GPU's SMs and L2 off TVM's device (``parse_target``, ``device_facts``)."""
    for name in ("exist", "device_name", "compute_version", "multi_processor_count", "l2_cache_size_bytes"):
        assert isinstance(getattr(type(tvm.cuda(0)), name), property), name

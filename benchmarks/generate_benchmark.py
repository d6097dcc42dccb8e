"""Text generation on a GPU: autosched's generation build against transformers' ``generate()``, same run.

A Llama-2-7B, Llama-3-8B, Llama-3.1-8B (llama3 rotary scaling) or Qwen3-8B (q/k norms, untied head)
configuration (all layers, or ``--layers`` of them, fp16, random weights, made on the GPU: nothing is
downloaded) in its transformers class, prompts of ``--prompt`` random tokens, ``--new`` tokens, greedy. For
each batch size: prefill ms, ms per decode step (each launched before the tokens of the one before are read,
as the generator decodes on a GPU; ``--step-at-a-time`` also times them one after another), tokens/s and the
share of the floor (the bytes one decode step must read: the weights without the embedding table, plus the K/V
cache at the mean context, at the device-to-device copy bandwidth measured in the same run). transformers
runs eagerly (dynamic cache) and, with ``--compile``, with a static cache and ``torch.compile`` (fullgraph, no
CUDA graphs), and in torch's best recipe (:func:`torch_best_run`: static cache, each step compiled with CUDA
graphs). Greedy tokens are compared with eager transformers' for the first 16 new tokens of every prompt; a
first difference is reported with the logit margin of transformers' choice there (a near-tie or not).

    python benchmarks/generate_benchmark.py --model llama2-7b --batches 1,16 --compile --out results.json

``--artifact DIR`` times an artifact of ``autosched build MODEL --generate`` instead, as it was built (its own
weights and kernels; nothing is built and transformers does not run): its prefill and ms per decode step at
each batch size, as above (what ``benchmarks/serve_gpu.sh`` compares a server's time per output token with).

    python benchmarks/generate_benchmark.py --artifact ART --batches 1,16 --prompt 512 --new 128 --out steps.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LLAMA3_8B = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
                 vocab_size=128256, max_position_embeddings=8192, rope_parameters={"rope_type": "default",
                                                                                   "rope_theta": 500000.0})
# (transformers class, config) of each model: the real model's dimensions, all of its layers.
CONFIGS = {
    "llama2-7b": ("Llama", dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=32,
                                intermediate_size=11008, vocab_size=32000, max_position_embeddings=4096,
                                rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, num_hidden_layers=32)),
    "llama3-8b": ("Llama", dict(LLAMA3_8B, num_hidden_layers=32)),
    "llama3.1-8b": ("Llama", dict(LLAMA3_8B, num_hidden_layers=32, max_position_embeddings=131072, rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192, "rope_theta": 500000.0})),
    "qwen3-8b": ("Qwen3", dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                               intermediate_size=12288, num_hidden_layers=36, vocab_size=151936,
                               max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False,
                               rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
}
COMPARED = 16  # new tokens compared with transformers per prompt


DEVICE = "cuda"  # --target llvm: a smoke test of this script on the CPU (tiny --layers, fp32)


def make_model(name: str, layers: int | None):
    """The model ``name`` in its transformers class, ``layers`` of its layers (None: all), random weights."""
    import torch
    import transformers

    family, dims = CONFIGS[name]
    config = getattr(transformers, f"{family}Config")(**{**dims, "num_hidden_layers": layers or dims["num_hidden_layers"]})
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = getattr(transformers, f"{family}ForCausalLM")(config)
        model = model.to(torch.float16 if DEVICE == "cuda" else torch.float32).eval()
    return model


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth, bytes/s (read + write of a 2 GiB buffer), median of 20."""
    import torch

    if DEVICE != "cuda":
        return float("nan")
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(22):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() / statistics.median(times[2:])


def floor_ms(model, batch: int, context: float, bandwidth: float, weight_bytes: int | None = None) -> float:
    """The bytes one decode step must read at ``bandwidth``: weights less the embedding table (``weight_bytes``
    where given: a quantized build's own), plus K and V of ``context`` tokens for each sequence."""
    cfg = model.config
    weights = weight_bytes or sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                                  if "embed_tokens" not in n)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv = batch * context * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * 2
    return 1e3 * (weights + kv) / bandwidth


def build_ours(model, batches: list[int], max_seq_len: int, static: bool = True, db_path: str | None = None,
               cuda_graphs: bool = True, prefill_chunks: tuple[int, ...] = (), quantize: str | None = None,
               programmatic_launch: bool = False, programmatic_rows: int | None = None, prefetch_weights: int = 0):
    """(make a generator, build seconds, attention kernels, bytes of its weights less the embedding table) of our
    generation build for ``model`` on the GPU;
    ``static``: each batch size's decode step as a static function (CUDA graphs), else one function for all;
    ``quantize``: a --quantize scheme (fp8 on sm_90: W8A8 prefill chunks); ``programmatic_launch``: kernels
    launched while the one before them finishes (:mod:`autosched.pipeline.launch`), with ``programmatic_rows`` only
    those of decode steps of at most that many rows, with ``prefetch_weights`` (bytes) their GEMMs asking L2 for
    their weights before they wait."""
    from dataclasses import replace

    import torch
    import tvm
    from tvm import relax

    from autosched.generation import Generator
    from autosched.generation.build import GenerationModel, compile_generation, generation_manifest
    from autosched.generation.decoder import config_from_hf, weights_from_hf
    from autosched.generation.model import LoadedModel
    from autosched.target import parse_target

    target = parse_target("cuda" if DEVICE == "cuda" else "llvm")
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    config = config_from_hf(model.config, dtype)
    if quantize:
        from autosched.generation.quantize import check_quantizable

        check_quantizable(config, quantize)
        config = replace(config, quantize=quantize)
    gm = GenerationModel("benchmark", model, config, [])
    decode_batches = tuple(batches) if static else ()
    db = None
    if db_path:
        from autosched.database.store import Database

        db = Database(db_path)
    began = time.perf_counter()
    chunks = prefill_chunks if static else ()
    executable, names, report = compile_generation(gm, target, db, decode_batches, cuda_graphs, chunks,
                                                   programmatic_launch=programmatic_launch,
                                                   programmatic_rows=programmatic_rows,
                                                   prefetch_weights=prefetch_weights)
    if db is not None:
        db.close()
    built = time.perf_counter() - began
    weights = weights_from_hf(model.state_dict(), gm.config)
    if quantize:
        from autosched.generation.quantize import quantize_weights

        weights = quantize_weights(weights, gm.config, quantize)
    # On the CPU (a smoke test) the weights are shared with the model rather than copied: an 8B model's
    # embedding and head alone are 5 GB in fp32.
    own = (lambda t: t.clone(memory_format=torch.contiguous_format)) if DEVICE == "cuda" else (lambda t: t.contiguous())
    params = [tvm.runtime.from_dlpack(own(weights[n])) for n in names]
    manifest = generation_manifest(gm, names, target, report, max_seq_len, max(batches), decode_batches=decode_batches,
                                   prefill_chunks=chunks)
    device = tvm.cuda(0) if DEVICE == "cuda" else tvm.cpu(0)
    attention = dict(report.attention, tuned_kernels=len(report.tuned), default_kernels=len(report.default))
    weight_bytes = sum(weights[n].numel() * weights[n].element_size() for n in names if n != "embed.weight")
    def make():
        return Generator.from_model(LoadedModel(relax.VirtualMachine(executable, device), params, manifest, device))

    return make, built, attention, weight_bytes


def profile_steps(make_generator, prompts, phase: str, steps: int = 4, top: int = 12) -> list[dict]:
    """Where one decode step (``phase="decode"``) or the batch's prefill (``"prefill"``) spends its time, by
    kernel (CUDA events around each call of a build without CUDA graphs, or the host's clock on the CPU, whose
    kernels return when done; builtins such as the KV cache's attention included), slowest first. Without
    graphs each time includes its launch: small kernels read high."""
    import time

    import torch

    class HostEvent:  # torch.cuda.Event's interface, on the host's clock
        def record(self):
            self.at = time.perf_counter()

        def elapsed_time(self, end):
            return (end.at - self.at) * 1e3

    event_type = (lambda: torch.cuda.Event(enable_timing=True)) if DEVICE == "cuda" else HostEvent
    gen = make_generator()
    pairs, opened = [], []

    def instrument(func, symbol, before, ret, *args):
        if symbol in ("vm.builtin.kv_state_begin_forward", "vm.builtin.kv_state_end_forward"):
            return 0
        event = event_type()
        event.record()
        if before:
            opened.append(event)
        else:
            pairs.append((symbol, opened.pop(), event))
        return 0

    def add_all():
        return [gen.add(p, steps + 8, stop_tokens=[]) for p in prompts]

    ids = add_all()
    gen.step()  # the prefill (its first launches load the kernels), then decode steps
    gen.step()
    if phase == "prefill":
        for seq_id in ids:
            gen.remove(seq_id)
        ids = add_all()
        steps = 1
    gen.model.vm.set_instrument(instrument)
    for _ in range(steps):
        gen.step()
    gen.model.vm.set_instrument(None)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    totals: dict[str, list] = {}
    for symbol, start, end in pairs:
        totals.setdefault(symbol, []).append(start.elapsed_time(end))
    rows = sorted(({"kernel": k, "calls_per_step": len(v) / steps, "ms_per_step": sum(v) / steps}
                   for k, v in totals.items() if not k.startswith("vm.builtin.") or "attention" in k),
                  key=lambda r: -r["ms_per_step"])
    for seq_id in set(ids) & {*gen.live, *gen.finished}:  # a finished sequence's result, or a live one
        gen.remove(seq_id)
    return rows[:top]


def trace_steps(make_generator, prompts, steps: int = 4, top: int = 16) -> dict:
    """The GPU's own account of decode steps of the real build (CUDA graphs and all), from CUPTI through
    torch's profiler: per step, the span from the first kernel's start to the last one's end, the time some
    kernel runs (busy), the kernels launched, and the kernels that take most of the busy time. Span minus
    busy is the GPU idle inside a step: launches, graph boundaries, host work between them."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    gen = make_generator()
    ids = [gen.add(p, steps + 8, stop_tokens=[]) for p in prompts]
    gen.step()  # the prefill, then a decode step that captures the graphs
    gen.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            gen.step()
        torch.cuda.synchronize()
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    busy, reach = 0.0, float("-inf")
    for start, end, _ in kernels:  # the union of the kernels' intervals (concurrent ones count once)
        busy += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    by_name: dict[str, list] = {}
    for start, end, name in kernels:
        by_name.setdefault(name, []).append(end - start)
    span = (kernels[-1][1] - kernels[0][0]) if kernels else 0.0
    for seq_id in set(ids) & {*gen.live, *gen.finished}:
        gen.remove(seq_id)
    rows = sorted(({"kernel": k[:120], "calls_per_step": len(v) / steps, "us_per_call": sum(v) / len(v),
                    "ms_per_step": sum(v) / steps / 1e3} for k, v in by_name.items()), key=lambda r: -r["ms_per_step"])
    return {"span_ms_per_step": span / steps / 1e3, "busy_ms_per_step": busy / steps / 1e3,
            "kernels_per_step": len(kernels) / steps, "top": rows[:top], "gaps": idle_gaps(kernels, steps)}


def idle_gaps(kernels, steps: int, top: int = 8, least_us: float = 2.0) -> list[dict]:
    """Where the GPU waits: the idle stretches of at least ``least_us`` between one kernel's end and the next
    one's start (``kernels``: sorted (start, end, name) in µs), summed by the pair of kernels around them."""
    gaps: dict[tuple[str, str], list[float]] = {}
    reach, last = float("-inf"), ""
    for start, end, name in kernels:
        if last and start - reach >= least_us:
            gaps.setdefault((last[:60], name[:60]), []).append(start - reach)
        if end > reach:
            reach, last = end, name
    rows = [{"after": a, "before": b, "per_step": len(v) / steps, "us_per_step": sum(v) / steps}
            for (a, b), v in gaps.items()]
    return sorted(rows, key=lambda r: -r["us_per_step"])[:top]


def host_split(make_generator, prompts, steps: int = 16) -> dict:
    """The host's side of decode steps, without a profiler: per step, ms in the model's call (the cache's
    begin/end and the launches), in choosing the tokens (the sampling launch and the wait for the GPU), and
    in the rest (the generator's Python between them). A step at a time: launched ahead, a step's wait for the
    GPU is in no call of these."""
    gen = make_generator()
    gen.run_ahead = False
    spent = {"forward": 0.0, "choose": 0.0}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            began = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - began
        return wrapper

    ids = [gen.add(p, steps + 8, stop_tokens=[]) for p in prompts]
    gen.step()
    gen.step()
    gen.model.forward = timed("forward", gen.model.forward)
    gen.sampler.choose = timed("choose", gen.sampler.choose)
    began = time.perf_counter()
    for _ in range(steps):
        gen.step()
    total = time.perf_counter() - began
    for seq_id in set(ids) & {*gen.live, *gen.finished}:
        gen.remove(seq_id)
    ms = {name: seconds / steps * 1e3 for name, seconds in spent.items()}
    return {"step_ms": total / steps * 1e3, **{f"{k}_ms": v for k, v in ms.items()},
            "other_ms": total / steps * 1e3 - sum(ms.values())}


def ours(make_generator, prompts, new: int, run_ahead: bool | None = None):
    """(prefill ms, ms per decode step, tokens per prompt) of one batch of prompts, as the Generator decodes by
    default (on a GPU each greedy step launched before the last one's tokens are read), or with ``run_ahead``
    set either way."""
    gen = make_generator()
    if run_ahead is not None:
        gen.run_ahead = run_ahead
    gen.generate(prompts, 4)  # warm up: the first launches load kernels and capture the CUDA graphs
    gen.reset_timing()
    results = gen.generate(prompts, new, stop_tokens=[])
    timing = gen.timing()
    return timing["prefill_ms"], timing["ms_per_step"], [r.tokens for r in results]


def transformers_run(model, prompts, new: int, compiled: bool):
    """(prefill ms, ms per decode step, tokens, scores) of ``model.generate`` on the batch (prompts of one
    length), from a 1-token and a ``new``-token run."""
    import torch

    ids = torch.tensor(prompts, device=DEVICE)
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0)
    if compiled:
        kwargs["cache_implementation"] = "static"

    sync = torch.cuda.synchronize if DEVICE == "cuda" else (lambda: None)

    def timed(n, **more):
        sync()
        began = time.perf_counter()
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kwargs, **more)
        sync()
        return time.perf_counter() - began, out

    timed(2)
    timed(new)  # warm-up (and, compiled, the compilations of both shapes)
    one, _ = timed(1)
    full, out = timed(new, output_scores=True, return_dict_in_generate=True)
    tokens = out.sequences[:, ids.shape[1]:].tolist()
    return 1e3 * one, 1e3 * (full - one) / (new - 1), tokens, out.scores


def torch_best_run(model, prompts, new: int):
    """torch's fastest decode recipe: (prefill ms, ms per decode step, tokens). transformers' model over a
    ``StaticCache``; an eager prefill, then each one-token step (the forward and a greedy argmax on the GPU)
    under ``torch.compile(fullgraph=True, mode="reduce-overhead")``, whose Inductor kernels replay as CUDA
    graphs. Each step marks a new graph step and clones its token before the next replay overwrites it."""
    import torch
    from transformers import StaticCache

    ids = torch.tensor(prompts, device=DEVICE)
    batch, length = ids.shape
    cache = StaticCache(config=model.config, max_cache_len=length + new + 1)

    def forward(tokens, cache_position):
        logits = model(input_ids=tokens, cache_position=cache_position, past_key_values=cache, use_cache=True).logits
        return logits[:, -1, :].argmax(-1, keepdim=True)

    step = torch.compile(forward, fullgraph=True, mode="reduce-overhead")
    sync = torch.cuda.synchronize if DEVICE == "cuda" else (lambda: None)

    def run(n):
        cache.reset()
        sync()
        began = time.perf_counter()
        token = forward(ids, torch.arange(length, device=DEVICE))
        sync()
        prefilled = time.perf_counter()
        tokens = [token]
        for i in range(n - 1):
            torch.compiler.cudagraph_mark_step_begin()
            token = step(token, torch.tensor([length + i], device=DEVICE)).clone()
            tokens.append(token)
        sync()
        return prefilled - began, time.perf_counter() - prefilled, torch.cat(tokens, 1).tolist()

    with torch.no_grad():
        run(min(8, new))
        run(min(8, new))  # warm-up: compilation, then the graphs' recording (within the cache's length)
        prefill, decode, tokens = run(new)
    return 1e3 * prefill, 1e3 * decode / (new - 1), tokens


def first_difference(ours_tokens, theirs, scores):
    """Per prompt: None if the first COMPARED tokens agree, else (index, transformers' logit margin there)."""
    report = []
    for row, (a, b) in enumerate(zip(ours_tokens, theirs)):
        diff = next((i for i in range(min(COMPARED, len(a), len(b))) if a[i] != b[i]), None)
        if diff is None:
            report.append(None)
            continue
        logits = scores[diff][row].float()
        top = logits.topk(2).values
        report.append({"index": diff, "ours": a[diff], "theirs": b[diff],
                       "margin": float(top[0] - top[1]), "our_token_gap": float(top[0] - logits[a[diff]])})
    return report


def artifact_rows(artifact: str, batches: list[int], prompt: int, new: int, out: str | None,
                  pad_ab: bool = False) -> list[dict]:
    """Prefill ms, ms per decode step and tokens/s of the artifact at each batch size (one generator for all):
    prompts of ``prompt`` random tokens, ``new`` tokens each (no stop token), after a warm-up of 4 tokens.
    ``pad_ab``: each batch twice, without and with ``Generator.pad_prefill`` (the same tokens)."""
    import torch

    from autosched.generation import Generator

    gen = Generator(artifact)
    rows = []
    generator = torch.Generator().manual_seed(0)
    for batch in batches:
        prompts = torch.randint(0, gen.vocab, (batch, prompt), generator=generator).tolist()
        for pad in (False, True) if pad_ab else (gen.pad_prefill,):
            gen.pad_prefill = pad
            prefill, step, tokens = ours(lambda: gen, prompts, new)
            rows.append({"artifact": artifact, "batch": batch, "prompt": prompt, "new": new, "pad_prefill": pad,
                         "ours_prefill_ms": prefill, "ours_ms_per_step": step, "ours_tokens_per_s": 1e3 * batch / step,
                         "all_new_tokens": all(len(t) == new for t in tokens), "tokens": tokens[0][:16]})
            print(json.dumps(rows[-1]), flush=True)
            if out:
                Path(out).write_text(json.dumps({"rows": rows}, indent=2))
    return rows


def main() -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(CONFIGS), default="llama2-7b")
    parser.add_argument("--layers", type=int, help="the first N layers of the model (default: all of them)")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--compile", action="store_true", help="also transformers with a static cache + torch.compile, "
                        "and torch's best recipe (static cache, each step compiled with CUDA graphs)")
    parser.add_argument("--dynamic", action="store_true",
                        help="also time our decode step without its static function (no CUDA graphs)")
    parser.add_argument("--db", help="a tuning database whose records the build applies (tune-model --generate)")
    parser.add_argument("--without-graphs", action="store_true",
                        help="also time our decode step on the same build without CUDA graphs (each kernel launched "
                        "by the VM): whether the graphs' joins around each attention call cost more than they save")
    parser.add_argument("--profile", action="store_true",
                        help="also the slowest kernels of a decode step and of the prefill (a build without CUDA "
                        "graphs, per batch)")
    parser.add_argument("--each-batch-alone", action="store_true",
                        help="measure each batch on a build of its own (that batch's decode function and prefill "
                             "chunk only, as a deployment at that batch builds), not one build for all")
    parser.add_argument("--trace", action="store_true",
                        help="also the GPU's trace of decode steps of the real build (CUDA graphs included): span, "
                        "busy time, kernels per step and the costliest kernels (CUDA only)")
    parser.add_argument("--quantize", help="our build's --quantize scheme (e.g. fp8: on sm_90 its prefill chunks are "
                        "W8A8 on FP8 wgmma); transformers stays in fp16, so its tokens may differ")
    parser.add_argument("--torch-int4", action="store_true",
                        help="also torch's best recipe on int4 weights (PyTorch's int4 GEMM, torchao's int4 "
                        "weight-only kernel; groups of 128, bfloat16), next to a --quantize q4f16 build")
    parser.add_argument("--step-at-a-time", action="store_true",
                        help="also our build with each decode step launched after the tokens of the step before are "
                             "read (Generator(run_ahead=False); the default on a GPU launches it before): ms per step "
                             "and whether the tokens are the same")
    parser.add_argument("--programmatic-launch", nargs="?", const=True, type=int, metavar="ROWS",
                        help="also our build with programmatic dependent launch (sm_90: each kernel launched while "
                        "the one before it finishes), timed against the same build without it; ROWS: only in the "
                        "kernels of decode steps of at most ROWS rows")
    parser.add_argument("--prefetch-weights", type=float, metavar="MB",
                        help="with --programmatic-launch: also that build with each of its GEMMs asking L2 for up to "
                             "MB megabytes of its weights before it waits for the kernel before it")
    parser.add_argument("--out", help="write the rows as JSON here")
    parser.add_argument("--artifact", metavar="DIR", help="time this artifact of `autosched build --generate` at each "
                        "of --batches instead (--prompt, --new; the other options do not apply)")
    parser.add_argument("--pad-prefill-ab", action="store_true", help="with --artifact: each batch without and with "
                        "the prefill's padding up to a static chunk (Generator.pad_prefill)")
    parser.add_argument("--target", choices=("cuda", "llvm"), default="cuda",
                        help="llvm: a smoke test of this script on the CPU (with a few --layers)")
    args = parser.parse_args()
    if args.prefetch_weights and not args.programmatic_launch:
        parser.error("--prefetch-weights needs --programmatic-launch: the prefetch goes before the wait it adds")
    global DEVICE
    DEVICE = "cuda" if args.target == "cuda" else "cpu"
    if args.artifact:
        artifact_rows(args.artifact, [int(b) for b in args.batches.split(",")], args.prompt, args.new, args.out,
                      args.pad_prefill_ab)
        return 0

    bandwidth = copy_bandwidth()
    model = make_model(args.model, args.layers)
    args.layers = model.config.num_hidden_layers
    print(f"{args.model}, {args.layers} layers, copy {bandwidth / 1e9:.0f} GB/s", flush=True)
    rows = []
    generator = torch.Generator().manual_seed(0)
    batches = [int(b) for b in args.batches.split(",")]
    max_seq_len = args.prompt + args.new
    # A static prefill chunk per batch: its prompts packed into one call, as torch prefills the batch at once.
    chunks = tuple(sorted({args.prompt * b for b in batches}))

    def build_for(these):  # our build with static decode functions and prefill chunks for the batches ``these``
        return build_ours(model, these, max_seq_len, db_path=args.db,
                          prefill_chunks=tuple(sorted({args.prompt * b for b in these})), quantize=args.quantize)

    shared = None if args.each_batch_alone else build_for(batches)
    make_dynamic = build_ours(model, batches, max_seq_len, static=False, db_path=args.db,
                              quantize=args.quantize)[0] if args.dynamic else None
    make_profiled = build_ours(model, batches, max_seq_len, db_path=args.db, cuda_graphs=False, prefill_chunks=chunks,
                               quantize=args.quantize)[0] if args.profile or args.without_graphs else None
    rows_launched = None if args.programmatic_launch is True else args.programmatic_launch

    def build_overlapped(prefetch_bytes: int = 0):
        return build_ours(model, batches, max_seq_len, db_path=args.db, prefill_chunks=chunks, quantize=args.quantize,
                          programmatic_launch=True, programmatic_rows=rows_launched,
                          prefetch_weights=prefetch_bytes)[0]

    make_overlapped = build_overlapped() if args.programmatic_launch else None
    make_prefetched = build_overlapped(int(args.prefetch_weights * 2**20)) if args.prefetch_weights else None
    if shared is not None:
        print(f"built in {shared[1]:.1f} s", flush=True)
    int4_model = None
    if args.torch_int4:
        from _torch_int4 import int4_weight_only

        int4_model = int4_weight_only(model)
    for batch in batches:
        make, built, attention, weight_bytes = shared or build_for([batch])
        prompts = torch.randint(0, model.config.vocab_size, (batch, args.prompt), generator=generator).tolist()
        row = {"model": args.model, "layers": args.layers, "batch": batch, "prompt": args.prompt, "new": args.new,
               "quantize": args.quantize}
        rows.append(row)

        def save():  # after every measurement: a run cut off by a time limit keeps what it measured
            if args.out:
                Path(args.out).write_text(json.dumps({"copy_bandwidth_gbs": bandwidth / 1e9, "rows": rows}, indent=2))

        prefill, step, tokens = ours(make, prompts, args.new)
        if make_dynamic is not None:
            row["ours_dynamic_ms_per_step"] = ours(make_dynamic, prompts, args.new)[1]
        if args.step_at_a_time:  # the same build, each decode step launched once the last one's tokens are read
            plain = ours(make, prompts, args.new, run_ahead=False)
            row.update(step_at_a_time_ms_per_step=plain[1], step_at_a_time_same_tokens=plain[2] == tokens)
            print({k: row[k] for k in ("batch", "step_at_a_time_ms_per_step", "step_at_a_time_same_tokens")}, flush=True)
        if make_overlapped is not None:
            overlapped = ours(make_overlapped, prompts, args.new)
            row.update(programmatic_prefill_ms=overlapped[0], programmatic_ms_per_step=overlapped[1],
                       programmatic_same_tokens=overlapped[2] == tokens)
            print({k: row[k] for k in ("batch", "programmatic_ms_per_step", "programmatic_same_tokens")}, flush=True)
        if make_prefetched is not None:
            prefetched = ours(make_prefetched, prompts, args.new)
            row.update(prefetch_mb=args.prefetch_weights, prefetch_prefill_ms=prefetched[0],
                       prefetch_ms_per_step=prefetched[1], prefetch_same_tokens=prefetched[2] == tokens)
            print({k: row[k] for k in ("batch", "prefetch_ms_per_step", "prefetch_same_tokens")}, flush=True)
        if args.trace and DEVICE == "cuda":
            row["trace"] = trace_steps(make, prompts)
            row["trace"]["host"] = host_split(make, prompts)
            print(json.dumps(row["trace"], indent=1), flush=True)
        if args.without_graphs:
            row["ours_without_graphs_ms_per_step"] = ours(make_profiled, prompts, args.new)[1]
        if args.profile:
            row["profile"] = profile_steps(make_profiled, prompts, "decode")
            row["prefill_profile"] = profile_steps(make_profiled, prompts, "prefill")
            print(json.dumps({k: row[k] for k in ("profile", "prefill_profile")}, indent=1), flush=True)
        floor = floor_ms(model, batch, args.prompt + args.new / 2, bandwidth, weight_bytes)
        row.update(ours_prefill_ms=prefill, ours_ms_per_step=step, ours_tokens_per_s=1e3 * batch / step,
                   floor_ms=floor, share_of_floor=floor / step, build_s=built, attention=attention)
        save()
        eager = transformers_run(model, prompts, args.new, compiled=False)
        row.update(eager_prefill_ms=eager[0], eager_ms_per_step=eager[1], vs_eager=eager[1] / step,
                   first_differences=first_difference(tokens, eager[2], eager[3]))
        save()
        if args.compile:
            try:
                best = torch_best_run(model, prompts, args.new)
                row.update(best_prefill_ms=best[0], best_ms_per_step=best[1], vs_best=best[1] / step,
                           best_first_differences=sum(a[:COMPARED] != b[:COMPARED] for a, b in zip(tokens, best[2])))
            except Exception as exc:  # noqa: BLE001 - a recipe that fails on this machine is reported, not fatal
                row["best_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            save()
            if int4_model is not None:
                try:
                    int4 = torch_best_run(int4_model, prompts, args.new)
                    row.update(int4_best_prefill_ms=int4[0], int4_best_ms_per_step=int4[1], vs_int4_best=int4[1] / step)
                except Exception as exc:  # noqa: BLE001 - a recipe that fails on this machine is reported, not fatal
                    row["int4_best_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                save()
            torch._dynamo.reset()
            model.forward = torch.compile(model.forward, fullgraph=True)
            try:
                compiled = transformers_run(model, prompts, args.new, compiled=True)
                row.update(compiled_prefill_ms=compiled[0], compiled_ms_per_step=compiled[1],
                           vs_compiled=compiled[1] / step)
            except Exception as exc:  # noqa: BLE001 - a recipe that fails on this machine is reported, not fatal
                row["compiled_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            finally:
                model.forward = model.forward._torchdynamo_orig_callable if hasattr(model.forward,
                                                                                  "_torchdynamo_orig_callable") else model.forward
        print(json.dumps(row), flush=True)
        save()
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())

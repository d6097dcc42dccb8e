"""``autosched serve DIR``: a generation artifact behind an OpenAI-compatible HTTP server (uvicorn)."""

from __future__ import annotations

from pathlib import Path

from ..errors import UsageError
from ..output import console
from .generate import add_speculation_arguments, speculation_draft

# Deferred imports: tvm_ffi, fastapi, uvicorn (imported where used: `autosched --help` stays fast).


def add_serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve an artifact of `autosched build MODEL --generate` over an "
                       "OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models, /metrics)")
    p.add_argument("artifact", help="the folder `autosched build --generate` wrote")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for "
                   "other machines)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free one, printed)")
    p.add_argument("--api-key", help="clients must send 'Authorization: Bearer KEY' (default: no key)")
    p.add_argument("--served-model-name", help="the model's name in the API (default: the artifact folder's name)")
    p.add_argument("--tokenizer", help="a local Hugging Face tokenizer folder (default: the artifact's own, which "
                   "build --generate copies from the model's folder)")
    p.add_argument("--max-waiting", type=int, default=1024,
                   help="requests waiting for a row of the batch beyond which a new one gets 429 (default 1024)")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="prefill every prompt whole (default: prompts that start with the tokens of earlier ones "
                        "reuse their KV pages)")
    p.add_argument("--kv-pages", type=int, help="pages in the KV cache (default: room for --max-batch sequences of "
                   "--max-seq-len tokens)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM or SIGINT: seconds to let running requests finish before exiting (default 30)")
    p.add_argument("--no-run-ahead", action="store_true",
                   help="decode a step at a time (default on a GPU: each greedy step is launched before the tokens "
                        "of the step before it are read)")
    add_speculation_arguments(p)
    p.set_defaults(fn=cmd_serve)


def cmd_serve(args) -> int:
    from ..generation.generator import Generator, check_kv_pages, read_generation_manifest
    from ..serve.tokenizer import artifact_tokenizer

    manifest = read_generation_manifest(args.artifact)  # a bad folder is reported before anything loads
    if args.kv_pages is not None:
        check_kv_pages(args.kv_pages)
    if args.max_waiting < 0:
        raise UsageError(f"--max-waiting must be 0 or more (got {args.max_waiting})")
    if not 0 <= args.port < 65536:
        raise UsageError(f"--port must be 0 to 65535 (got {args.port})")
    if args.drain_timeout < 0:
        raise UsageError(f"--drain-timeout must be 0 or more seconds (got {args.drain_timeout})")
    draft = speculation_draft(args)
    from ..serve.server import DrainingServer, listen

    try:
        listening = listen(args.host, args.port)
    except OSError as exc:
        raise UsageError(f"could not listen on {args.host}:{args.port} ({exc.strerror or exc}): give another --port "
                         "or --host") from None
    tokenizer = artifact_tokenizer(args.artifact, args.tokenizer)
    name = args.served_model_name or Path(args.artifact).resolve().name
    log = console(stderr=True)
    if tokenizer is None:
        log.log(f"{args.artifact} has no tokenizer: prompts as token ids only, no text and no chat (give --tokenizer)")

    from ..serve import Engine, ServerMetrics, create_app

    def make_generator():
        return Generator(args.artifact, kv_pages=args.kv_pages, draft=draft, speculate=args.speculate or 1,
                         adaptive=not args.always_speculate, run_ahead=False if args.no_run_ahead else None,
                         prefix_cache=not args.no_prefix_cache)

    metrics = ServerMetrics()
    engine = Engine(make_generator, tokenizer, max_waiting=args.max_waiting, metrics=metrics)
    metrics.engine = engine
    engine.start()
    if not args.no_prefix_cache and engine.gen.prefix_cache is None:
        why = "a sliding window" if manifest["decoder"].get("sliding_window") else "longrope"
        log.log(f"prefix caching is off: a model with {why} cannot share a prefix's pages")
    app = create_app(engine, name, api_key=args.api_key, metrics=metrics)
    server = DrainingServer(app, args.host, args.port, engine, args.drain_timeout, name, log)
    try:
        server.run(sockets=[listening])
    finally:
        engine.stop()
    return 0

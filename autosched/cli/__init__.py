"""The ``autosched`` command line: one module per command group (``tune``: one operator; ``model``: a whole
model; ``generate``: text generation; ``tools``: report, RPC server, database), what they share in
``common``.

Data goes to stdout (tables for people, ``--format json|csv`` for scripts); progress and logs go to
stderr. Exit codes: 0 success, 1 failure, 2 bad input, 130 interrupted. Errors are one line unless
``--debug`` is given.
"""

from __future__ import annotations

import argparse
import re
import signal
import sys

from .. import __version__
from ..errors import AutoschedError
from .common import DEFAULT_MAX_BATCH, TUNE_MODEL_TRIALS, TUNE_TRIALS, add_db_arg, add_format, add_measure_args
from .evaluate import add_eval_parser
from .generate import add_build_arguments as add_generation_build_arguments
from .generate import add_generate_parser
from .generate import add_tune_arguments as add_generation_tune_arguments
from .model import BUILD_BUCKET_GROWTH, cmd_build, cmd_run, cmd_tune_model
from .serve import add_serve_parser
from .tools import cmd_db, cmd_report, cmd_rpc_server
from .tune import add_workload_args, cmd_ops, cmd_show, cmd_tune


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autosched", description="Schedule search for LLM operators on Apache TVM.")
    parser.add_argument("--version", action="version", version=f"autosched {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("ops", help="list the operators, their shape keys, dtypes and presets")
    add_format(p)
    p.set_defaults(fn=cmd_ops)

    p = sub.add_parser("tune", help="tune one operator for one device")
    add_workload_args(p)
    p.add_argument("--target", default="llvm", help="llvm (this CPU, default), cuda (first GPU), or kind:arch")
    p.add_argument("--trials", type=int, help=f"candidates to measure (default {TUNE_TRIALS}; with --time-budget "
                   "alone, as many as fit in it)")
    p.add_argument("--batch-size", type=int, default=16, help="candidates per round (default 16)")
    p.add_argument("--seed", type=int, default=0, help="seed of the search (default 0)")
    p.add_argument("--time-budget", type=float, help="stop after this many seconds (without --trials: the only budget)")
    p.add_argument("--patience", type=int, help="stop after this many rounds without improvement")
    p.add_argument("--cost-model", choices=("xgb", "random"), default="xgb", help="search guide (default xgb)")
    p.add_argument("--no-transfer", action="store_true",
                   help="for a shape without records, do not start from the nearest tuned shapes' decisions")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    add_measure_args(p)
    add_db_arg(p)
    add_format(p, ("table", "json"))
    p.set_defaults(fn=cmd_tune)

    p = sub.add_parser("show", help="print the kernel of the best record (CUDA source, or TensorIR for the CPU)")
    add_workload_args(p)
    p.add_argument("--target", default="llvm", help="llvm or cuda (works without a GPU: cuda means sm_90 then)")
    add_db_arg(p)
    p.set_defaults(fn=cmd_show)

    def model_args(p, growth=2.0):
        p.add_argument("model", help="an example model (tiny-llama, llama-7b-layers, ...) or module:factory")
        p.add_argument("--target", default="llvm", help="llvm (default) or cuda")
        p.add_argument("--batch", help="batch size of the example input; several (1,4,16) or 'dynamic' (1, 2, 4, "
                       "... up to --max-batch): tune-model tunes every size's kernels, build makes one artifact "
                       "for any batch up to the largest")
        p.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH,
                       help="the largest batch: of --batch dynamic, or with --generate the most sequences at once "
                       f"(and the largest default --decode-batches) (default {DEFAULT_MAX_BATCH})")
        p.add_argument("--tokens", help="tokens of the example input (prefill length; 1 = one decode step); "
                       "several lengths (64,256,1024) or 'dynamic' (16, 32, ... up to --max-tokens): tune-model "
                       "tunes every length's kernels, build makes one artifact for any length up to the largest")
        p.add_argument("--max-tokens", type=int, default=2048, help="the largest length of --tokens dynamic (default 2048)")
        p.add_argument("--bucket-growth", type=float, default=growth,
                       help=f"--tokens dynamic: each bucket this many times the one before (default {growth:g}; "
                       "powers of two always among them)")
        p.add_argument("--dtype", help="model dtype (the example's default if not given)")
        add_db_arg(p)

    p = sub.add_parser("tune-model", help="tune every kernel of a model under one trial budget")
    model_args(p)
    p.add_argument("--trials", type=int, help=f"candidates to measure over all kernels (default {TUNE_MODEL_TRIALS}; "
                   "with --time-budget alone, as many as fit in it)")
    p.add_argument("--batch-size", type=int, default=16, help="candidates per round (default 16)")
    p.add_argument("--scheduler", choices=("gradient", "round-robin"), default="gradient",
                   help="how trials are spread over the kernels (default gradient)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-budget", type=float, help="stop after this many seconds (without --trials: the only budget)")
    p.add_argument("-q", "--quiet", action="store_true")
    add_measure_args(p)
    add_format(p)
    add_generation_tune_arguments(p)
    p.set_defaults(fn=cmd_tune_model)

    p = sub.add_parser("build", help="build a deployable module of a model with the database's best kernels")
    # Build finer than tune-model tunes: a bucket nobody tuned takes the nearest tuned one's schedules, and
    # padding by at most a quarter keeps lengths never tuned close to a build for exactly that length
    # (BENCHMARKS.md, "Any length").
    model_args(p, growth=BUILD_BUCKET_GROWTH)
    p.add_argument("-o", "--output", required=True,
                   help="a new or empty folder (or an earlier build's) for the artifact: model.so (generate.so with "
                        "--generate; model-<bucket>.so per bucket of a dynamic build), params.bin and manifest.json")
    add_generation_build_arguments(p)
    p.set_defaults(fn=cmd_build)

    add_generate_parser(sub)
    add_serve_parser(sub)
    add_eval_parser(sub)

    p = sub.add_parser("run", help="run a built model on random inputs, check it against torch, time it")
    p.add_argument("artifact", help="the folder `autosched build` wrote")
    p.add_argument("--repeat", type=int, default=20, help="timed runs (default 20)")
    p.add_argument("--no-check", action="store_true", help="skip the comparison with torch")
    p.add_argument("--tokens", type=int, help="for a --tokens dynamic build: the length to run (default: the largest)")
    p.add_argument("--batch", type=int, help="for a --batch dynamic build: the batch to run (default: the largest)")
    p.add_argument("--profile", action="store_true", help="also time each kernel (CUDA events on a GPU): where the "
                   "run's time goes, and whether each kernel's schedule was tuned")
    add_format(p, ("table", "json"))
    p.set_defaults(fn=cmd_run)

    p = sub.add_parser("report", help="tuning curves, throughput charts (PNG) and a Markdown page of a database")
    add_db_arg(p)
    p.add_argument("-o", "--output", required=True, help="folder for report.md and the PNG charts")
    p.add_argument("--bench", nargs="*", default=[], help="benchmark results.json files to chart against baselines")
    p.set_defaults(fn=cmd_report)

    p = sub.add_parser("rpc-server", help="serve candidates to tuners through a TVM RPC tracker (runs until killed)")
    p.add_argument("--tracker", required=True, help="HOST:PORT of the TVM RPC tracker to register with")
    p.add_argument("--key", required=True, help="the device kind tuners ask for, e.g. h200")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for other machines)")
    p.add_argument("--port", type=int, default=9090, help="first port to try (default 9090)")
    p.add_argument("--port-end", type=int, help="first port not to try (default: --port + 100)")
    p.add_argument("--custom-addr", help="the address to report to the tracker, if not --host (e.g. behind NAT)")
    p.set_defaults(fn=cmd_rpc_server)

    from ..database import cli as db_cli

    db_cli.add_parser(sub, add_db_arg, add_format)
    sub.choices["db"].set_defaults(fn=cmd_db)
    _debug_anywhere(parser)
    return parser


def _debug_anywhere(parser: argparse.ArgumentParser) -> None:
    """``--debug`` before or after the command (``autosched build ... --debug``, as the error hint says): each
    command's parser takes it too, leaving it unset where it is not given (not overriding the main parser's)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                if "--debug" not in sub._option_string_actions:
                    sub.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                                     help="show tracebacks on errors")
                _debug_anywhere(sub)


# Options whose value is a comma-separated list of numbers: a value such as "-1,2" is theirs (argparse would take
# it for an option and answer with its usage), for the command to refuse in one line.
LIST_OPTIONS = ("--prompt-ids", "--stop-ids", "--decode-batches", "--prefill-chunks")


def _attach_list_values(argv: list[str]) -> list[str]:
    """``--prompt-ids -1,2`` as ``--prompt-ids=-1,2``."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] in LIST_OPTIONS and i + 1 < len(argv) and re.match(r"-\d", argv[i + 1]):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


INTERRUPTED = 130  # the exit code of an interrupted command


def main(argv: list[str] | None = None) -> int:
    try:
        code = _run(argv)
    except KeyboardInterrupt:  # a second one, during the first one's cleanup or its message: still exit 130
        _stop_taking_interrupts(argv)
        print("autosched: interrupted", file=sys.stderr)
        code = INTERRUPTED
    if code == INTERRUPTED and argv is None:
        _leave_interrupted()
    return code


def _stop_taking_interrupts(argv: list[str] | None) -> None:
    """Once interrupted, the program itself (not a caller of ``main`` in-process) ignores further SIGINT and
    SIGTERM: one arriving while it reports and exits would escape ``main``, and Python would then die of
    the signal (exit -2) instead of exiting 130."""
    if argv is None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _leave_interrupted() -> None:
    """Exit 130 now, the interruption handled (the records committed, the workers stopped). Where the
    KeyboardInterrupt passed through code a library runs as embedded Python (``PyRun_String``, as Cython's
    ``exec`` does), the interpreter remembers it as unhandled and, at its normal exit, kills itself with
    SIGINT (exit -2) whatever ``main`` returned (seen: an interrupted tune that had printed its message)."""
    import os

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(INTERRUPTED)


def _run(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(_attach_list_values(sys.argv[1:] if argv is None else list(argv)))

    def _terminate(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _terminate)
    try:
        return args.fn(args)
    except AutoschedError as exc:
        if args.debug:
            raise
        print(f"autosched: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        _stop_taking_interrupts(argv)
        tuning = args.command in ("tune", "tune-model")
        print("autosched: interrupted" + ("; every record measured so far is kept in the database" if tuning else ""),
              file=sys.stderr)
        return INTERRUPTED
    except Exception as exc:  # noqa: BLE001 - one line for users, the traceback with --debug
        if args.debug:
            raise
        print(f"autosched: internal error: {type(exc).__name__}: {exc} (run with --debug for the traceback)",
              file=sys.stderr)
        return 1

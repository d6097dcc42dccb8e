"""``autosched eval DIR``: the perplexity of a generation artifact over a local text."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from ..errors import UsageError


def add_eval_parser(sub) -> None:
    p = sub.add_parser("eval", help="the perplexity of an artifact of `autosched build MODEL --generate` over a text")
    p.add_argument("artifact", help="the folder `autosched build --generate` wrote")
    p.add_argument(
        "--text",
        help="a local UTF-8 text file, tokenised with --tokenizer (default: the tokenizer of "
        "the model folder the artifact was built from, if it has one)",
    )
    p.add_argument("--tokenizer", help="a local folder holding a Hugging Face tokenizer (nothing is downloaded)")
    p.add_argument("--token-ids", help="a file of token ids (whitespace- or comma-separated) instead of --text")
    p.add_argument(
        "--max-seq-len",
        type=int,
        help="tokens per window, each prefilled as a fresh sequence (default: the artifact's --max-seq-len)",
    )
    p.add_argument("--format", choices=("text", "json"), default="text", help="output (default text)")
    p.set_defaults(fn=cmd_eval)


def _tokens(args, manifest: dict) -> list[int]:
    from .generate import _tokenizer

    if args.text is not None and args.token_ids is not None:
        raise UsageError("--text and --token-ids are two ways to give the text to evaluate: give one of them")
    if args.text is None and args.token_ids is None:
        raise UsageError("give the text to evaluate: --text FILE (with a tokenizer) or --token-ids FILE")
    path = Path(args.text or args.token_ids)
    if not path.is_file():
        raise UsageError(f"{path} is not a file: give a local {'text' if args.text else 'token-id'} file")
    if args.token_ids is not None:
        items = [item for item in re.split(r"[\s,]+", path.read_text()) if item]
        bad = next((item for item in items if not item.isdigit()), None)
        if bad is not None:
            raise UsageError(
                f"--token-ids {path}: '{bad}' is not a token id (whole numbers, 0 or more, separated by "
                "spaces, newlines or commas)"
            )
        return [int(item) for item in items]
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"--text {path} is not UTF-8 ({exc.reason} at byte {exc.start}): give a UTF-8 text file") from None
    folder = args.tokenizer
    if folder is None:
        built_from = str(manifest.get("model", ""))
        if os.path.isdir(built_from) and any(
            os.path.exists(os.path.join(built_from, name)) for name in ("tokenizer.json", "tokenizer_config.json")
        ):
            folder = built_from
        else:
            raise UsageError(
                "--text needs a tokenizer: give --tokenizer LOCAL_DIR (the artifact's model folder has "
                "none), or give token ids with --token-ids FILE"
            )
    return _tokenizer(folder)(text)["input_ids"]


def cmd_eval(args) -> int:
    from ..generation.evaluate import perplexity
    from ..generation.generator import read_generation_manifest
    from ..generation.model import LoadedModel

    manifest = read_generation_manifest(args.artifact)  # a bad folder is reported before TVM loads
    tokens = _tokens(args, manifest)
    result = perplexity(LoadedModel.load(args.artifact), tokens, args.max_seq_len)
    scheme = (manifest.get("quantization") or {}).get("scheme") or manifest["decoder"].get("dtype", "")
    if args.format == "json":
        print(json.dumps({**result.to_json(), "weights": scheme}, indent=2))
    else:
        print(
            f"perplexity {result.perplexity:.4f} ({scheme} weights) over {result.scored_tokens} tokens in "
            f"{result.windows} window(s) of up to {result.window}"
        )
    return 0

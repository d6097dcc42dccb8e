"""A random-weights transformers model folder with a tokenizer, for serving benchmarks where nothing can be
downloaded: ``save_pretrained`` of a Llama model (``--config``: a tiny one for the CPU, or Llama-2-7B's
dimensions) and a byte-level BPE tokenizer trained here with the ``tokenizers`` library on the words that
``serve_benchmark.py --prompt-mode text`` builds its prompts of (each one token after a space), padded with added
tokens up to the model's vocabulary so that every id the model can emit decodes to text.

    python benchmarks/_random_hf_model.py /tmp/tiny-llama --config tiny
    python benchmarks/_random_hf_model.py /data/llama2-7b-random --config llama2-7b --device cuda   # fp16
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_benchmark import WORDS  # noqa: E402 - the words the text prompts are made of

CONFIGS = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, max_position_embeddings=2048),
    "llama2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096),
}


def make_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer of exactly ``vocab_size`` ids: <s> (0, BOS), </s> (1, EOS), the 256 bytes, the
    merges learnt from text made of WORDS (each " word" becomes one token), then added tokens up to the size."""
    import numpy as np
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tok.decoder = decoders.ByteLevel()
    rng = np.random.default_rng(0)
    # The words, then random letter strings for more merges (a large vocabulary has room for them).
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    lines = [" ".join(rng.choice(WORDS, 64)) for _ in range(400)]
    lines += [" ".join("".join(rng.choice(letters, rng.integers(2, 9))) for _ in range(64))
              for _ in range(min(4000, vocab_size // 4))]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(lines, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    missing = vocab_size - len(fast)
    if missing > 0:
        fast.add_tokens([f"<extra_{i}>" for i in range(missing)])
    if len(fast) != vocab_size:
        raise SystemExit(f"the tokenizer has {len(fast)} ids, not {vocab_size}")
    one_token = [w for w in WORDS if len(fast(" " + w, add_special_tokens=False)["input_ids"]) == 1]
    if len(one_token) != len(WORDS):
        raise SystemExit(f"only {len(one_token)} of the {len(WORDS)} words are one token each")
    return fast


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder")
    parser.add_argument("--config", choices=sorted(CONFIGS), default="tiny")
    parser.add_argument("--device", default="cpu", help="where the weights are made (cuda: fp16; cpu: float32 unless "
                        "--dtype)")
    parser.add_argument("--dtype", choices=("float16", "bfloat16", "float32"),
                        help="the weights' dtype (default float16 on cuda, float32 on cpu)")
    args = parser.parse_args()
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    dtype = getattr(torch, args.dtype or ("float16" if args.device.startswith("cuda") else "float32"))
    config = LlamaConfig(**CONFIGS[args.config], bos_token_id=0, eos_token_id=1, dtype=dtype)
    torch.manual_seed(0)
    torch.set_default_dtype(dtype)  # made in its dtype: 7B parameters in float32 first would take 27 GB
    with torch.device(args.device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    torch.set_default_dtype(torch.float32)
    if args.config == "tiny":  # larger logits than the default init, so that greedy decoding does not repeat one token
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.normal_(0, 0.5)
    model.save_pretrained(args.folder)
    make_tokenizer(config.vocab_size).save_pretrained(args.folder)
    print(args.folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A request's penalties, logit bias and log-probabilities on the device (autosched/generation/logit_rules.py):
the kernels give what the host's float64 rules give (``processed_logits``, ``token_logprob``), on the CPU here,
for sm_90a through nvcc without a GPU, and on a GPU where there is one."""

from __future__ import annotations

import pytest


def _sequence(prompt, made, **sampling):
    """A real SequenceState of ``prompt`` that has made ``made``, under ``Sampling(**sampling)``."""
    from autosched.generation.request import Sampling, SequenceState

    seq = SequenceState(0, [], len(prompt) + len(made), 64, frozenset(), Sampling(**sampling),
                        prompt_context=list(prompt))
    seq.completion.tokens.extend(made)
    return seq


def _rules_case(vocab: int, seed: int = 0):
    """(logits [rows, vocab], sequences, the rows they are in): rows with every rule alone and together, bias
    on tokens past the vocabulary, a row without rules between them, negative and positive logits."""
    import numpy as np

    rng = np.random.default_rng(seed)
    cases = [dict(logit_bias=((3, 5.0), (7, -100.0), (vocab + 4, 2.0))),
             dict(repetition_penalty=1.3),
             dict(frequency_penalty=0.7),
             dict(presence_penalty=-1.5),
             dict(repetition_penalty=0.8, frequency_penalty=-0.4, presence_penalty=0.9, logit_bias=((1, -3.0),))]
    seqs = [_sequence(rng.integers(0, vocab, 40).tolist(), rng.integers(0, vocab // 8, 30).tolist(), **kw)
            for kw in cases]
    rows = [0, 1, 3, 4, 5]  # row 2: no rules
    logits = (4 * rng.standard_normal((6, vocab))).astype("float32")
    return logits, seqs, rows


def _run_penalties(vocab, gpu, logits, seqs, rows, device):
    import numpy as np
    import tvm

    from autosched.generation.logit_rules import DeviceRules, penalty_kernel
    from autosched.target import compile_module, parse_target

    run = compile_module(tvm.IRModule({"main": penalty_kernel(vocab, gpu).with_attr("global_symbol", "main")}),
                         parse_target("cuda" if gpu else "llvm"))["main"]
    parts = [DeviceRules.entries(seq) for seq in seqs]
    keep = [tokens < vocab for tokens, _ in parts]
    row_ids = np.concatenate([np.full(k.sum(), r, dtype=np.int32) for r, k in zip(rows, keep)])
    tokens = np.concatenate([t[k] for (t, _), k in zip(parts, keep)])
    terms = np.concatenate([w[k] for (_, w), k in zip(parts, keep)])
    out = tvm.runtime.tensor(logits, device)
    run(out, *(tvm.runtime.tensor(a, device) for a in (row_ids, tokens, terms)))
    return out.numpy()


@pytest.mark.parametrize("vocab", [97, 4096])
def test_the_penalty_kernel_applies_bias_and_penalties_as_the_host_does(vocab):
    """Each row's logits after the kernel equal processed_logits' (float64) within float32 rounding; the row
    without rules is untouched; a bias past the vocabulary is dropped, as the host drops it."""
    import numpy as np
    import tvm

    from autosched.generation.sampler import processed_logits

    logits, seqs, rows = _rules_case(vocab)
    got = _run_penalties(vocab, False, logits, seqs, rows, tvm.cpu())
    for row, seq in zip(rows, seqs):
        np.testing.assert_allclose(got[row], processed_logits(logits[row], seq), rtol=1e-6, atol=1e-5)
    assert (got[2] == logits[2]).all()
    assert not np.allclose(got[rows], logits[rows])  # the rules changed something


def _run_logprobs(vocab, gpu, logits, chosen, device):
    import numpy as np
    import tvm

    from autosched.generation.logit_rules import logprob_kernel
    from autosched.generation.request import MAX_LOGPROBS
    from autosched.target import compile_module, parse_target

    run = compile_module(tvm.IRModule({"main": logprob_kernel(vocab, gpu)}), parse_target("cuda" if gpu else "llvm"))
    values = tvm.runtime.tensor(np.zeros((len(logits), MAX_LOGPROBS + 1), "float32"), device)
    tokens = tvm.runtime.tensor(np.zeros((len(logits), MAX_LOGPROBS), "int32"), device)
    run["main"](tvm.runtime.tensor(logits, device), tvm.runtime.tensor(np.asarray(chosen, "int32"), device),
                values, tokens)
    return values.numpy(), tokens.numpy()


def _logprob_case(vocab: int):
    """Rows of logits with ties among the top tokens (ordered by the smaller id), and a chosen token a row."""
    import numpy as np

    rng = np.random.default_rng(1)
    logits = (3 * rng.standard_normal((4, vocab))).astype("float32")
    logits[1, [5, 9, 2]] = logits[1].max() + 1  # a three-way tie for the maximum
    logits[2, [vocab - 1, 0]] = logits[2].max() + 0.5
    return logits, [int(rng.integers(vocab)) for _ in range(4)]


def _check_logprobs(logits, chosen, values, tokens):
    import numpy as np

    from autosched.generation.request import MAX_LOGPROBS
    from autosched.generation.sampler import token_logprob

    for r in range(len(logits)):
        want = token_logprob(logits[r], chosen[r], MAX_LOGPROBS)
        assert tokens[r].tolist() == [t for t, _ in want.top]
        np.testing.assert_allclose(values[r], [want.logprob] + [v for _, v in want.top], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("vocab", [97, 4096])
def test_the_logprob_kernel_gives_the_hosts_log_softmax_and_top_tokens(vocab):
    """The chosen token's log-probability and the 20 most likely tokens', ties by the smaller id, equal
    token_logprob's (float64) within float32 rounding."""
    import tvm

    logits, chosen = _logprob_case(vocab)
    _check_logprobs(logits, chosen, *_run_logprobs(vocab, False, logits, chosen, tvm.cpu()))


@pytest.mark.parametrize("vocab", [128256])
def test_the_rule_kernels_compile_for_sm90a(vocab):
    """Without a GPU: both kernels' CUDA forms (an entry a thread; a CTA a row for each reduction) compile
    with nvcc for sm_90a without spills."""
    import tvm

    from autosched.cuda_tools import cuda_source
    from autosched.generation.logit_rules import logprob_kernel, penalty_kernel
    from autosched.target import parse_target

    from .nvcc import nvcc_compile

    for kernel in (penalty_kernel, logprob_kernel):
        source = cuda_source(tvm.IRModule({"main": kernel(vocab, True).with_attr("global_symbol", "main")}),
                             parse_target("cuda:sm_90a", require_device=False))
        report = nvcc_compile(source, "sm_90a")
        assert report.ok and report.spills == 0, report.log[-2000:]


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [32000, 50257])
def test_the_rule_kernels_on_the_gpu_give_what_the_host_gives(vocab):
    """Both kernels on the GPU against the host's float64 rules, as on the CPU."""
    import numpy as np
    import tvm

    from autosched.generation.sampler import processed_logits

    logits, seqs, rows = _rules_case(vocab)
    got = _run_penalties(vocab, True, logits, seqs, rows, tvm.cuda(0))
    for row, seq in zip(rows, seqs):
        np.testing.assert_allclose(got[row], processed_logits(logits[row], seq), rtol=1e-6, atol=1e-5)
    logits, chosen = _logprob_case(vocab)
    _check_logprobs(logits, chosen, *_run_logprobs(vocab, True, logits, chosen, tvm.cuda(0)))

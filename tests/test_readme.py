"""The README says what is true: its quick start and "Using it" commands run as written (with small budgets, on
the CPU), its test command is the one CI runs, and it stays a guide (no run history, under 300 lines)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from .helpers import cli

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()


def _section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start:end if end != -1 else None]


def _shell_commands(text: str) -> list[str]:
    """Each command of the ```bash blocks, comments dropped and `&&` chains split."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.splitlines():
            line = re.sub(r"\s+# .*$", "", line).strip()
            commands += [part.strip() for part in line.split("&&") if part.strip()]
    return commands


def _small(command: str) -> str:
    """The same command with a budget that runs in seconds."""
    command = re.sub(r"--trials \d+", "--trials 4" if command.startswith("autosched tune ") else "--trials 8", command)
    return re.sub(r"--time-budget \d+", "--time-budget 5", command)


def test_the_readme_is_a_guide_not_a_lab_notebook():
    assert len(README.splitlines()) < 300
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", README), "dates belong in CHANGELOG.md or BENCHMARKS.md"
    assert not re.search(r"\b(first|second|third|fourth|fifth|sixth|seventh) (session|run)\b", README, re.I)


# A rate, a ratio to a peer, a time set against another, or a share of a floor: a benchmark's result.
QUOTED_RESULT = re.compile(r"\d(\.\d+)? ?(TFLOP/s|GFLOP/s|GB/s|TB/s)|\d\.\d+x (cuBLAS|cuDNN|torch|slower|faster)"
                           r"|\d+(\.\d+)? ?(us|ms|µs) (against|where|one|in)\b|\d+% of the (copy|floor|bandwidth)")


def test_code_quotes_no_benchmark_results():
    """Numbers belong in BENCHMARKS.md, where they are dated and reproducible; in the code they go stale."""
    quoted = []
    for folder in ("autosched", "search_spaces", "database"):
        for path in sorted((REPO / folder).rglob("*")):
            if path.suffix in (".py", ".cuh", ".cu"):
                quoted += [f"{path.relative_to(REPO)}:{i}: {line.strip()}"
                           for i, line in enumerate(path.read_text().splitlines(), 1) if QUOTED_RESULT.search(line)]
    assert not quoted, "\n".join(quoted)


def test_the_readmes_test_command_is_what_ci_runs():
    """.ci/run installs and tests as the README says (it only adds -q and a pip upgrade)."""
    readme = [c for c in _shell_commands(_section("Quick start")) if "pytest" in c or "[test]" in c]
    ci = [c.replace(" -q", "") for line in (REPO / ".ci" / "run").read_text().splitlines()
          if not line.startswith("#") for c in line.split("&&")]
    ci = {c.strip() for c in ci}
    assert readme and all(c in ci for c in readme), (readme, ci)
    both_tiers = ".ci/with-postgres bash -c 'python -m pytest && python -m pytest -m slow -n 2 --dist loadgroup'"
    assert both_tiers in _section("Quick start") and both_tiers in (REPO / ".ci" / "run").read_text()


def _readme_examples() -> list[str]:
    commands = _shell_commands(_section("Quick start")) + _shell_commands(_section("Using it"))
    return [c for c in commands if c.startswith("autosched ")]


def test_the_examples_are_found():
    examples = _readme_examples()
    assert any(c.startswith("autosched tune gemm --shape m=512,n=512,k=512 --trials 64") for c in examples)
    assert {"ops", "tune", "show", "db", "report", "tune-model", "build", "run"} <= {c.split()[1] for c in examples}


@pytest.mark.slow
def test_the_quick_start_and_using_it_examples_run_as_written(tmp_path, monkeypatch):
    """Every `autosched` command of the quick start and of "Using it", in order, in one folder, with budgets cut
    to a few trials; each must exit 0. They run in this process (``autosched.cli.main``, as the `autosched`
    script does): a new interpreter a command would add only its imports; tests/test_new_user.py and others
    start the command as a process."""
    monkeypatch.delenv("AUTOSCHED_DB", raising=False)
    monkeypatch.chdir(tmp_path)
    for command in _readme_examples():
        proc = cli(*shlex.split(_small(command))[1:], check=False)
        assert proc.returncode == 0, f"{_small(command)}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    assert (tmp_path / "out" / "tiny" / "manifest.json").exists()


def test_the_readme_says_which_commands_take_which_format():
    """Each command's --format choices are those the README's "Using it" names for it."""
    import argparse

    from autosched.cli import build_parser

    def subcommands(parser, prefix=""):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from subcommands(sub, f"{prefix}{name} ")
        yield prefix.strip(), next((tuple(a.choices) for a in parser._actions if "--format" in a.option_strings), None)

    formats = {name: choices for name, choices in subcommands(build_parser()) if name}
    said = ["`ops`, `tune-model` and the\n`db` read commands take `--format table|json|csv`",
            "`tune`, `run` and `db import` take `--format table|json`", "`generate` and `eval` `--format text|json`"]
    expected = {"ops": ("table", "json", "csv"), "tune-model": ("table", "json", "csv"), "tune": ("table", "json"),
                "run": ("table", "json"), "db import": ("table", "json"), "generate": ("text", "json"), "eval": ("text", "json"),
                "show": None, "report": None, "build": None, "rpc-server": None, "db export": None, "db upgrade": None,
                "serve": None}
    for name in ("best", "list", "show", "history", "compare", "stats"):
        expected[f"db {name}"] = ("table", "json", "csv")
    assert {k: v for k, v in formats.items() if k != "db"} == expected
    assert all(sentence in README for sentence in said), said


def test_the_readme_says_what_factories_return_where_debug_goes_and_that_generate_streams():
    """What issue 70 found the README to get wrong or leave out: the bundled hf-* factories return three items
    (the third, each integer input's range), not the two it named; --debug goes before or after the command;
    `generate --stream` (a real option) prints tokens as they come."""
    import inspect

    from autosched.cli import build_parser
    from autosched.pipeline.load import _example_models, load_model

    pytest.importorskip("transformers")
    made = _example_models()["hf-llama"](tokens=4)
    assert len(made) == 3 and set(made[2]) == {"input_ranges"}
    models = _section("Models")
    assert '`(model, example_inputs)`, or `(model, example_inputs, {"input_ranges": [...]})`' in models
    assert "input_ranges" in inspect.getdoc(load_model)
    assert "`--debug`, before or after the command, shows the traceback" in README
    generate = next(a for a in build_parser()._actions if a.dest == "command").choices["generate"]
    assert "--stream" in generate._option_string_actions
    assert any("--stream" in c for c in _shell_commands(_section("Models")) if c.startswith("autosched generate"))

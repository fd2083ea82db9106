"""The project's own promises: the README's test command is CI's, the layering holds, and the install claims only
the `kvchat` name in site-packages."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from import_contract import TOP_FOLDERS, violations

ROOT = Path(__file__).resolve().parent.parent


def readme_commands() -> list[str]:
    return re.findall(r"^\s*(\./install\.sh.*)$", (ROOT / "README.md").read_text(), flags=re.M)


def test_readme_has_exactly_two_commands_and_ci_runs_the_test_one():
    commands = readme_commands()
    assert len(commands) == 2, commands
    ci = [line for line in (ROOT / ".ci/run").read_text().splitlines() if line.startswith("./install.sh")]
    assert ci == [commands[1]]


def test_engine_storage_kernels_do_not_import_textual():
    code = ("import sys, kvchat.engine.engine, kvchat.engine.train.synthetic, kvchat.storage, kvchat.kernels\n"
            "assert not any(m == 'textual' or m.startswith('textual.') for m in sys.modules), 'textual imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert proc.returncode == 0, proc.stderr


def test_no_generic_top_level_modules_are_installed():
    code = ("import importlib.util as u\n"
            "print([n for n in ('app','engine','storage','kernels','assets','tests') if u.find_spec(n)])\n"
            "import kvchat.engine.model.decoder, kvchat.app.cli\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_every_dependency_says_why():
    text = (ROOT / "pyproject.toml").read_text()
    deps = tomllib.loads(text)["project"]["dependencies"]
    names = {re.split(r"[<>=;\s\[]", d)[0] for d in deps}
    assert {"torch", "numpy", "gguf", "llama-cpp-python", "triton", "zstandard", "sqlite-utils", "textual",
            "platformdirs", "click"} <= names
    lines = text.splitlines()
    for dep in deps:
        at = next(i for i, line in enumerate(lines) if line.strip().startswith(f'"{dep}"'))
        assert lines[at - 1].strip().startswith("#"), f"{dep} has no comment saying why"


def test_the_cli_s_written_out_policy_lists_match_the_engine_s():
    from kvchat.app.bench.eval_command import EVAL_POLICIES
    from kvchat.app.cli import main
    from kvchat.engine.policies import CHAT_POLICIES, POLICIES

    assert EVAL_POLICIES == sorted(POLICIES)
    app_choice = next(p for p in main.params if p.name == "kv_policy")
    assert list(app_choice.type.choices) == list(CHAT_POLICIES)


def test_commands_that_need_no_model_do_not_import_torch():
    import subprocess
    import sys

    code = "import sys, kvchat.app.cli; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# --- the import contract (tests/import_contract.py; docs/architecture.md draws it) ---


def test_the_import_contract_holds():
    assert violations(ROOT) == []


@pytest.fixture(scope="module")
def package_copy(tmp_path_factory) -> Path:
    """A copy of the package's modules, made once; each test adds an import to one file and puts it back."""
    copy = tmp_path_factory.mktemp("contract") / "kvchat"
    copy.mkdir()
    for path in ROOT.glob("*.py"):
        shutil.copy(path, copy / path.name)
    for folder in TOP_FOLDERS:
        shutil.copytree(ROOT / folder, copy / folder, ignore=shutil.ignore_patterns("*.gguf", "__pycache__", "*.jsonl"))
    return copy


def _violations_with(copy: Path, module: str, added: str) -> list[str]:
    """The contract's violations once `added` is appended to `module` of the copy (which holds none: the test
    above checks the same files)."""
    target = copy / module
    original = target.read_text()
    target.write_text(original + added)
    try:
        return violations(copy)
    finally:
        target.write_text(original)


@pytest.mark.parametrize("module, line, rule", [
    ("kernels/gemv.py", "from kvchat.engine.sampling import SamplingParams", "kernels/ imports only kernels/"),
    ("storage/codec.py", "import kvchat.engine.engine", "storage/ never imports engine/ or app/"),
    ("storage/db.py", "from kvchat.app.session import chat", "storage/ never imports engine/ or app/"),
    ("engine/generate.py", "from kvchat.storage.db import Store", "engine/ never imports storage/"),
    ("engine/kv/key_bounds.py", "from kvchat.paths import data_dir", "engine/ never imports storage/, paths"),
    ("engine/policies/base.py", "import click", "engine/ never imports"),
    ("engine/sampling.py", "from textual.app import App", "engine/ never imports"),
    ("app/session/chat.py", "import click", "app/session/ never imports click or textual"),
    ("app/session/service.py", "from textual import work", "app/session/ never imports click or textual"),
    ("app/tui/app.py", "from kvchat.app.cli import main", "app/tui/ never imports the CLI"),
    ("app/session/chat.py", "from kvchat.app.bench import resume", "only the CLI imports app/bench/"),
    ("app/tui/sidebar.py", "import kvchat.app.bench.plots", "only the CLI imports app/bench/"),
])
def test_the_import_contract_fails_on_a_forbidden_import(package_copy, module, line, rule):
    # inside a function too: a lazy import runs all the same
    found = _violations_with(package_copy, module, f"\n\ndef _added():\n    {line}\n")
    assert len(found) == 1 and module in found[0] and rule in found[0], found


def test_the_import_contract_fails_on_an_import_cycle(package_copy):
    # generate imports sampling at module level; now the reverse as well
    found = _violations_with(package_copy, "engine/sampling.py", "\nfrom kvchat.engine import generate  # noqa\n")
    assert any(f.startswith("import cycle:") and "kvchat.engine.generate" in f and "kvchat.engine.sampling" in f
               for f in found), found

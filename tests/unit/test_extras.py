"""The extras hold what their commands import, and a command whose extra is missing names the
extra to install and exits 2, without a traceback.

The missing package is really missing to the command: it runs in a subprocess whose
sitecustomize (on PYTHONPATH) sets `sys.modules[name] = None` for each hidden module, which is
what Python does for a module that cannot be imported; the check itself is not replaced.
tests/unit/test_packaging.py runs the same commands in virtual environments that lack them."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import yaml

from ctxlaunch.cli.extras import DISTRIBUTIONS, EXTRAS, extra_for, needs_extras
from tests.helpers.paths import JOBS, ROOT
from tests.helpers.tiny_hf import tiny_spec, write_tiny_llama

CTXLAUNCH = str(Path(sys.executable).parent / "ctxlaunch")

BASE_MODULES = {
    "pydantic": "pydantic",
    "pydantic_core": "pydantic",  # pydantic's own core, pinned by it
    "jinja2": "jinja2",
    "yaml": "pyyaml",
    "typer": "typer",
    "rich": "rich",
    "submitit": "submitit",
    "prometheus_client": "prometheus-client",
    "urllib3": "urllib3",
}
"""Top-level modules the base install provides -> the distribution that is declared for it."""

IMPORTED_BY_NAME = {"tokenizers", "sentencepiece", "tiktoken"}
"""Modules the package imports through importlib by name (runtime/data/tokenizers.py), which
an import statement scan cannot see."""


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0].lower()


def declared() -> tuple[set[str], dict[str, set[str]]]:
    """(the base distributions, extra -> its distributions with self-referencing extras such
    as ctxlaunch[tensorboard,mlflow,wandb] resolved), from pyproject.toml."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    raw = project["optional-dependencies"]

    def resolve(extra: str) -> set[str]:
        names: set[str] = set()
        for requirement in raw[extra]:
            if _name(requirement) == "ctxlaunch":
                inner = re.search(r"\[(.*)\]", requirement)
                assert inner, requirement
                for name in inner.group(1).split(","):
                    names |= resolve(name.strip())
            else:
                names.add(_name(requirement))
        return names

    return {_name(r) for r in project["dependencies"]}, {extra: resolve(extra) for extra in raw}


def imported_roots() -> dict[str, set[str]]:
    """Top-level third-party module -> the package files that import it (every import
    statement, inside functions and under TYPE_CHECKING too)."""
    found: dict[str, set[str]] = {}
    for path in (ROOT / "ctxlaunch").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                root = name.split(".")[0]
                if root not in sys.stdlib_module_names and root != "ctxlaunch":
                    found.setdefault(root, set()).add(str(path.relative_to(ROOT)))
    for root in IMPORTED_BY_NAME:
        found.setdefault(root, set()).add("ctxlaunch/runtime/data/tokenizers.py")
    return found


def test_the_extras_table_is_the_one_pyproject_declares() -> None:
    base, extras = declared()
    for extra, modules in EXTRAS.items():
        assert extra in extras, f"pyproject.toml has no extra {extra!r}"
        for module in modules:
            assert DISTRIBUTIONS.get(module, module) in extras[extra], (extra, module)
    assert extras["trackers"] == extras["tensorboard"] | extras["mlflow"] | extras["wandb"]
    assert {"mkdocs", "mkdocs-material"} <= extras["docs"]
    # dev: everything the tests need, the trainer's, the data's and the report's packages too
    assert extras["train"] | extras["data"] | extras["report"] <= extras["dev"]
    assert {"mkdocs", "tensorboard", "mlflow-skinny", "wandb"} <= extras["dev"]
    assert "torch" not in base and not base & extras["train"]


def test_every_import_is_declared_in_the_base_or_an_extra() -> None:
    base, _ = declared()
    unknown = {}
    for root, files in imported_roots().items():
        if root in BASE_MODULES:
            assert BASE_MODULES[root] in base, (
                f"{root} is imported but {BASE_MODULES[root]} is not a base dependency "
                f"({sorted(files)})"
            )
        elif extra_for(root) is None:
            unknown[root] = sorted(files)
    assert not unknown, f"imported, but in no extra and not in the base install: {unknown}"


def test_safetensors_and_the_tokenizers_belong_to_the_commands_that_import_them() -> None:
    _, extras = declared()
    assert "safetensors" in extras["train"]  # init_from and export
    assert {"tokenizers", "sentencepiece", "tiktoken", "numpy"} <= extras["data"]
    assert extra_for("numpy", "data prepare") == "data"
    assert extra_for("numpy", "train") == "train"
    assert extra_for("mlflow") == "mlflow" and extra_for("torch.distributed") == "train"


def test_the_cli_imports_no_extra() -> None:
    """Every command of the base install starts without an extra's package: importing the CLI
    (and the progress bars) loads none of them."""
    optional = sorted({m for modules in EXTRAS.values() for m in modules})
    code = (
        "import sys\nimport ctxlaunch.cli, ctxlaunch.runtime.progress\n"
        f"print(','.join(m for m in {optional!r} if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ""


# -- a command whose extra is missing ----------------------------------------------------------
@pytest.fixture
def hiding(tmp_path: Path):
    """run(hidden modules, *args): the console script with those modules unimportable."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os, sys\n"
        "for name in os.environ['CTXLAUNCH_TEST_HIDE'].split(','):\n"
        "    sys.modules[name] = None\n"
    )
    home = tmp_path / "home"

    def run(hidden: str, *args: str) -> subprocess.CompletedProcess[str]:
        env = {
            **os.environ,
            # The hiding site first; a checkout on the path (a worktree's) stays after it.
            "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])),
            "CTXLAUNCH_TEST_HIDE": hidden,
            "CTXLAUNCH_HOME": str(home),
        }
        return subprocess.run(
            [CTXLAUNCH, *args],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            timeout=120,
        )

    return run


def assert_names_extra(result: subprocess.CompletedProcess[str], command: str, line: str) -> None:
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert f"ctxlaunch {command} needs {line}" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr + result.stdout


@pytest.mark.parametrize(
    ("hidden", "args", "line"),
    [
        ("torch", ["train", str(JOBS / "demo.yaml")], "torch: pip install 'ctxlaunch[train]'"),
        ("torch", ["eval", str(JOBS / "demo.yaml")], "torch: pip install 'ctxlaunch[train]'"),
        ("torch", ["calibrate"], "torch: pip install 'ctxlaunch[train]'"),
        ("torch", ["submit", str(JOBS / "demo.yaml")], "torch: pip install 'ctxlaunch[train]'"),
        (
            "torch",
            ["sweep", str(JOBS / "sweeps" / "demo.yaml")],
            "torch: pip install 'ctxlaunch[train]'",
        ),
        ("torch", ["export", ".", "--hf", "out"], "torch: pip install 'ctxlaunch[train]'"),
    ],
    ids=["train", "eval", "calibrate", "submit-local", "sweep-local", "export"],
)
def test_a_command_without_torch_names_the_train_extra(hiding, hidden, args, line) -> None:
    result = hiding(hidden, *args)
    assert_names_extra(result, args[0], line)


def test_data_prepare_without_its_packages_names_the_data_extra(hiding, tmp_path: Path) -> None:
    text = tmp_path / "doc.txt"
    text.write_text("some text\n")
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text("{}")
    args = ["data", "prepare", str(text), "-t", str(tokenizer), "-o", str(tmp_path / "out")]
    assert_names_extra(
        hiding("numpy", *args), "data prepare", "numpy: pip install 'ctxlaunch[data]'"
    )
    result = hiding("tokenizers", *args)
    assert_names_extra(result, "data prepare", "tokenizers: pip install 'ctxlaunch[data]'")
    assert not list(tmp_path.glob("out*"))


def test_report_plots_without_matplotlib_names_the_report_extra(hiding, tmp_path: Path) -> None:
    sweeps = tmp_path / "home" / "sweeps"
    sweeps.mkdir(parents=True)
    record = {"id": "s1", "name": "s", "target": "local", "axes": [], "points": []}
    (sweeps / "s1.json").write_text(json.dumps(record))
    assert hiding("matplotlib", "report", "s1").returncode == 0  # the table needs no extra
    result = hiding("matplotlib", "report", "s1", "--plots", str(tmp_path / "plots"))
    assert_names_extra(result, "report", "matplotlib: pip install 'ctxlaunch[report]'")
    assert not (tmp_path / "plots").exists()


def test_the_trainer_names_a_missing_package_of_the_train_extra(hiding, tmp_path: Path) -> None:
    """torch is there, safetensors (read for init_from) is not: the trainer says so before it
    starts, exit 2, rather than failing in a rank."""
    source = tmp_path / "hf"
    write_tiny_llama(source)
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(tiny_spec(source, tmp_path / "ckpt")))
    result = hiding("safetensors", "train", str(spec), "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 2, result.stderr
    assert "needs the safetensors package: pip install 'ctxlaunch[train]'" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_kubernetes_command_without_the_client_names_the_kubernetes_extra(
    hiding, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kubeconfig the direct transport leaves to the official client (an exec plugin's
    credentials): without the client, submit names the extra that installs it."""
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "c",
                "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
                "clusters": [{"name": "k", "cluster": {"server": "https://127.0.0.1:9"}}],
                "users": [
                    {
                        "name": "u",
                        "user": {
                            "exec": {
                                "apiVersion": "client.authentication.k8s.io/v1",
                                "command": "true",
                            }
                        },
                    }
                ],
            }
        )
    )
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    result = hiding(
        "kubernetes",
        "submit",
        str(JOBS / "demo.yaml"),
        "--set",
        "cluster.target=kubernetes",
        "--set",
        "cluster.kubernetes.image=example/ctxlaunch:1",
    )
    assert_names_extra(result, "submit", "kubernetes: pip install 'ctxlaunch[kubernetes]'")


def test_other_import_errors_are_not_taken_for_a_missing_extra() -> None:
    """A module no extra holds, or one that is installed (a broken submodule inside it), is a
    bug: the error propagates as it is."""

    @needs_extras("train")
    def broken_inside_torch() -> None:
        raise ModuleNotFoundError("No module named 'torch._no_such_part'", name="torch")

    @needs_extras("train")
    def unknown_module() -> None:
        raise ModuleNotFoundError("No module named 'nowhere'", name="nowhere")

    with pytest.raises(ModuleNotFoundError, match="_no_such_part"):
        broken_inside_torch()  # torch itself is installed here
    with pytest.raises(ModuleNotFoundError, match="nowhere"):
        unknown_module()

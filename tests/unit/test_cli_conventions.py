"""The command line's conventions: --version, shell completion, --json on every command that
reports, render's default target, and a Hugging Face hub id in model.init_from answered with
how to download it."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from ctxlaunch import __version__
from ctxlaunch.cli import app
from tests.helpers.cli import CliRunner
from tests.helpers.paths import JOBS, ROOT
from tests.helpers.tiny_hf import write_tiny_llama

CTXLAUNCH = str(Path(sys.executable).parent / "ctxlaunch")
runner = CliRunner()


def run(*args: str):
    return runner.invoke(app, list(args), catch_exceptions=False)


def test_version_prints_the_version_and_exits_0() -> None:
    result = subprocess.run([CTXLAUNCH, "--version"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"ctxlaunch {__version__}"
    # eager: before any command's own parsing, whatever follows it
    assert run("--version", "validate").stdout.strip() == f"ctxlaunch {__version__}"


def test_no_arguments_still_show_the_help() -> None:
    result = subprocess.run([CTXLAUNCH], capture_output=True, text=True, timeout=60)
    assert "Usage: ctxlaunch" in result.stdout + result.stderr
    assert "--install-completion" in result.stdout + result.stderr


def test_shell_completion_completes_commands_and_subcommands() -> None:
    """What the installed completion script asks: the program with _CTXLAUNCH_COMPLETE set."""

    def complete(shell: str, words: str, **env: str) -> str:
        environment = {**os.environ, "_CTXLAUNCH_COMPLETE": f"complete_{shell}", **env}
        if shell == "bash":
            environment |= {"COMP_WORDS": words, "COMP_CWORD": str(len(words.split()) - 1)}
        else:
            environment["_TYPER_COMPLETE_ARGS"] = words
        result = subprocess.run(
            [CTXLAUNCH], capture_output=True, text=True, env=environment, timeout=60
        )
        assert result.returncode == 0, result.stderr
        return result.stdout

    assert complete("bash", "ctxlaunch va").split() == ["validate"]
    assert set(complete("bash", "ctxlaunch s").split()) >= {"submit", "status", "sweep", "schema"}
    assert "prepare" in complete("zsh", "ctxlaunch data pr")
    assert complete("bash", "ctxlaunch examples wa").split() == [
        "walk/extend-8k",
        "walk/pretrain-1k",
    ]
    # The shell named, not detected: typer otherwise takes the shell of the process tree the
    # tests run in (sh under `su` or a CI runner), which may be one it has no script for.
    script = subprocess.run(
        [CTXLAUNCH, "--show-completion", "bash"],
        capture_output=True,
        text=True,
        env={
            **os.environ,
            "SHELL": "/bin/bash",
            "_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION": "1",
        },
        timeout=60,
    )
    assert "_CTXLAUNCH_COMPLETE" in script.stdout, script.stdout + script.stderr


# -- --json --------------------------------------------------------------------------------------
def test_validate_json_reports_the_layout_or_every_problem() -> None:
    result = run("validate", str(JOBS / "llama3-8b-128k-slurm.yaml"), "--json")
    assert result.exit_code == 0
    data = json.loads(result.stdout)
    assert data["ok"] is True and data["name"] == "llama3-8b-128k"
    assert data["target"] == "slurm" and data["nodes"] == 4 and data["gpus_per_node"] == 8
    assert data["parallel"]["cp"] == 8 and data["parallel"]["dp"] == 4
    result = runner.invoke(app, ["validate", str(JOBS / "invalid-ulysses-gqa.yaml"), "--json"])
    assert result.exit_code == 2
    data = json.loads(result.stdout)
    assert data["ok"] is False
    assert [p["path"] for p in data["problems"]] == ["parallel.cp"]
    assert "hybrid" in data["problems"][0]["message"]


def test_list_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ctxlaunch.launch import jobstore

    monkeypatch.setenv("CTXLAUNCH_HOME", str(tmp_path))
    assert json.loads(run("list", "--json").stdout) == []
    record = jobstore.JobRecord(
        id="local-a-1", name="a", target="local", created=time.time(), backend_id="local-a-1"
    )
    record.extra["exit_status"] = 0
    jobstore.save(record)
    listed = json.loads(run("list", "--json").stdout)
    assert [(j["id"], j["name"], j["target"], j["state"]) for j in listed] == [
        ("local-a-1", "a", "local", "COMPLETED")
    ]


def test_submit_and_sweep_dry_run_json_say_what_would_be_submitted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CTXLAUNCH_HOME", str(tmp_path))
    result = run("submit", str(JOBS / "llama3-8b-128k-slurm.yaml"), "--dry-run", "--json")
    data = json.loads(result.stdout)
    assert data["target"] == "slurm" and data["command"][0] == "sbatch"
    assert data["artifact"].startswith("#!/bin/bash")
    result = run("sweep", str(JOBS / "sweeps" / "demo.yaml"), "--dry-run", "--json")
    data = json.loads(result.stdout)
    submissions = data["submissions"]
    assert len(submissions) == 4 and {p["target"] for p in submissions} == {"local"}
    assert [p["runs"] for p in data["points"]] == [True] * 4
    assert all(p["accounting"]["steps"] == 10 for p in data["points"])
    assert data["total"]["gpu_hours"] == sum(
        p["accounting"]["gpu_hours"]["value"] for p in data["points"]
    )
    assert not (tmp_path / "jobs").exists()  # a dry run records nothing


def _tiny_local(tmp_path: Path) -> dict:
    return {
        "name": "tiny",
        "model": {"preset": "tiny", "layers": 1, "dtype": "fp32"},
        "training": {"seq_len": 256, "micro_batch": 1, "global_batch": 1, "steps": 1},
        "cluster": {"target": "local", "gpu": "cpu", "gpus_per_node": 1},
    }


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_submit_json_runs_a_local_job_and_reports_it(tmp_path: Path) -> None:
    """A real local job (torchrun, one rank): stdout is the JSON alone, the job's own lines go
    to stderr, and the exit status is the job's."""
    spec = tmp_path / "tiny.yaml"
    spec.write_text(yaml.safe_dump(_tiny_local(tmp_path)))
    env = {**os.environ, "CTXLAUNCH_HOME": str(tmp_path / "home")}
    result = subprocess.run(
        [CTXLAUNCH, "submit", str(spec), "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=280,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(result.stdout)
    assert data["target"] == "local" and data["name"] == "tiny" and data["exit_status"] == 0
    assert data["backend_id"] == data["id"] and data["id"].startswith("local-tiny-")
    assert "step 1/1" in result.stderr
    listed = subprocess.run(
        [CTXLAUNCH, "list", "--json"], capture_output=True, text=True, env=env, timeout=60
    )
    assert [j["id"] for j in json.loads(listed.stdout)] == [data["id"]]

    def ask(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [CTXLAUNCH, *args], capture_output=True, text=True, env=env, timeout=60
        )

    # The finished job measured against its plan, from its own files.
    status = json.loads(ask("status", data["id"], "--json").stdout)
    measured = status["measured"]
    assert status["state"] == "COMPLETED" and measured["step"] == measured["steps"] == 1
    figures = {f["name"]: f for f in measured["figures"]}
    assert set(figures) == {"step time", "peak memory", "MFU causal", "MFU full", "tokens/s/GPU"}
    for figure in figures.values():
        assert figure["measured"] > 0 and figure["predicted"] > 0
        assert figure["difference"] == pytest.approx(figure["measured"] / figure["predicted"] - 1)
    text = ask("status", data["id"]).stdout
    assert "measured against predicted" in text and "step time" in text and "%" in text
    waited = json.loads(ask("wait", data["id"], "--json").stdout)
    assert waited["state"] == "COMPLETED" and waited["measured"] == measured
    lines = [json.loads(x) for x in ask("logs", data["id"], "--json").stdout.splitlines()]
    assert any(x["line"].startswith("step 1/1  100%") for x in lines)
    assert ask("logs", data["id"], "--rank", "1").returncode == 2  # a 1-rank job
    report = json.loads(ask("report", data["id"], "--json").stdout)
    (row,) = report["rows"]
    assert row["state"] == "COMPLETED" and row["predicted_step_seconds"] > 0


@pytest.mark.distributed
@pytest.mark.timeout(420)
def test_sweep_json_gives_the_job_ids(tmp_path: Path) -> None:
    spec = tmp_path / "tiny.yaml"
    spec.write_text(yaml.safe_dump(_tiny_local(tmp_path)))
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(
        yaml.safe_dump(
            {
                "sweep": {
                    "name": "tiny-sweep",
                    "base": "tiny.yaml",
                    "axes": {"training.seq_len": [128, 256]},
                }
            }
        )
    )
    env = {**os.environ, "CTXLAUNCH_HOME": str(tmp_path / "home")}
    result = subprocess.run(
        [CTXLAUNCH, "sweep", str(sweep), "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=400,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(result.stdout)
    assert data["name"] == "tiny-sweep" and data["target"] == "local"
    assert [p["values"] for p in data["points"]] == [
        {"training.seq_len": 128},
        {"training.seq_len": 256},
    ]
    for point in data["points"]:
        assert point["job"] and point["backend_id"] == point["job"] and point["exit_status"] == 0
    report = subprocess.run(
        [CTXLAUNCH, "report", data["sweep_id"], "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert report.returncode == 0, report.stderr


# -- --json on every command that prints data --------------------------------------------------
NO_JSON = {
    "train": "one rank of the trainer: what it prints is the job's log",
    "schema": "prints the JSON Schema itself (--markdown: the reference page)",
    "dashboard": "hands out the dashboard's JSON file as it is",
    "alerts": "hands out the rule file as it is",
}
"""The commands without --json, and why."""


def _commands() -> dict[str, object]:
    """Every command of the app by its full name (`data prepare`), walked from typer's click
    group."""
    from typer.main import get_command

    found: dict[str, object] = {}

    def walk(command: object, prefix: str) -> None:
        children = getattr(command, "commands", None)
        if children is None:
            found[prefix] = command
            return
        for name, child in children.items():
            walk(child, f"{prefix} {name}".strip())

    walk(get_command(app), "")
    return found


def test_every_command_that_prints_data_takes_json() -> None:
    commands = _commands()
    assert {"init", "wait", "cancel", "image check", "data prepare", "logs"} <= set(commands)
    missing = [
        name
        for name, command in sorted(commands.items())
        if name not in NO_JSON
        and "--json" not in [o for p in getattr(command, "params", []) for o in p.opts]
    ]
    assert not missing, f"commands that print data without --json: {missing}"
    assert set(NO_JSON) <= set(commands)  # no reason kept for a command that is gone


# -- render's target -----------------------------------------------------------------------------
def test_render_targets_the_specs_cluster_target_by_default() -> None:
    spec = str(JOBS / "llama3-8b-128k-slurm.yaml")
    assert run("render", spec).stdout == run("render", spec, "--target", "slurm").stdout
    spec = str(JOBS / "llama3-70b-1m-k8s.yaml")
    assert run("render", spec).stdout == run("render", spec, "-t", "kubernetes").stdout
    result = runner.invoke(app, ["render", str(JOBS / "demo.yaml")])
    assert result.exit_code == 2
    assert "cluster.target is 'local'" in result.stderr and "--target" in result.stderr


# -- a hub id in init_from -----------------------------------------------------------------------
def _init_from_spec(tmp_path: Path, init_from: str) -> Path:
    path = tmp_path / "spec.yaml"
    path.write_text(
        yaml.safe_dump(
            {"name": "x", "model": {"init_from": init_from}, "training": {"seq_len": 1024}}
        )
    )
    return path


def test_a_hub_id_in_init_from_says_how_to_download_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(
        app, ["validate", str(_init_from_spec(tmp_path, "meta-llama/Llama-3.2-1B"))]
    )
    assert result.exit_code == 2
    message = " ".join(result.stderr.split())
    assert (
        "model.init_from meta-llama/Llama-3.2-1B: a Hugging Face hub id, not a local directory; "
        "download it with `hf download meta-llama/Llama-3.2-1B --local-dir DIR` and set "
        "model.init_from: DIR"
    ) in message
    # Spelled as a path, it is one: the ordinary message for a directory that is not there.
    result = runner.invoke(app, ["validate", str(_init_from_spec(tmp_path, "./meta-llama/Llama"))])
    assert result.exit_code == 2 and "hub id" not in result.stderr
    assert "no config.json in ./meta-llama/Llama" in " ".join(result.stderr.split())
    # A local directory of that shape that exists is read as a directory.
    write_tiny_llama(tmp_path / "org" / "tiny-llama")
    result = runner.invoke(app, ["validate", str(_init_from_spec(tmp_path, "org/tiny-llama"))])
    assert result.exit_code == 0, result.stderr


# -- the CLI never names a target ----------------------------------------------------------------
NOT_TARGETS = {("cmd_image.py", "via"), ("extras.py", "EXTRAS")}
"""(module, variable) whose string values share a word with a target but are not targets:
`image check --via local` is a probe mode (this Python, no image); the extras table names the
`kubernetes` extra (the official client), not the target."""


def _strings(node: ast.AST) -> set[str]:
    """The string constants `node` is, or holds as a tuple, list or set display."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return set().union(*(_strings(element) for element in node.elts))
    return set()


def target_name_uses(module: Path) -> list[str]:
    """Each place in `module` that branches on a target by name: a comparison with a target's
    name, a table keyed by one, a subscript or a match case with one."""
    from ctxlaunch.launch.backends import BACKENDS

    targets = set(BACKENDS)
    found: list[tuple[int, str]] = []
    tree = ast.parse(module.read_text(encoding="utf-8"))
    # Tables assigned to a name that is not about targets (NOT_TARGETS).
    exempt_tables = {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign | ast.AnnAssign)
        and any(
            isinstance(t, ast.Name) and (module.name, t.id) in NOT_TARGETS
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
        )
    }
    for node in ast.walk(tree):
        named: set[str] = set()
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            exempt = any(
                isinstance(o, ast.Name) and (module.name, o.id) in NOT_TARGETS for o in operands
            )
            named = set() if exempt else set().union(*(_strings(o) for o in operands))
        elif isinstance(node, ast.Dict) and id(node) not in exempt_tables:
            named = set().union(*(_strings(key) for key in node.keys if key is not None))
        elif isinstance(node, ast.Subscript):
            named = _strings(node.slice)
        elif isinstance(node, ast.MatchValue):
            named = _strings(node.value)
        if named & targets:
            line = getattr(node, "lineno", 0)
            found.append((line, f"{module.name}:{line}: {ast.unparse(node)}"))
    return [text for _, text in sorted(found)]


def test_the_cli_never_names_a_target() -> None:
    """The CLI asks the backend (runs_here, artifact_mode, scheduler_name) and the spec's rules,
    never which target it talks to: a new target then needs no change in the CLI."""
    found = [
        use
        for module in sorted((ROOT / "ctxlaunch" / "cli").rglob("*.py"))
        for use in target_name_uses(module)
    ]
    assert not found, "the CLI branches on a target's name; ask the backend:\n" + "\n".join(found)


def test_the_target_name_check_finds_each_form(tmp_path: Path) -> None:
    """The check above can fail: each form of naming a target is caught, a probe mode is not."""
    module = tmp_path / "cmd_image.py"
    module.write_text(
        "if job.cluster.target == 'local': pass\n"
        "mode = 0o755 if kind in ('slurm',) else 0o644\n"
        "NAMES = {'kubernetes': 'PyTorchJob'}\n"
        "x = BACKENDS['slurm']\n"
        "match target:\n    case 'local': pass\n"
        "if via == 'local': pass\n"
    )
    assert [use.split(":")[1] for use in target_name_uses(module)] == ["1", "2", "3", "4", "6"]
    # A table exempt by its name in one module is caught under another name, or elsewhere.
    extras = tmp_path / "extras.py"
    extras.write_text("EXTRAS = {'kubernetes': ('kubernetes',)}\nOTHER = {'kubernetes': 1}\n")
    assert [use.split(":")[1] for use in target_name_uses(extras)] == ["2"]


def test_status_names_the_scheduler_whose_state_it_shows() -> None:
    """`status` prints a scheduler's own word for a state beside ctxlaunch's, named by the
    backend: Slurm, or the Kubernetes job object's kind."""
    from ctxlaunch.cli.tables import status_line
    from ctxlaunch.launch.backends import get_backend
    from ctxlaunch.launch.backends.base import Status
    from ctxlaunch.launch.jobstore import JobRecord

    state = Status(state="PENDING", scheduler_state="CONFIGURING")
    for target, extra, scheduler in (
        ("slurm", {}, "Slurm"),
        ("kubernetes", {}, "PyTorchJob"),
        ("kubernetes", {"api": "trainjob"}, "TrainJob"),
        ("local", {}, "local"),
    ):
        record = JobRecord(id="j", name="demo", target=target, created=0.0, extra=extra)
        line = status_line(record, state, get_backend(target).scheduler_name(record))
        assert line.startswith(f"j: PENDING ({scheduler}: CONFIGURING) "), line

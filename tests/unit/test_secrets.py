"""Secrets by reference: a `fabric.env` value taken from a Kubernetes Secret's key, from the
submitting environment or from a file is never written into an artifact (batch script,
manifests, the spec the job carries, `submit --dry-run`); the batch script reads it where it
starts, the pod gets a `valueFrom.secretKeyRef`, a local job gets it in its ranks' environment.
Rendered files honour the umask."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest
import yaml

from ctxlaunch.contract.loader import SpecError, validate_spec
from ctxlaunch.launch.env_references import EnvReferenceError, resolve
from ctxlaunch.launch.render import render_files
from tests.helpers.checkpoints import CTXLAUNCH, run_ctxlaunch
from tests.helpers.paths import JOBS
from tests.helpers.shell import shellcheck

TOKEN = "hf_SENTINEL_do_not_write_me_0123456789"


def spec_with(target: str, env: dict) -> dict:
    name = "llama3-8b-128k-slurm.yaml" if target == "slurm" else "llama3-70b-1m-k8s.yaml"
    data = yaml.safe_load((JOBS / name).read_text())
    data["fabric"]["env"] = env
    return data


def test_slurm_script_reads_referenced_values_where_it_starts(tmp_path: Path) -> None:
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "db-pass").write_text(TOKEN + "-file\n")
    spec = validate_spec(
        spec_with(
            "slurm",
            {"HF_TOKEN": {"from_env": "MY_TOKEN"}, "DB_PASS": {"from_file": "~/db-pass"}},
        )
    )
    script = render_files(spec, "slurm")[f"{spec.name}.sbatch"]
    assert TOKEN not in script and "MY_TOKEN" in script
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    shellcheck(path)
    exports = tmp_path / "exports.sh"
    exports.write_text(script.split('\nMASTER_ADDR="$(', 1)[0] + "\nexec env -0\n")
    base_env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path / "home")}
    ran = subprocess.run(
        ["bash", str(exports)], env={**base_env, "MY_TOKEN": TOKEN}, capture_output=True
    )
    assert ran.returncode == 0, ran.stderr
    env = dict(item.decode().split("=", 1) for item in ran.stdout.split(b"\0") if item)
    assert env["HF_TOKEN"] == TOKEN and env["DB_PASS"] == TOKEN + "-file"
    # The variable unset where sbatch ran: the script stops at once, naming it.
    ran = subprocess.run(["bash", str(exports)], env=base_env, capture_output=True, text=True)
    assert ran.returncode != 0
    assert "fabric.env.HF_TOKEN takes its value from MY_TOKEN" in ran.stderr


def test_kubernetes_secret_key_becomes_secret_key_ref(tmp_path: Path) -> None:
    spec = validate_spec(
        spec_with("kubernetes", {"HF_TOKEN": {"secret": {"name": "hf-token", "key": "token"}}})
    )
    files = render_files(spec, "kubernetes")
    _, job = list(yaml.safe_load_all(files[f"{spec.name}.yaml"]))
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        (container,) = replica["template"]["spec"]["containers"]
        (entry,) = [item for item in container["env"] if item["name"] == "HF_TOKEN"]
        assert entry == {
            "name": "HF_TOKEN",
            "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}},
        }


@pytest.mark.parametrize(
    ("target", "reference", "words"),
    [
        ("slurm", {"secret": {"name": "hf", "key": "token"}}, "is a Kubernetes Secret's key"),
        ("kubernetes", {"from_env": "MY_TOKEN"}, "a Kubernetes pod never sees"),
        ("kubernetes", {"from_file": "/etc/token"}, "put the value in a Secret"),
        ("slurm", {"from_env": "MY TOKEN"}, "is not an environment variable name"),
        ("slurm", {"from_env": "A", "from_file": "/b"}, "one reference"),
        ("kubernetes", {"secret": {"name": "Bad_Name", "key": "t"}}, "is not a Secret name"),
    ],
)
def test_a_reference_the_target_cannot_honour_is_refused_at_its_field(
    target: str, reference: dict, words: str
) -> None:
    with pytest.raises(SpecError) as caught:
        validate_spec(spec_with(target, {"HF_TOKEN": reference}))
    assert any(p.path.startswith("fabric.env.HF_TOKEN") for p in caught.value.problems)
    assert words in str(caught.value)


def test_no_artifact_and_no_dry_run_holds_the_value(tmp_path: Path) -> None:
    """Every file `render -o` writes and everything `submit --dry-run` prints, for each
    target, with the token in the submitting environment and in a file."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    env = {**os.environ, "MY_TOKEN": TOKEN, "CTXLAUNCH_HOME": str(tmp_path / "home")}
    for target, reference in (
        ("slurm", {"from_env": "MY_TOKEN"}),
        ("slurm", {"from_file": str(token_file)}),
        ("kubernetes", {"secret": {"name": "hf", "key": "token"}}),
    ):
        spec = tmp_path / f"{target}.yaml"
        spec.write_text(yaml.safe_dump(spec_with(target, {"HF_TOKEN": reference})))
        out = tmp_path / f"out-{target}"
        rendered = run_ctxlaunch("render", str(spec), "-o", str(out), env=env)
        assert rendered.returncode == 0, rendered.stderr
        for path in out.rglob("*"):
            if path.is_file():
                assert TOKEN not in path.read_text(), path
        dry = run_ctxlaunch("submit", str(spec), "--dry-run", "--force", env=env)
        assert dry.returncode == 0, dry.stderr
        assert TOKEN not in dry.stdout + dry.stderr
    demo = yaml.safe_load((JOBS / "demo.yaml").read_text())
    demo["fabric"] = {"env": {"HF_TOKEN": {"from_env": "MY_TOKEN"}}}
    spec = tmp_path / "local.yaml"
    spec.write_text(yaml.safe_dump(demo))
    dry = run_ctxlaunch("submit", str(spec), "--dry-run", env=env)
    assert dry.returncode == 0, dry.stderr
    assert 'export HF_TOKEN="${MY_TOKEN:?' in dry.stdout and TOKEN not in dry.stdout


def test_a_local_job_reads_its_references_or_starts_nothing(tmp_path: Path) -> None:
    (tmp_path / "token").write_text(TOKEN + "\n")
    spec = validate_spec(
        {
            **yaml.safe_load((JOBS / "demo.yaml").read_text()),
            "fabric": {
                "env": {
                    "A": {"from_env": "MY_TOKEN"},
                    "B": {"from_file": str(tmp_path / "token")},
                }
            },
        }
    )
    references = dict(spec.fabric.env)
    os.environ["MY_TOKEN"] = TOKEN
    try:
        assert resolve(references) == {"A": TOKEN, "B": TOKEN}
    finally:
        del os.environ["MY_TOKEN"]
    with pytest.raises(EnvReferenceError, match="MY_TOKEN, which is not set"):
        resolve(references)
    demo = yaml.safe_load((JOBS / "demo.yaml").read_text())
    demo["fabric"] = {"env": {"B": {"from_file": str(tmp_path / "absent")}}}
    path = tmp_path / "local.yaml"
    path.write_text(yaml.safe_dump(demo))
    home = tmp_path / "home"
    result = run_ctxlaunch("submit", str(path), env={**os.environ, "CTXLAUNCH_HOME": str(home)})
    assert result.returncode == 2, result.stderr
    assert "fabric.env.B" in result.stderr and "No such file" in result.stderr
    assert not (home / "jobs").exists() or not any((home / "jobs").iterdir())


@pytest.mark.parametrize(
    ("umask", "script", "manifest"), [(0o077, 0o700, 0o600), (0o022, 0o755, 0o644)]
)
def test_rendered_files_honour_the_umask(
    umask: int, script: int, manifest: int, tmp_path: Path
) -> None:
    for target, mode in (("slurm", script), ("kubernetes", manifest)):
        spec = "llama3-8b-128k-slurm.yaml" if target == "slurm" else "llama3-70b-1m-k8s.yaml"
        out = tmp_path / target
        subprocess.run(
            [
                "bash",
                "-c",
                f'umask {umask:03o} && "$0" render "$1" -o "$2"',
                CTXLAUNCH,
                str(JOBS / spec),
                str(out),
            ],
            check=True,
            capture_output=True,
        )
        files = [p for p in out.rglob("*") if p.is_file()]
        assert files
        for path in files:
            assert stat.S_IMODE(path.stat().st_mode) == mode, (path, oct(path.stat().st_mode))

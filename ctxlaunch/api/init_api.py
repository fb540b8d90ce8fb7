"""A first spec from what the user has: a Hugging Face model (a local directory, or a hub id of
which only config.json is read, when the hub answers), a target sequence length, and the
cluster found in front of them (launch.discover), with the layout `advise` ranks first. The
spec is validated before it is returned; its text carries comments that say where each part
came from."""

from __future__ import annotations

import json
import os
import re
import tempfile
import textwrap
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ctxlaunch.api.errors import ApiError

HUB_ENDPOINT = "https://huggingface.co"
"""The hub's address; HF_ENDPOINT (the hub clients' own variable) replaces it."""
HUB_TIMEOUT_SECONDS = 10.0
TOKENS_PER_STEP = 2**21
"""Tokens per optimizer step a GPU spec starts from (2,097,152: a long-context stage's usual
order; the global batch is this over the sequence length, at least one sequence)."""
HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass(frozen=True)
class Started:
    """What `init` made: the spec's text (YAML with comments), its data, the validated spec,
    the cluster found, and the advice whose first layout it holds."""

    text: str
    data: dict[str, Any]
    spec: Any
    cluster: Any
    advice: Any

    def to_dict(self) -> dict[str, Any]:
        best = self.advice.best if self.advice is not None else None
        return {
            "name": self.data["name"],
            "text": self.text,
            "cluster": {
                "target": self.cluster.target,
                "gpu": self.cluster.gpu,
                "nodes": self.cluster.nodes,
                "gpus_per_node": self.cluster.gpus_per_node,
                "source": self.cluster.source,
            },
            "layout": best.describe() if best is not None else None,
            "step_seconds": best.time.step_seconds if best is not None else None,
        }


def _hub_config(model_id: str) -> dict[str, Any]:
    """The config.json of hub repository `model_id` (nothing else of it is read); ApiError
    where the hub cannot be reached or has none."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        raise ApiError(
            f"{model_id}: a Hugging Face hub id, and the hub is off here (HF_HUB_OFFLINE); "
            f"download it with `hf download {model_id} --local-dir DIR` and give DIR"
        )
    base = os.environ.get("HF_ENDPOINT") or HUB_ENDPOINT
    url = f"{base.rstrip('/')}/{model_id}/resolve/main/config.json"
    try:
        with urllib.request.urlopen(url, timeout=HUB_TIMEOUT_SECONDS) as answer:
            text = answer.read(2**20 + 1)
    except urllib.error.HTTPError as exc:
        raise ApiError(
            f"{model_id}: the hub answered {exc.code} for its config.json (a gated model needs "
            f"`hf download {model_id} --local-dir DIR` with your token); give DIR instead"
        ) from None
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ApiError(
            f"{model_id}: a Hugging Face hub id, and the hub cannot be reached from here "
            f"({reason}); download it with `hf download {model_id} --local-dir DIR` and give DIR"
        ) from None
    if len(text) > 2**20:
        raise ApiError(f"{model_id}: its config.json is over 1 MiB; not a model config")
    try:
        data = json.loads(text)
    except ValueError:
        raise ApiError(f"{model_id}: its config.json is not JSON") from None
    if not isinstance(data, dict):
        raise ApiError(f"{model_id}: its config.json is not a JSON object")
    return data


def _model_section(model: str, on_cpu: bool) -> tuple[dict[str, Any], list[str]]:
    """(the model section, the comment lines above it) for a local directory or a hub id."""
    from ctxlaunch.contract.families.hfconfig import CONFIG_FILE, HFConfigError, model_fields

    dtype = "fp32" if on_cpu else "bf16"
    directory = Path(model).expanduser()
    if (directory / CONFIG_FILE).is_file():
        try:
            model_fields(directory)  # refuse now what the spec would refuse
        except HFConfigError as exc:
            raise ApiError(str(exc)) from None
        return (
            {"init_from": str(directory.resolve()), "dtype": dtype},
            [
                "The shape, RoPE and window come from init_from's config.json; the trainer",
                "loads its weights (safetensors) and checks them against it.",
            ],
        )
    if not HUB_ID.fullmatch(model):
        raise ApiError(
            f"{model}: no {CONFIG_FILE} there, and not a Hugging Face hub id (ORG/NAME); give "
            "a model directory"
        )
    config = _hub_config(model)
    with tempfile.TemporaryDirectory(prefix="ctxlaunch-init-") as scratch:
        Path(scratch, CONFIG_FILE).write_text(json.dumps(config))
        try:
            fields = model_fields(scratch)
        except HFConfigError as exc:
            raise ApiError(str(exc).replace(str(Path(scratch)), model)) from None
    fields["rope_scaling"] = fields["rope_scaling"] or {"type": "default"}
    return (
        {**fields, "dtype": dtype},
        [
            f"The shape of {model}, from its config.json on the hub (only that file was read).",
            f"To start from its weights: `hf download {model} --local-dir DIR`, then replace",
            "these fields with init_from: DIR.",
        ],
    )


def _name(model: str, seq_len: int) -> str:
    """A job name from the model's last path part and the sequence length."""
    stem = re.sub(r"[^a-z0-9]+", "-", Path(model.rstrip("/")).name.lower()).strip("-") or "model"
    suffix = f"-{seq_len // 1024}k" if seq_len >= 1024 else f"-{seq_len}"
    return (stem[: 48 - len(suffix)].strip("-") or "model") + suffix


def init_spec(
    model: str,
    seq_len: int,
    *,
    name: str | None = None,
    target: str | None = None,
    gpu: str | None = None,
    nodes: int | None = None,
    gpus_per_node: int | None = None,
) -> Started:
    """A commented spec that validates for `model` (a Hugging Face directory, or a hub id
    whose config.json only is read) at `seq_len` tokens on the cluster found (or the `target`,
    `gpu` and node shape given), with the layout `advise` ranks first. ApiError for bad input
    or a hub that cannot be reached; SpecError where the spec would not validate."""
    from ctxlaunch.api.plan_api import advise
    from ctxlaunch.contract.loader import apply_overrides, validate_spec
    from ctxlaunch.launch.discover import Cluster, find_cluster

    if seq_len < 1:
        raise ApiError(f"--seq-len {seq_len}: give a positive number of tokens")
    if target not in (None, "local", "slurm", "kubernetes"):
        raise ApiError(f"--target {target}: use local, slurm or kubernetes")
    found = find_cluster(target)
    cluster = Cluster(
        target=found.target,
        gpu=gpu or found.gpu,
        nodes=nodes or found.nodes,
        gpus_per_node=gpus_per_node or found.gpus_per_node,
        source=found.source,
        settings=found.settings,
    )
    on_cpu = cluster.gpu == "cpu"
    section, model_notes = _model_section(model, on_cpu)
    global_batch = cluster.gpus_per_node if on_cpu else max(1, TOKENS_PER_STEP // seq_len)
    data: dict[str, Any] = {
        "name": name or _name(model, seq_len),
        "model": section,
        "training": {
            "seq_len": seq_len,
            "global_batch": global_batch,
            "steps": 1000,
            "data": {"source": "synthetic"},
        },
        "parallel": {},
        "cluster": {
            "target": cluster.target,
            "nodes": cluster.nodes,
            "gpus_per_node": cluster.gpus_per_node,
            "gpu": cluster.gpu,
            **({"slurm": cluster.settings} if cluster.settings else {}),
        },
    }
    advice = advise(data)
    if advice.best is not None:
        changes = {
            **advice.best.layout.overrides(),
            "cluster.nodes": advice.best.nodes,
            "cluster.gpus_per_node": advice.best.gpus_per_node,
        }
        data = apply_overrides(data, [f"{k}={json.dumps(v)}" for k, v in changes.items()])
        data = _without_defaults(data)
    text = _commented(data, model_notes, cluster, advice)
    spec = validate_spec(yaml.safe_load(text), data["name"])
    return Started(text, data, spec, cluster, advice)


def _without_defaults(data: dict[str, Any]) -> dict[str, Any]:
    """The parallel and training sections without the values their fields default to (what
    advise sets to a default need not be said)."""
    from ctxlaunch.contract.spec import ParallelSpec, TrainingSpec

    out = dict(data)
    for key, section in (("parallel", ParallelSpec), ("training", TrainingSpec)):
        fields = section.model_fields
        out[key] = {
            k: v
            for k, v in data[key].items()
            if v is not None
            and not (k in fields and k not in ("seq_len", "steps") and fields[k].default == v)
        }
    if not any(out["training"].get("offload", {}).values()):
        out["training"].pop("offload", None)
    return out


def _commented(data: dict[str, Any], model_notes: list[str], cluster: Any, advice: Any) -> str:
    """The spec as YAML, each section under a comment saying where it came from."""
    from ctxlaunch.contract.hardware import GiB

    best = advice.best if advice is not None else None
    layout = (
        f"the layout `ctxlaunch advise` ranks first: {best.describe()}; predicted "
        f"{best.time.step_seconds:.3g} s a step, {best.memory.total / GiB:.1f} GiB per GPU"
        if best is not None
        else "no layout fits on these GPUs: add nodes (cluster.nodes) or shorten seq_len"
    )
    t = data["training"]
    notes = {
        "model": model_notes,
        "training": textwrap.wrap(
            f"{t.get('global_batch', 1)} sequences of {t['seq_len']:,} tokens per optimizer "
            "step; steps (or training.tokens, a token budget) set the run's length. Synthetic "
            "tokens until yours are tokenized: `ctxlaunch data prepare`, then data: {source: "
            "tokens, path: ...}.",
            96,
        ),
        "parallel": textwrap.wrap(f"From {layout}.", 96),
        "cluster": textwrap.wrap(f"The cluster found: {cluster.source}.", 96),
    }
    lines = [
        "# Written by `ctxlaunch init`. `ctxlaunch plan` on this file gives the whole run (time",
        "# to train, GPU-hours, energy; with cluster.gpu_hour_price, its cost), `ctxlaunch",
        "# advise` the other layouts.",
        yaml.safe_dump({"name": data["name"]}, sort_keys=False).rstrip("\n"),
    ]
    for key in ("model", "training", "parallel", "cluster"):
        if not data.get(key):
            lines += [f"# {line}" for line in notes[key]]
            continue
        lines += [f"# {line}" for line in notes[key]]
        lines.append(yaml.safe_dump({key: data[key]}, sort_keys=False).rstrip("\n"))
    return "\n".join(lines) + "\n"

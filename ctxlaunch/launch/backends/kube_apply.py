"""The objects a Kubernetes submission creates and how they reach the server.

They are parsed from the very text `ctxlaunch render --target kubernetes` writes (one code path,
render.render_files) and applied server-side with field manager `ctxlaunch`, in file order. If
the server refuses one, the ones this submission created before it are deleted again, so a
failed submit leaves no ConfigMap orphaned.
"""

from __future__ import annotations

from typing import Any

from ctxlaunch.contract.rundir import TRAINING, JobEntry
from ctxlaunch.contract.spec import JobSpec
from ctxlaunch.launch.backends.kube_connection import Connection, KubeError
from ctxlaunch.launch.backends.kube_jobs import object_path
from ctxlaunch.launch.render import render_files

FIELD_MANAGER = "ctxlaunch"


def rendered(spec: JobSpec, sweep: str | None = None, entry: JobEntry = TRAINING) -> dict[str, str]:
    """The files `render --target kubernetes` writes for this spec (a sweep's points also carry
    the sweep label; another entry than the trainer changes the pods' command)."""
    return render_files(spec, "kubernetes", sweep=sweep, entry=entry)


def objects_of(files: dict[str, str]) -> list[dict[str, Any]]:
    """The objects in the rendered files, in file order (ConfigMap, PyTorchJob, PodMonitor)."""
    import yaml

    return [doc for text in files.values() for doc in yaml.safe_load_all(text) if doc]


def apply_objects(
    conn: Connection, objects: list[dict[str, Any]], dry_run: bool = False
) -> list[dict[str, Any]]:
    """Server-side apply each object in order (field manager ctxlaunch). If one is refused,
    the objects this call created before it are deleted again, and KubeError says so."""
    query = [("fieldManager", FIELD_MANAGER), ("force", "true")]
    if dry_run:
        query.append(("dryRun", "All"))
    created: list[dict[str, Any]] = []
    applied = []
    for obj in objects:
        meta = obj["metadata"]
        path = object_path(obj["kind"], meta["namespace"], meta["name"])
        try:
            status, answer = conn.request(
                "PATCH", path, body=obj, query=query, content_type="application/apply-patch+yaml"
            )
        except KubeError as exc:
            removed = [o for o in reversed(created) if _delete_quietly(conn, o)]
            undone = (
                (
                    "; removed what was created before it: "
                    + ", ".join(f"{o['kind']} {o['metadata']['name']}" for o in removed)
                )
                if removed
                else ""
            )
            raise KubeError(
                f"the API server refused {obj['kind']} {meta['namespace']}/"
                f"{meta['name']}: {exc}{undone}"
            ) from None
        if status == 201 and not dry_run:
            created.append(obj)
        applied.append(answer)
    return applied


def _delete_quietly(conn: Connection, obj: dict[str, Any]) -> bool:
    """Delete `obj`; whether it was deleted (a failure here must not hide the refusal)."""
    meta = obj["metadata"]
    try:
        return conn.delete(object_path(obj["kind"], meta["namespace"], meta["name"]))
    except KubeError:
        return False

"""The checks made before a Kubernetes submission creates anything: everything the server could
refuse half-way is asked first (the credentials accepted, the job kind's CRD installed, the
namespace there, RBAC allowing each create, no job of that name), each failure one line that
says what to do; a server older than the operator supports gets a warning.
"""

from __future__ import annotations

from ctxlaunch.launch.backends.kube_connection import ApiError, Connection, KubeError
from ctxlaunch.launch.backends.kube_jobs import JOB_APIS, RESOURCES, JobApi, job_path


def has_resource(conn: Connection, group_version: str, resource: str) -> bool:
    """Whether the server serves `resource` in `group_version` (API discovery)."""
    found = conn.get(f"/apis/{group_version}")
    if not found:
        return False
    return any(r.get("name") == resource for r in found.get("resources", []))


def allowed(
    conn: Connection, namespace: str, group: str, resource: str, verb: str
) -> tuple[bool, str]:
    """Ask the server whether this user may `verb` `resource` here (SelfSubjectAccessReview)."""
    review = {
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SelfSubjectAccessReview",
        "spec": {
            "resourceAttributes": {
                "namespace": namespace,
                "verb": verb,
                "group": group,
                "resource": resource,
            }
        },
    }
    _, answer = conn.request(
        "POST",
        "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews",
        body=review,
        content_type="application/json",
    )
    status = answer.get("status", {})
    return bool(status.get("allowed")), status.get("reason", "")


def server_version(conn: Connection) -> tuple[int, int] | None:
    """The API server's (major, minor), None when it does not say."""
    try:
        found = conn.get("/version") or {}
        return int(found["major"]), int(str(found["minor"]).rstrip("+"))
    except (ApiError, KeyError, ValueError):
        return None


def version_warning(conn: Connection, api: JobApi) -> str | None:
    """A warning when the server is older than the job kind's operator supports."""
    version = server_version(conn)
    if version is None or version >= api.min_server:
        return None
    need = ".".join(map(str, api.min_server))
    return (
        f"ctxlaunch: warning: the Kubernetes API server {conn.host} is "
        f"{version[0]}.{version[1]}; {api.operator} {api.version} needs {need} or newer for a "
        f"{api.kind}: going on, but that operator may not run it there"
    )


def preflight(
    conn: Connection,
    namespace: str,
    name: str,
    kinds: list[str],
    api: JobApi = JOB_APIS["pytorchjob"],
) -> bool:
    """Check, before anything is created, what would make the submission fail; raises KubeError
    with one line for the user. Returns whether the PodMonitor kind exists."""
    try:
        crd = has_resource(conn, api.group_version, api.resource)
    except ApiError as exc:
        if exc.status == 401:
            raise KubeError(
                f"the Kubernetes API server {conn.host} rejected the credentials "
                f"(401 Unauthorized){_context_note(conn)}: check the token or "
                "certificate in your kubeconfig"
            ) from None
        raise KubeError(
            f"the Kubernetes API server {conn.host} answered {exc.status}: {exc}"
        ) from None
    if not crd:
        raise KubeError(
            f"the API server {conn.host} has no {api.kind} kind "
            f"({api.group_version}): {api.operator} is not installed there; "
            f"install {api.version} with: {api.install} (it needs Kubernetes "
            f"{'.'.join(map(str, api.min_server))} or newer)"
        )
    try:
        if conn.get(f"/api/v1/namespaces/{namespace}") is None:
            raise KubeError(
                f"namespace {namespace!r} does not exist on {conn.host}: create it "
                f"(kubectl create namespace {namespace}) or set "
                "cluster.kubernetes.namespace"
            )
    except ApiError as exc:
        if exc.status != 403:  # may not read namespaces: the create will tell
            raise
    for kind in kinds:
        group, resource = _group_resource(kind)
        ok, reason = allowed(conn, namespace, group, resource, "create")
        if not ok:
            raise KubeError(
                f"this user may not create {resource}{'.' + group if group else ''}"
                f" in namespace {namespace!r} (RBAC){_context_note(conn)}"
                + (f": {reason}" if reason else "")
                + "; ask the cluster admin for a Role that allows it"
            )
    if conn.get(job_path(namespace, name, api.kind)) is not None:
        raise KubeError(
            f"a {api.kind} {namespace}/{name} already exists: cancel it "
            f"(ctxlaunch cancel {namespace}/{name}) or change the job's name"
        )
    return has_resource(conn, "monitoring.coreos.com/v1", "podmonitors")


def _group_resource(kind: str) -> tuple[str, str]:
    """The API group ("" for the core group) and resource of `kind`, as RBAC names them."""
    prefix, resource = RESOURCES[kind]
    group = prefix.removeprefix("/apis/").rsplit("/", 1)[0] if prefix.startswith("/apis/") else ""
    return group, resource


def _context_note(conn: Connection) -> str:
    return f" for context {conn.context}" if conn.context else ""

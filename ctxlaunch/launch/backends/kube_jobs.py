"""The two job kinds ctxlaunch submits to Kubernetes, a PyTorchJob for the Kubeflow training
operator and a TrainJob for Kubeflow Trainer v2: what each needs on the cluster, the labels and
container names their operators give the pods, and the API path of every kind ctxlaunch creates.

Plain data, no requests: the connection, the checks and the state classification all read it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ctxlaunch.launch import jobstore

OPERATOR_INSTALL = (
    'kubectl apply --server-side -k "github.com/kubeflow/training-operator.git/'
    'manifests/overlays/standalone?ref=v1.9.4"'
)
TRAINER_INSTALL = (
    'kubectl apply --server-side -k "github.com/kubeflow/trainer.git/'
    'manifests/overlays/manager?ref=v2.3.0"'
)
# The training operator's pod labels (kubeflow.org/v1 common_types.go).
JOB_NAME_LABEL = "training.kubeflow.org/job-name"
REPLICA_TYPE_LABEL = "training.kubeflow.org/replica-type"
REPLICA_INDEX_LABEL = "training.kubeflow.org/replica-index"
# JobSet's pod label (Trainer v2 runs a TrainJob as a JobSet of the same name) and the Job
# controller's index of an Indexed Job's pod (Trainer's PET_NODE_RANK).
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
CONTAINER = "pytorch"
TRAINER_CONTAINERS = ("pytorch", "node")
"""The trainer's container: PyTorchJob's and TrainJob's (Trainer v2 constants.Node)."""


@dataclass(frozen=True)
class JobApi:
    """One of the two job kinds ctxlaunch submits, and what the cluster needs for it."""

    kind: str
    group_version: str
    resource: str
    operator: str
    version: str
    install: str
    min_server: tuple[int, int]
    pod_label: str


JOB_APIS: dict[str, JobApi] = {
    "pytorchjob": JobApi(
        "PyTorchJob",
        "kubeflow.org/v1",
        "pytorchjobs",
        "the Kubeflow training operator",
        "v1.9.4",
        OPERATOR_INSTALL,
        (1, 28),
        JOB_NAME_LABEL,
    ),
    "trainjob": JobApi(
        "TrainJob",
        "trainer.kubeflow.org/v1alpha1",
        "trainjobs",
        "Kubeflow Trainer (with JobSet)",
        "v2.3.0",
        TRAINER_INSTALL,
        (1, 31),
        JOBSET_NAME_LABEL,
    ),
}
"""cluster.kubernetes.api -> the job kind; min_server: the Kubernetes version its operator
supports (training-operator 1.9: 1.28+; Trainer 2.3: 1.31+); older servers get a warning."""

RESOURCES: dict[str, tuple[str, str]] = {
    "PyTorchJob": ("/apis/kubeflow.org/v1", "pytorchjobs"),
    "ConfigMap": ("/api/v1", "configmaps"),
    "ServiceAccount": ("/api/v1", "serviceaccounts"),
    "Role": ("/apis/rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "rolebindings"),
    "TrainingRuntime": ("/apis/trainer.kubeflow.org/v1alpha1", "trainingruntimes"),
    "TrainJob": ("/apis/trainer.kubeflow.org/v1alpha1", "trainjobs"),
    "PodMonitor": ("/apis/monitoring.coreos.com/v1", "podmonitors"),
}
"""kind -> (API group/version path, resource): every kind ctxlaunch creates (the pre-flight
permission checks ask in this order)."""


def job_api(record_or_api: jobstore.JobRecord | str) -> JobApi:
    """The job kind of a record (older records are PyTorchJobs) or of an api name."""
    if isinstance(record_or_api, str):
        return JOB_APIS[record_or_api]
    return JOB_APIS[record_or_api.extra.get("api", "pytorchjob")]


def object_path(kind: str, namespace: str, name: str | None = None) -> str:
    """The API path of the `kind` object `name` in `namespace`, or of their collection."""
    prefix, resource = RESOURCES[kind]
    path = f"{prefix}/namespaces/{namespace}/{resource}"
    return f"{path}/{name}" if name else path


def job_path(namespace: str, name: str, kind: str = "PyTorchJob") -> str:
    """The API path of the job `namespace`/`name` (a PyTorchJob unless `kind` says)."""
    return object_path(kind, namespace, name)

"""The cluster section of the job spec: where the job runs (local, Slurm, Kubernetes), on which
GPUs and nodes, with how much host memory."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    PositiveFloat,
    ValidationError,
    field_validator,
    model_validator,
)

from ctxlaunch.contract.hardware import GiB, GpuInfo, GpuType, gpu_info
from ctxlaunch.contract.spec.fields import (
    IMAGE_REF,
    K8S_QUANTITY,
    LABEL_KEY,
    LABEL_VALUE,
    RFC1123_LABEL,
    RFC1123_SUBDOMAIN,
    SLURM_NAME,
    SLURM_TIME,
    UID_MAX,
    PositiveInt,
    _problem,
    _Strict,
)

PROFILE_FORMAT = "ctxlaunch-machine-profile/1"
"""The `format` of a machine profile file (ctxlaunch.perf.machine.save_profile)."""


def _read_profile(path: str) -> dict[str, Any]:
    """A machine profile's JSON object, read with bounds (ValueError saying why not)."""
    from ctxlaunch.contract.bounded import MAX_PROFILE_BYTES, read_bounded_object

    return read_bounded_object(path, MAX_PROFILE_BYTES, "the machine profile")


class SlurmSpec(_Strict):
    """sbatch settings."""

    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time_limit: str = "04:00:00"
    """Slurm time format: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS."""
    exclusive: bool = True
    """Whole nodes: long-context jobs want every GPU, NIC and CPU of a node."""
    requeue: bool = True
    """Requeue on preemption or node failure (the trainer resumes from its checkpoint)."""
    max_restarts: int = Field(3, ge=0)
    """Give up after this many requeues."""
    signal_seconds: int = Field(120, ge=0)
    """Ask Slurm for SIGUSR1 this many seconds before the time limit, to checkpoint; 0 = none."""
    cpus_per_task: PositiveInt | None = None
    """CPU cores per rank; default: Slurm's."""
    mem: str | None = None
    """Host memory per node (sbatch --mem), e.g. 0 for all of it or 512G."""
    log_dir: str = "."
    """Where sbatch writes the job's output (`<name>-<jobid>.out`), relative to the submit
    directory; it must exist when the job starts (sbatch does not create it)."""

    @field_validator("partition", "account", "qos")
    @classmethod
    def _slurm_name(cls, value: str | None) -> str | None:
        if value is not None and not SLURM_NAME.fullmatch(value):
            raise ValueError(
                f"{value!r} is not a Slurm name: use letters, digits, '_', '.', '-' only"
            )
        return value

    @field_validator("time_limit")
    @classmethod
    def _slurm_time(cls, value: str) -> str:
        if not SLURM_TIME.fullmatch(value):
            raise ValueError(
                f"{value!r} is not a Slurm time: use MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or "
                "D-HH:MM:SS"
            )
        return value

    @field_validator("mem")
    @classmethod
    def _slurm_mem(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"^\d+[KMGT]?$", value):
            raise ValueError(f"{value!r} is not a Slurm memory size: e.g. 0, 512G, 480000M")
        return value

    @field_validator("log_dir")
    @classmethod
    def _log_dir(cls, value: str) -> str:
        if not re.fullmatch(r"^[A-Za-z0-9_./\-]+$", value):
            raise ValueError(f"{value!r}: use letters, digits, '_', '.', '-', '/' only")
        return value


class Toleration(_Strict):
    """A Kubernetes toleration."""

    key: str | None = None
    operator: Literal["Exists", "Equal"] = "Equal"
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None


class KubernetesSpec(_Strict):
    """Kubernetes settings: a PyTorchJob (Kubeflow training-operator, kubeflow.org/v1) or a
    TrainJob (Kubeflow Trainer v2, trainer.kubeflow.org/v1alpha1)."""

    api: Literal["pytorchjob", "trainjob"] = "pytorchjob"
    """pytorchjob: a PyTorchJob (training-operator 1.9, Kubernetes 1.28+); trainjob: a TrainJob
    and its own TrainingRuntime (Kubeflow Trainer 2.3, JobSet, Kubernetes 1.31+)."""
    queue: str | None = None
    """Kueue LocalQueue: sets the kueue.x-k8s.io/queue-name label and submits the job
    suspended, for Kueue to admit (PyTorchJob runPolicy.suspend, TrainJob spec.suspend)."""
    scheduler: Literal["volcano", "coscheduling"] | None = None
    """Gang scheduling, so that all nodes start together or none does: volcano (Volcano's
    scheduler and PodGroup) or coscheduling (scheduler-plugins' PodGroup); default none."""
    scheduler_queue: str | None = None
    """Volcano queue of the job's PodGroup (scheduler: volcano only)."""
    schedule_timeout_seconds: PositiveInt | None = None
    """How long the gang may wait for all its pods to be schedulable (coscheduling only;
    Trainer's default 60 s)."""
    namespace: str = "default"
    image: str | None = None
    """Container image with ctxlaunch installed (required for target: kubernetes)."""
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    service_account: str | None = None
    trainer_status: bool = True
    """api trainjob only: rank 0 writes the TrainJob's status.trainerStatus (progress, the
    seconds left, the step's loss, MFU and tokens/s; `kubectl get trainjob -o yaml` shows it)
    through the status subresource. Rendered beside the TrainJob: a Role that may only patch
    that TrainJob's status, its RoleBinding and (unless service_account names one) a
    ServiceAccount; the token is a projected volume in the trainer container only. Creating the
    Role needs that permission yourself (RBAC's escalation check); false renders none of it."""
    mount_service_account_token: bool = False
    """Mount the service account's API token in the pods (automountServiceAccountToken). The
    trainer never calls the API server, so a training pod holds no credential unless this is
    set (for something else in the image that needs one)."""
    run_as_user: Annotated[int, Field(ge=1, le=UID_MAX)] | None = 1000
    """The user (and group) id the pods run as (securityContext runAsUser, runAsGroup and
    fsGroup, so mounted volumes are writable): the project's image (Dockerfile) has user 1000.
    None: the image's own USER, which must then be a numeric id other than 0. Either way the
    pods run with runAsNonRoot, no privilege escalation, every capability dropped (IPC_LOCK
    kept for RDMA) and the runtime's default seccomp profile."""
    run_as_non_root: bool = True
    """Refuse to start a pod whose user is root (securityContext runAsNonRoot). False only for
    an image that cannot run as another user (its root directory or interpreter unreadable to
    others), with run_as_user None: the pods then run as the image's user."""
    node_selector: dict[str, str] = {}
    tolerations: list[Toleration] = []
    image_pull_secrets: list[str] = []
    """Names of Secrets for pulling the image."""
    host_network: bool = False
    """Run pods on the host network (RDMA without a CNI); sets dnsPolicy ClusterFirstWithHostNet."""
    run_dir: str | None = None
    """Where the pods keep the job's run (its events, metrics and exit statuses), a path in the
    container: on a mounted volume they outlive the pod (a healing job's next pod reads them).
    None: a directory of the container's own."""
    shm_size: str = "64Gi"
    """Size limit of the memory-backed /dev/shm (the default 64 MiB breaks NCCL and dataloaders)."""
    rdma_resource: str | None = None
    """RDMA device-plugin resource name, e.g. rdma/ib; default: rdma/ib on InfiniBand/RoCE."""
    rdma_per_node: PositiveInt | None = None
    """RDMA resource count per pod; default: one per GPU."""
    cpu: str | None = None
    """CPU request/limit per pod (Kubernetes quantity)."""
    memory: str | None = None
    """Memory request/limit per pod (Kubernetes quantity)."""
    backoff_limit: int = Field(3, ge=0)
    active_deadline_seconds: PositiveInt | None = None
    ttl_seconds_after_finished: int | None = Field(None, ge=0)
    clean_pod_policy: Literal["None", "Running", "All"] = "None"
    priority_class: str | None = None

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, value: str) -> str:
        if len(value) > 63 or not RFC1123_LABEL.fullmatch(value):
            raise ValueError(
                f"{value!r} is not a valid namespace: an RFC 1123 label (lowercase letters, "
                "digits and '-', starting and ending with a letter or digit, at most 63)"
            )
        return value

    @field_validator("queue", "scheduler_queue")
    @classmethod
    def _queue(cls, value: str | None) -> str | None:
        if value is not None and (len(value) > 63 or not RFC1123_LABEL.fullmatch(value)):
            raise ValueError(
                f"{value!r} is not a valid queue name: an RFC 1123 label (lowercase letters, "
                "digits and '-', at most 63)"
            )
        return value

    @model_validator(mode="after")
    def _scheduler_options(self) -> KubernetesSpec:
        if self.scheduler_queue is not None and self.scheduler != "volcano":
            raise ValueError("scheduler_queue is a Volcano queue: it needs scheduler: volcano")
        if self.schedule_timeout_seconds is not None and self.scheduler != "coscheduling":
            raise ValueError("schedule_timeout_seconds needs scheduler: coscheduling")
        return self

    @field_validator("service_account", "priority_class")
    @classmethod
    def _subdomain(cls, value: str | None) -> str | None:
        if value is not None and (len(value) > 253 or not RFC1123_SUBDOMAIN.fullmatch(value)):
            raise ValueError(
                f"{value!r} is not a valid name: an RFC 1123 subdomain (lowercase letters, "
                "digits, '-' and '.')"
            )
        return value

    @field_validator("image_pull_secrets")
    @classmethod
    def _secrets(cls, value: list[str]) -> list[str]:
        for name in value:
            if len(name) > 253 or not RFC1123_SUBDOMAIN.fullmatch(name):
                raise ValueError(f"{name!r} is not a valid Secret name (RFC 1123 subdomain)")
        return value

    @field_validator("image")
    @classmethod
    def _image(cls, value: str | None) -> str | None:
        if value is not None and not IMAGE_REF.fullmatch(value):
            raise ValueError(f"{value!r} is not an image reference")
        return value

    @field_validator("shm_size", "cpu", "memory")
    @classmethod
    def _quantity(cls, value: str | None) -> str | None:
        if value is not None and not K8S_QUANTITY.fullmatch(value):
            raise ValueError(f"{value!r} is not a Kubernetes quantity (e.g. 64Gi, 96, 1500Mi)")
        return value

    @field_validator("rdma_resource")
    @classmethod
    def _resource(cls, value: str | None) -> str | None:
        if value is not None and not LABEL_KEY.fullmatch(value):
            raise ValueError(f"{value!r} is not a resource name (e.g. rdma/ib)")
        return value

    @field_validator("node_selector")
    @classmethod
    def _labels(cls, value: dict[str, str]) -> dict[str, str]:
        for key, label in value.items():
            if not LABEL_KEY.fullmatch(key) or not LABEL_VALUE.fullmatch(label) or len(label) > 63:
                raise ValueError(f"{key!r}: {label!r} is not a valid label selector pair")
        return value


class ClusterSpec(_Strict):
    """Where the job runs and on what."""

    target: Literal["local", "slurm", "kubernetes"] = "local"
    """local: the submitting machine (torchrun); slurm: the rendered batch script through sbatch
    (the calibration job, a Python function, through submitit); kubernetes: a PyTorchJob or a
    TrainJob (cluster.kubernetes.api)."""
    nodes: PositiveInt = 1
    gpus_per_node: PositiveInt = 1
    """GPUs per node, one rank each (for gpu: cpu, the number of CPU processes)."""
    gpu: GpuType = "H100"
    """GPU type; its memory and peak FLOP/s come from ctxlaunch.contract.hardware.GPUS."""
    host_memory_gib: PositiveFloat | None = None
    """Host (CPU) memory of one node, GiB: what offloading to host memory (training.offload)
    may fill, which `plan` checks. None: the usual node of cluster.gpu (DGX H100 and H200:
    2 TB; ctxlaunch.contract.hardware.HOST_MEMORY_SOURCES); on gpu: cpu, where the host is
    the device, the cpu entry's memory unless stated."""
    slurm: SlurmSpec = SlurmSpec()
    kubernetes: KubernetesSpec = KubernetesSpec()
    gpu_hour_price: PositiveFloat | dict[GpuType, PositiveFloat] | None = None
    """What one GPU-hour costs (in the currency of your choice): one price, or a price per GPU
    type ({H100: 2.5, H200: 3.2}), of which cluster.gpu's is used. With it, `plan`, `advise`
    and `sweep` give the run's cost beside its GPU-hours; `advise --rank-by cost` ranks by it."""
    profile: str | None = None
    """A machine profile (JSON) that `ctxlaunch calibrate SPEC --submit` measured on this
    cluster; plan, advise, telemetry's predicted step and report time the job with it. A
    relative path is taken from the working directory and stored absolute."""

    @field_validator("profile")
    @classmethod
    def _profile_path(cls, value: str | None) -> str | None:
        if value is None:
            return None
        path = Path(value).expanduser().resolve()
        if not path.exists():
            raise ValueError(
                f"{value}: no such file (a machine profile written by "
                "`ctxlaunch calibrate SPEC --submit`)"
            )
        return str(path)

    @model_validator(mode="after")
    def _check_profile(self) -> ClusterSpec:
        if self.profile is None:
            return self
        try:
            data = _read_profile(self.profile)
        except ValueError as exc:
            raise ValidationError.from_exception_data(
                "ClusterSpec",
                [
                    _problem(
                        ("profile",),
                        self.profile,
                        f"not a readable JSON machine profile ({exc})",
                    )
                ],
            ) from None
        gpu = data.get("gpu") if isinstance(data, dict) else None
        if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT:
            raise ValidationError.from_exception_data(
                "ClusterSpec",
                [
                    _problem(
                        ("profile",),
                        self.profile,
                        f"{self.profile}: not a machine profile (no "
                        f"format {PROFILE_FORMAT!r}); write one with `ctxlaunch calibrate SPEC "
                        "--submit`",
                    )
                ],
            )
        if gpu != self.gpu:
            raise ValidationError.from_exception_data(
                "ClusterSpec",
                [
                    _problem(
                        ("profile",),
                        self.profile,
                        f"{self.profile} was measured on gpu {gpu!r}, but "
                        f"cluster.gpu is {self.gpu!r}; fix: calibrate this cluster or name its "
                        "profile",
                    )
                ],
            )
        return self

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def profile_fabric(self) -> str | None:
        """The fabric the named profile was measured over (None: no profile)."""
        if self.profile is None:
            return None
        return str(_read_profile(self.profile).get("fabric"))

    @property
    def gpu_info(self) -> GpuInfo:
        return gpu_info(self.gpu)

    @property
    def price_per_gpu_hour(self) -> float | None:
        """The price of one GPU-hour of cluster.gpu (gpu_hour_price), None where not given."""
        price = self.gpu_hour_price
        if isinstance(price, dict):
            return price.get(self.gpu)
        return price

    @property
    def host_memory_bytes(self) -> int:
        """One node's host memory: host_memory_gib, else the GPU type's usual node's."""
        if self.host_memory_gib is not None:
            return int(self.host_memory_gib * GiB)
        return self.gpu_info.node_host_memory_bytes

"""The cluster side of the job spec: where the job runs (local, Slurm, Kubernetes), on which
GPUs, over which fabric, and how it exports metrics."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    Discriminator,
    Field,
    PositiveFloat,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)

from ctxlaunch.contract.hardware import GiB, GpuInfo, GpuType, NetworkType, gpu_info
from ctxlaunch.contract.spec_base import (
    ENV_NAME,
    IMAGE_REF,
    K8S_QUANTITY,
    LABEL_KEY,
    LABEL_VALUE,
    RFC1123_LABEL,
    RFC1123_SUBDOMAIN,
    SLURM_NAME,
    SLURM_TIME,
    PositiveInt,
    _problem,
    _Strict,
)
from ctxlaunch.contract.spec_secrets import EnvValue

PROFILE_FORMAT = "ctxlaunch-machine-profile/1"
"""The `format` of a machine profile file (ctxlaunch.perf.machine.save_profile)."""


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
    mount_service_account_token: bool = False
    """Mount the service account's API token in the pods (automountServiceAccountToken). The
    trainer never calls the API server, so a training pod holds no credential unless this is
    set (for something else in the image that needs one)."""
    run_as_user: PositiveInt | None = 1000
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
        if not path.is_file():
            raise ValueError(
                f"{value}: no such file (a machine profile written by "
                "`ctxlaunch calibrate SPEC --submit`)"
            )
        return str(path)

    @model_validator(mode="after")
    def _check_profile(self) -> ClusterSpec:
        if self.profile is None:
            return self
        import json

        try:
            data = json.loads(Path(self.profile).read_text())
        except (OSError, ValueError) as exc:
            raise ValidationError.from_exception_data(
                "ClusterSpec",
                [
                    _problem(
                        ("profile",),
                        self.profile,
                        f"{self.profile}: not a readable JSON machine profile ({exc})",
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
        import json

        return str(json.loads(Path(self.profile).read_text()).get("fabric"))

    @property
    def gpu_info(self) -> GpuInfo:
        return gpu_info(self.gpu)

    @property
    def host_memory_bytes(self) -> int:
        """One node's host memory: host_memory_gib, else the GPU type's usual node's."""
        if self.host_memory_gib is not None:
            return int(self.host_memory_gib * GiB)
        return self.gpu_info.node_host_memory_bytes


class FabricSpec(_Strict):
    """The interconnect, and the NCCL environment it needs."""

    nvlink_domain: PositiveInt | None = None
    """GPUs per NVLink/NVSwitch domain; default from the GPU type (8, or 1 for PCIe-only)."""
    network: NetworkType = "infiniband-ndr"
    """Inter-node network; picks the NCCL defaults (see ctxlaunch.contract.hardware.FABRIC_NCCL_ENV)."""
    hcas: list[str] = []
    """HCA names for NCCL_IB_HCA, matched exactly (rendered with a leading '=')."""
    socket_ifname: str | None = None
    """NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME for bootstrap (e.g. eth0, or ^lo,docker)."""
    gid_index: int | None = Field(None, ge=0)
    """NCCL_IB_GID_INDEX; default 3 on RoCE (RoCE v2)."""
    gdr_level: str | None = None
    """NCCL_NET_GDR_LEVEL (LOC, PIX, PXB, PHB, SYS)."""
    topo_file: str | None = None
    """NCCL_TOPO_FILE: a topology XML (cloud VMs)."""
    nccl: dict[str, str] = {}
    """Per-job NCCL/torch variables, overriding the fabric defaults key by key."""
    env: dict[str, EnvValue] = {}
    """Any other environment for the trainer (overrides everything else). A value is text,
    or a reference that keeps a secret out of every rendered file: {secret: {name, key}} (a
    Kubernetes Secret's key), {from_env: NAME} (a variable where sbatch or ctxlaunch runs) or
    {from_file: PATH} (a file's text, read where the job starts)."""

    @field_validator("hcas")
    @classmethod
    def _hcas(cls, value: list[str]) -> list[str]:
        for hca in value:
            if not re.fullmatch(r"^[A-Za-z0-9_]+(:\d+)?$", hca):
                raise ValueError(f"{hca!r} is not an HCA name (e.g. mlx5_0 or mlx5_0:1)")
        return value

    @field_validator("gdr_level")
    @classmethod
    def _gdr(cls, value: str | None) -> str | None:
        if (
            value is not None
            and value not in {"LOC", "PIX", "PXB", "PHB", "SYS"}
            and not value.isdigit()
        ):
            raise ValueError(f"{value!r}: use LOC, PIX, PXB, PHB, SYS or a number")
        return value

    @field_validator("nccl", "env")
    @classmethod
    def _env(cls, value: dict[str, Any]) -> dict[str, Any]:
        for name, setting in value.items():
            if not ENV_NAME.fullmatch(name):
                raise ValueError(f"{name!r} is not an environment variable name")
            if name in SHELL_OWN:
                raise ValueError(
                    f"{name!r} is the shell's own (bash sets or reads it itself): "
                    "choose another name"
                )
            if isinstance(setting, str) and "\x00" in setting:
                raise ValueError(f"{name}: the value contains a NUL byte")
        return value


SHELL_OWN = frozenset(
    {"_", "PWD", "OLDPWD", "SHLVL", "IFS", "SHELLOPTS", "BASHOPTS", "BASH_ENV", "ENV"}
)
"""Names bash sets itself in the batch script (so an export of them would not hold) or reads
at start-up (BASH_ENV and ENV: a file it sources)."""


def _local_path(value: str | None) -> str | None:
    """A directory setting: given, it must be a usable path (not blank, no NUL byte)."""
    if value is None:
        return None
    if not value.strip():
        raise ValueError("an empty path: give a directory, or leave the field out for the default")
    if "\x00" in value:
        raise ValueError(f"{value!r}: the path contains a NUL byte")
    return value


def _name(value: str | None) -> str | None:
    """A name setting: given, it must not be blank."""
    if value is not None and not value.strip():
        raise ValueError("an empty name: give one, or leave the field out for the default")
    return value


class TensorBoardTrackerSpec(_Strict):
    """TensorBoard event files, written by rank 0 (torch.utils.tensorboard.SummaryWriter);
    `tensorboard --logdir <log_dir>` reads them. Needs `pip install 'ctxlaunch[tensorboard]'`."""

    kind: Literal["tensorboard"] = "tensorboard"
    """Which tracker this is."""
    log_dir: str | None = None
    """Where the event files go; default `<run dir>/tensorboard`. A relative path is taken from
    the trainer's working directory (as training.checkpoint.dir)."""

    @field_validator("log_dir")
    @classmethod
    def _log_dir(cls, value: str | None) -> str | None:
        return _local_path(value)


class MlflowTrackerSpec(_Strict):
    """An MLflow run, written by rank 0 through MLflow's client: the resolved spec as its
    parameters, the step and evaluation series as its metrics. Needs
    `pip install 'ctxlaunch[mlflow]'`."""

    kind: Literal["mlflow"] = "mlflow"
    """Which tracker this is."""
    tracking_uri: str | None = None
    """MLflow tracking URI: http(s)://host:port of a tracking server, databricks, a database
    (sqlite:///path, postgresql://...) or file:<path>; default a local file store,
    `file:<run dir>/mlruns` (`mlflow ui --backend-store-uri file:<run dir>/mlruns` shows it)."""
    experiment: str | None = None
    """Experiment name (created if missing); default: the job name."""
    run_name: str | None = None
    """The MLflow run's name; default: the job name and ctxlaunch's run id."""

    @field_validator("tracking_uri")
    @classmethod
    def _tracking_uri(cls, value: str | None) -> str | None:
        if value is None or value == "databricks":
            return value
        if not re.fullmatch(r"^[A-Za-z][A-Za-z0-9+.\-]*:\S+$", value):
            raise ValueError(
                f"{value!r} is not a tracking URI: use http(s)://host:port, databricks, "
                "sqlite:///path, postgresql://..., or file:<path> for a local directory"
            )
        return value

    @field_validator("experiment", "run_name")
    @classmethod
    def _names(cls, value: str | None) -> str | None:
        return _name(value)


WANDB_NAME = re.compile(r"^[^/\\#?%:\s]{1,128}$")
"""What W&B accepts as a project or entity name: up to 128 characters, none of / \\ # ? % :
and no whitespace."""


class WandbTrackerSpec(_Strict):
    """A Weights & Biases run, written by rank 0: the resolved spec as its config, the step and
    evaluation series as its history. Offline by default: the run is written under `dir` and
    nothing is sent until `wandb sync`. Needs `pip install 'ctxlaunch[wandb]'`."""

    kind: Literal["wandb"] = "wandb"
    """Which tracker this is."""
    project: str | None = None
    """W&B project; default: the job name."""
    entity: str | None = None
    """W&B entity (user or team); default: the API key's default entity."""
    mode: Literal["offline", "online"] = "offline"
    """offline: write the run locally only (upload later with `wandb sync <dir>/wandb/
    offline-run-*`); online: stream to the W&B server (needs WANDB_API_KEY and network access
    from rank 0)."""
    dir: str | None = None
    """Where W&B writes its `wandb/` folder; default: the run directory. A relative path is
    taken from the trainer's working directory."""

    @field_validator("project", "entity")
    @classmethod
    def _wandb_name(cls, value: str | None) -> str | None:
        if value is not None and not WANDB_NAME.fullmatch(value):
            raise ValueError(
                f"{value!r} is not a W&B name: 1 to 128 characters, none of / \\ # ? % : "
                "or whitespace"
            )
        return value

    @field_validator("dir")
    @classmethod
    def _dir(cls, value: str | None) -> str | None:
        return _local_path(value)


def _tracker_kind(value: Any) -> str | None:
    """The `kind` of a tracker, given as a mapping or as a model."""
    return value.get("kind") if isinstance(value, dict) else getattr(value, "kind", None)


TrackerSpec = Annotated[
    Annotated[TensorBoardTrackerSpec, Tag("tensorboard")]
    | Annotated[MlflowTrackerSpec, Tag("mlflow")]
    | Annotated[WandbTrackerSpec, Tag("wandb")],
    # A callable discriminator, for an error that names the kinds when `kind` is missing or
    # unknown (a field name's discriminator reports only "Unable to extract tag").
    Discriminator(
        _tracker_kind,
        custom_error_type="tracker_kind",
        custom_error_message="a tracker needs kind: tensorboard, mlflow or wandb",
    ),
]
"""An experiment tracker, chosen by `kind`: tensorboard, mlflow or wandb."""


class TelemetrySpec(_Strict):
    """Prometheus export from every rank, and the experiment trackers rank 0 writes."""

    prometheus: Literal["off", "scrape", "push"] = "off"
    """scrape: each rank serves /metrics on port + local rank; push: ranks push to a
    Pushgateway (batch jobs, Slurm)."""
    port: int = Field(9400, ge=1024, le=65535)
    """First scrape port (rank r on a node uses port + local rank)."""
    bind_address: str | None = None
    """The address /metrics listens on in scrape mode (an IP address of the node, 0.0.0.0 or
    :: for every interface). Default: 127.0.0.1 for cluster.target local (no other machine
    reads a local job's metrics), every interface for Slurm and Kubernetes (Prometheus scrapes
    from elsewhere; the endpoint has no authentication: keep it on a trusted network)."""
    pushgateway_url: str | None = None
    """e.g. http://pushgateway.monitoring:9091 (push mode)."""
    push_interval_seconds: float = Field(15.0, gt=0)
    """How often push mode pushes every series (and once more at the end)."""
    trackers: list[TrackerSpec] = []
    """Experiment trackers rank 0 writes, each at most once: [{kind: tensorboard, log_dir},
    {kind: mlflow, tracking_uri, experiment, run_name}, {kind: wandb, project, entity, mode,
    dir}]. Each logged step: loss, learning rate, gradient norm, tokens/s per GPU, MFU (full
    and causal), peak memory against the planner's prediction; each evaluation: the loss per
    context-length bucket and the passkey grid; at the start, the resolved spec. A tracker
    that cannot start or fails is reported once and left out; training goes on."""

    @field_validator("bind_address")
    @classmethod
    def _bind_address(cls, value: str | None) -> str | None:
        if value is None:
            return None
        import ipaddress

        try:
            ipaddress.ip_address(value)
        except ValueError:
            raise ValueError(
                f"{value!r} is not an IP address (e.g. 127.0.0.1, 0.0.0.0, ::1)"
            ) from None
        return value

    def bind_address_for(self, target: str) -> str:
        """Where /metrics listens for a job on `target`: bind_address, else 127.0.0.1 for a
        local job and every interface elsewhere."""
        if self.bind_address is not None:
            return self.bind_address
        return "127.0.0.1" if target == "local" else "0.0.0.0"

    @field_validator("pushgateway_url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(
            r"^https?://[A-Za-z0-9._\-\[\]:]+(/[\w./\-]*)?$", value
        ):
            raise ValueError(f"{value!r} is not an http(s) URL")
        return value

    @field_validator("trackers")
    @classmethod
    def _one_of_each(cls, value: list[TrackerSpec]) -> list[TrackerSpec]:
        seen: dict[str, int] = {}
        for index, tracker in enumerate(value):
            if tracker.kind in seen:
                raise ValueError(
                    f"trackers[{index}] is a second {tracker.kind} tracker (trackers"
                    f"[{seen[tracker.kind]}] is one): each kind at most once"
                )
            seen[tracker.kind] = index
        return value

    @model_validator(mode="after")
    def _push_needs_url(self) -> TelemetrySpec:
        if self.prometheus == "push" and not self.pushgateway_url:
            raise ValidationError.from_exception_data(
                "TelemetrySpec",
                [
                    _problem(
                        ("pushgateway_url",),
                        None,
                        "telemetry.prometheus = push needs telemetry.pushgateway_url",
                    )
                ],
            )
        return self

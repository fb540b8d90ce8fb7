"""JobSpec -> launch request: the environment, resources and command lines of a job.

This is the one place that decides what a job's environment and resources are; the Slurm and
Kubernetes templates (and the Slurm and local backends) only consume it. All arithmetic and
every decision is here, so the templates hold none.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ctxlaunch.contract import exitcodes
from ctxlaunch.contract.events import EVENTS_FILE, requeue_printf
from ctxlaunch.contract.hardware import COMMON_NCCL_ENV, FABRIC_NCCL_ENV, RDMA_NETWORKS
from ctxlaunch.contract.rundir import (
    POD_MODULE,
    RUN_DIR_ENV,
    SPEC_ENV,
    TRAINER_MODULE,
    TRAINING,
    TRAINJOB_ENV,
    TRAINJOB_TOKEN_DIR,
    JobEntry,
    default_run_dir,
    slurm_rendezvous_port_shell,
    spec_json,
)
from ctxlaunch.contract.spec import JobSpec, KubernetesSpec, SlurmSpec
from ctxlaunch.contract.spec.secret_refs import env_references, plain_env
from ctxlaunch.launch import env_references as references

HEAL_OOM_MODULE = "ctxlaunch.runtime.slurm_oom"
"""What a healing job's batch script asks after a failed step (launch never imports it)."""
POD_RESTART_POLICY = "ExitCode"
K8S_SPEC_DIR = "/etc/ctxlaunch"
K8S_SPEC_FILE = "spec.json"
K8S_MASTER_PORT = 23456
TRAINJOB_MASTER_PORT = 29400
"""Trainer v2's torch plugin sets PET_MASTER_PORT to this (constants.ContainerTrainerPort)."""
TRAINJOB_CONTAINER = "node"
"""The container Trainer v2 injects the PET_* variables into (constants.Node), in the
replicated job named the same."""
PERMANENT_EXITS = sorted({exitcodes.FAILED, exitcodes.BAD_INPUT, exitcodes.OOM})
"""Pod exits that end a TrainJob at once (its Job's podFailurePolicy FailJob, then the JobSet's
FailJobSet rule); any other failure, POD_RETRY included, restarts the JobSet up to
backoff_limit times: the same split as the training operator's restartPolicy ExitCode."""
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
VOLCANO_QUEUE_ANNOTATION = "scheduling.volcano.sh/queue-name"
SCHEDULER_NAMES = {"volcano": "volcano", "coscheduling": "scheduler-plugins-scheduler"}
"""The pods' schedulerName per gang scheduler (coscheduling: the name scheduler-plugins'
second-scheduler deployment runs under)."""


def job_environment(spec: JobSpec) -> dict[str, str]:
    """Environment every rank of the job gets, in precedence order: ctxlaunch's own, the
    fabric's NCCL defaults, values derived from the fabric fields, the job's `fabric.nccl`
    overrides, then `fabric.env`."""
    fabric, cluster, parallel = spec.fabric, spec.cluster, spec.parallel
    env: dict[str, str] = {"PYTHONUNBUFFERED": "1"}
    if cluster.gpu != "cpu":
        env.update(COMMON_NCCL_ENV)
        env.update(FABRIC_NCCL_ENV[fabric.network])
        if fabric.hcas and fabric.network in RDMA_NETWORKS:
            # A leading '=' makes NCCL match the names exactly (mlx5_1 would also match mlx5_10).
            env["NCCL_IB_HCA"] = "=" + ",".join(fabric.hcas)
        gid = (
            fabric.gid_index
            if fabric.gid_index is not None
            else (3 if fabric.network == "roce" else None)
        )
        if gid is not None and fabric.network in RDMA_NETWORKS:
            env["NCCL_IB_GID_INDEX"] = str(gid)
        if fabric.gdr_level:
            env["NCCL_NET_GDR_LEVEL"] = fabric.gdr_level
        if fabric.topo_file:
            env["NCCL_TOPO_FILE"] = fabric.topo_file
        if parallel.tp > 1:
            # Megatron-style TP/CP communication overlap needs kernels queued in issue order.
            env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
        if fabric.socket_ifname:
            env["NCCL_SOCKET_IFNAME"] = fabric.socket_ifname
    if fabric.socket_ifname:
        env["GLOO_SOCKET_IFNAME"] = fabric.socket_ifname
    env.update(fabric.nccl)
    env.update(plain_env(fabric.env))
    # A value given by reference is not here: each target reads it where the job starts
    # (env_references.py), and none is written into an artifact.
    for name in env_references(fabric.env):
        env.pop(name, None)
    return env


# --------------------------------------------------------------------------------------------
# Slurm
# --------------------------------------------------------------------------------------------
class ShellCode(str):
    """Shell text built here from ctxlaunch's own constants (the contract's rules), never from
    spec values: the template's `code` filter emits only this type unquoted."""


@dataclass(frozen=True)
class SlurmRequest:
    """What the sbatch script (and the submitit backend) is made of."""

    job_name: str
    directives: list[str]
    """sbatch options, one per `#SBATCH` line (values are validated to need no quoting)."""
    env: dict[str, str]
    own_env: dict[str, str]
    """ctxlaunch's own variables besides the spec (the run directory), exported after `env`."""
    srun_args: list[str]
    entry_command: list[str]
    """What each task runs: the job entry's module (the trainer, one task per GPU)."""
    max_restarts: int
    requeue: bool
    rendezvous_port_shell: ShellCode
    """The rendezvous port rule as shell arithmetic (contract.rundir), so the script and the
    trainer's own fallback cannot drift apart."""
    requeue_event: ShellCode
    """The batch script's line that reports a requeue and its cause to the job's events file
    (contract.events)."""
    spec_env: str
    spec_json: str
    exit_preempted: int = exitcodes.PREEMPTED
    exit_bad_input: int = exitcodes.BAD_INPUT
    exit_oom: int = exitcodes.OOM
    signal_seconds: int = 0
    """The time limit's signal lead (--signal=B:USR1@N), 0 for none."""
    log_dir: str = "."
    array_specs: list[str] = field(default_factory=list)
    """A job array: task i runs the i-th spec (JSON)."""
    array_run_dir: str | None = None
    run_dir_env: str = RUN_DIR_ENV
    """A job array: task i keeps its metrics and summary in <array_run_dir>/i."""
    env_reference_lines: list[ShellCode] = field(default_factory=list)
    """The lines that export `fabric.env`'s referenced values where the script runs (from
    sbatch's environment or a file: env_references.py)."""
    heal_oom_check: list[str] = field(default_factory=list)
    """training.heal on_oom replan: the command the script runs after a failed step (with the
    step's status) that exits 0 when the step ran out of memory and the job is to be requeued
    to re-plan (ctxlaunch.runtime.slurm_oom); empty otherwise."""


def slurm_request(
    spec: JobSpec,
    python: str = "python3",
    run_dir: str | None = None,
    log_dir: str | None = None,
    array: list[JobSpec] | None = None,
    job_name: str | None = None,
    entry: JobEntry = TRAINING,
) -> SlurmRequest:
    """The sbatch script's parts. `python` runs the job's entry (the trainer) on the nodes, with
    `ranks_per_node` tasks per node (its own count, else one per GPU); `run_dir` (metrics,
    summary, exit statuses) and `log_dir` are set by the Slurm backend to the job's record
    directory, and left to the defaults when rendering for plain sbatch.

    With `array` (the specs of a sweep that share `spec`'s resources and environment), the
    script is a job array: task i runs array[i], in `run_dir`/i."""
    c, s = spec.cluster, spec.cluster.slurm
    log_dir = log_dir or s.log_dir
    ranks_per_node = ranks_per_node_of(spec, entry)
    # training.heal on_allocation_change replan: any node count from min_nodes up; the job
    # re-plans its layout for what it gets.
    directives = sbatch_flags(
        slurm_options(
            s,
            job_name=job_name or spec.name,
            nodes=c.nodes,
            fewest_nodes=spec.training.heal.fewest_nodes(c.nodes),
            ranks_per_node=ranks_per_node,
            gpus_per_node=None if c.gpu == "cpu" else c.gpus_per_node,
            log_dir=log_dir,
            array_size=len(array or []),
        )
    )
    srun_args = [
        "--kill-on-bad-exit=1",
        f"--ntasks-per-node={ranks_per_node}",
        "--label",
    ]
    env = job_environment(spec)
    own_env = {RUN_DIR_ENV: run_dir} if run_dir and not array else {}
    # The trainer's own run directory: $CTXLAUNCH_RUN_DIR (a job array's task sets its own),
    # else its default. Job names are RFC 1123 labels: nothing in them needs quoting.
    events_file = f'"${{{RUN_DIR_ENV}:-{default_run_dir(job_name or spec.name)}}}"/{EVENTS_FILE}'
    return SlurmRequest(
        job_name=job_name or spec.name,
        directives=directives,
        env=env,
        own_env=own_env,
        srun_args=srun_args,
        entry_command=[python, "-u", "-m", entry.module, *entry.args],
        max_restarts=s.max_restarts,
        requeue=s.requeue,
        signal_seconds=s.signal_seconds,
        rendezvous_port_shell=ShellCode(slurm_rendezvous_port_shell("SLURM_JOB_ID")),
        requeue_event=ShellCode(
            requeue_printf(
                events_file, restart_var="restarts", cause_var="cause", exit_var="status"
            )
        ),
        spec_env=SPEC_ENV,
        spec_json=spec_json(spec),
        log_dir=log_dir,
        array_specs=[spec_json(member) for member in array or []],
        array_run_dir=run_dir if array else None,
        env_reference_lines=[
            ShellCode(line) for line in references.shell_lines(env_references(spec.fabric.env))
        ],
        heal_oom_check=(
            [python, "-m", HEAL_OOM_MODULE]
            if spec.training.heal.on_oom == "replan" and s.requeue and not array
            else []
        ),
    )


SlurmOptions = dict[str, str | int | bool]
"""sbatch options by name (without the leading dashes), in the order the batch script lists
them; True for a flag that takes no value (`--exclusive`)."""


def slurm_options(
    s: SlurmSpec,
    *,
    job_name: str,
    nodes: int,
    fewest_nodes: int,
    ranks_per_node: int,
    gpus_per_node: int | None,
    log_dir: str,
    array_size: int = 0,
) -> SlurmOptions:
    """A Slurm job's sbatch options: the one list that the batch script's `#SBATCH` lines
    (`sbatch_flags`) and a function job's submitit parameters (`submitit_parameters`) are both
    made from. `fewest_nodes` below `nodes` asks for a node range; `gpus_per_node` None asks
    for no GPU; `array_size` above 0 makes a job array with one log per task."""
    options: SlurmOptions = {"job-name": job_name}
    if fewest_nodes < nodes:
        # A node range with --ntasks-per-node gets its fewest nodes even when all are idle
        # (the task count follows the minimum; seen on Slurm 22.05, select/cons_tres): ask for
        # the CPUs each node's tasks need instead, and srun places the tasks on what came.
        options["nodes"] = f"{fewest_nodes}-{nodes}"
        options["mincpus"] = ranks_per_node * (s.cpus_per_task or 1)
    else:
        options["nodes"] = nodes
        options["ntasks-per-node"] = ranks_per_node
    if gpus_per_node is not None:
        options["gpus-per-node"] = gpus_per_node
    if s.cpus_per_task:
        options["cpus-per-task"] = s.cpus_per_task
    if s.mem is not None:
        options["mem"] = s.mem
    for flag, value in (("partition", s.partition), ("account", s.account), ("qos", s.qos)):
        if value:
            options[flag] = value
    options["time"] = s.time_limit
    if s.exclusive:
        options["exclusive"] = True
    options["requeue" if s.requeue else "no-requeue"] = True
    if s.signal_seconds:
        # To the batch shell ("B:"), which passes it to the ranks: they checkpoint and exit 75,
        # and the shell requeues the job.
        options["signal"] = f"B:USR1@{s.signal_seconds}"
    if array_size:
        options["array"] = f"0-{array_size - 1}"
    options["output"] = ("" if log_dir == "." else log_dir.rstrip("/") + "/") + (
        "%x-%A_%a.out" if array_size else "%x-%j.out"
    )
    # Requeued runs append to the same log rather than truncating the first run's.
    options["open-mode"] = "append"
    return options


def sbatch_flags(options: SlurmOptions) -> list[str]:
    """The options as sbatch's command-line flags, one per `#SBATCH` line."""
    return [
        f"--{name}" if value is True else f"--{name}={value}" for name, value in options.items()
    ]


SUBMITIT_OWN_OPTIONS = ("job-name", "nodes", "ntasks-per-node")
"""Options that go to submitit as its own parameters: it counts the job's tasks from `nodes`
and `ntasks_per_node` to collect their results."""
SUBMITIT_WRITES_ITS_LOGS = ("output", "open-mode")
"""Options submitit sets itself: it writes the logs in its folder (the job's record directory,
where the batch script's log goes too), appending, and reads them back from there."""


def submitit_parameters(options: SlurmOptions) -> dict[str, Any]:
    """submitit.SlurmExecutor's parameters for a function job with these sbatch options.

    Every option reaches submitit's batch script: the task counts and the name as its own
    parameters; the signal as its `signal_delay_s` (submitit signals its own runner, which
    checkpoints or requeues the call, that long before the time limit; the batch shell the
    `B:` option would reach is submitit's, and traps nothing); the log options not at all
    (SUBMITIT_WRITES_ITS_LOGS); every other one verbatim through `additional_parameters`, in
    the spec's own Slurm syntax (submitit would reformat `time` as minutes, `mem` as GB).
    ValueError for a job array: a function job is one job."""
    extra: dict[str, Any] = {}
    parameters: dict[str, Any] = {"additional_parameters": extra}
    for name, value in options.items():
        if name == "array":
            raise ValueError("a function job is one job, not a job array")
        if name == "signal":
            parameters["signal_delay_s"] = int(str(value).rpartition("@")[2])
        elif name in SUBMITIT_OWN_OPTIONS:
            parameters[name.replace("-", "_")] = value
        elif name not in SUBMITIT_WRITES_ITS_LOGS:
            extra[name.replace("-", "_")] = value
    return parameters


def ranks_per_node_of(spec: JobSpec, entry: JobEntry) -> int:
    """Processes per node of `entry` in `spec`'s job: its own count, else one per GPU."""
    return entry.ranks_per_node or spec.cluster.gpus_per_node


@dataclass(frozen=True)
class SlurmFunctionRequest:
    """A function job on Slurm through submitit's executor: the executor's parameters (the same
    resources, account and queue as the batch script, with the entry's task count) and the
    lines that set the job's environment before the function runs."""

    job_name: str
    options: SlurmOptions
    """The job's sbatch options (`slurm_options`, as the batch script would have them)."""
    parameters: dict[str, Any]
    """For `submitit.SlurmExecutor.update_parameters`: the options, translated
    (`submitit_parameters`)."""
    setup: list[str]
    """Shell lines the job runs first: `export NAME=value` for the job's environment."""
    module: str
    function: str
    args: tuple[str, ...]
    """The function's arguments: the spec (JSON) and the entry's result file, if any."""


def slurm_function_request(spec: JobSpec, entry: JobEntry) -> SlurmFunctionRequest:
    """What submitit needs to run `entry.function` of `entry.module` as a one-node Slurm job of
    `spec`'s cluster: the batch script's own sbatch options (`slurm_options`: partition,
    account, QOS, GPUs, time limit, requeue rule, signal lead) on one node with the entry's
    task count, translated for submitit's executor, and the fabric's environment."""
    import shlex

    c, s = spec.cluster, spec.cluster.slurm
    if entry.function is None:
        raise ValueError(f"the {entry.name} entry has no function to run through submitit")
    options = slurm_options(
        s,
        job_name=spec.name,
        nodes=1,
        fewest_nodes=1,
        ranks_per_node=ranks_per_node_of(spec, entry),
        gpus_per_node=None if c.gpu == "cpu" else c.gpus_per_node,
        log_dir=s.log_dir,
    )
    setup = [f"export {name}={shlex.quote(value)}" for name, value in job_environment(spec).items()]
    setup += references.shell_lines(env_references(spec.fabric.env))
    return SlurmFunctionRequest(
        job_name=spec.name,
        options=options,
        parameters=submitit_parameters(options),
        setup=setup,
        module=entry.module,
        function=entry.function,
        args=(spec_json(spec), *([entry.result_file] if entry.result_file else [])),
    )


# --------------------------------------------------------------------------------------------
# Kubernetes
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ReplicaRequest:
    role: str  # "Master" or "Worker"
    replicas: int


@dataclass(frozen=True)
class KubernetesRequest:
    """What the PyTorchJob manifest is made of."""

    name: str
    namespace: str
    labels: dict[str, str]
    replicas: list[ReplicaRequest]
    nproc_per_node: int
    image: str
    image_pull_policy: str
    command: list[str]
    env: dict[str, str]
    limits: dict[str, str]
    requests: dict[str, str]
    capabilities: list[str]
    host_network: bool
    dns_policy: str | None
    shm_size: str
    spec_dir: str
    spec_file: str
    spec_json: str
    config_map: str
    master_port: int
    node_selector: dict[str, str]
    tolerations: list[dict[str, Any]]
    image_pull_secrets: list[str]
    service_account: str | None
    priority_class: str | None
    restart_policy: str = POD_RESTART_POLICY
    run_policy: dict[str, Any] = field(default_factory=dict)
    elastic_policy: dict[str, Any] = field(default_factory=dict)
    """A PyTorchJob's elasticPolicy (training.heal on_allocation_change replan): the job runs
    on min_nodes to cluster.nodes pods and re-plans its layout for what it gets."""
    api: str = "pytorchjob"
    container: str = "pytorch"
    port_name: str = "pytorchjob-port"
    job_labels: dict[str, str] = field(default_factory=dict)
    """The job object's labels: the pods' plus Kueue's queue label."""
    scheduler_name: str | None = None
    pod_restart_policy: str | None = None
    """Set in the pod spec itself (TrainJob: Never, as a Job's podFailurePolicy needs)."""
    trainjob: TrainJobRequest | None = None
    metrics_ports: list[tuple[str, int]] = field(default_factory=list)
    """(port name, container port) per local rank in scrape mode; the PodMonitor scrapes them."""
    pod_security_context: dict[str, Any] = field(default_factory=dict)
    container_security_context: dict[str, Any] = field(default_factory=dict)
    automount_service_account_token: bool = False
    secret_env: dict[str, dict[str, str]] = field(default_factory=dict)
    """Variables whose value is a Secret's key: name -> the container's
    valueFrom.secretKeyRef."""
    status_access: StatusAccess | None = None
    """A TrainJob whose rank 0 writes its trainerStatus: the RBAC rendered beside it and the
    token mounted in its trainer container."""


@dataclass(frozen=True)
class StatusAccess:
    """What lets a TrainJob's rank 0 write its own status.trainerStatus and nothing else: a
    Role on that one TrainJob's status subresource, bound to the pods' service account (made
    here unless the spec names one), and the token as a projected volume in the trainer
    container only."""

    service_account: str
    create_service_account: bool
    role: str
    """The Role's and the RoleBinding's name."""
    rules: list[dict[str, Any]]
    token_dir: str
    volume: dict[str, Any]
    """The projected volume: a short-lived service-account token and the cluster's CA."""


@dataclass(frozen=True)
class TrainJobRequest:
    """The TrainJob's and its TrainingRuntime's own parts (the pod spec is the request's)."""

    runtime: str
    runtime_labels: dict[str, str]
    num_nodes: int
    suspend: bool
    spec: dict[str, Any]
    """TrainJob spec fields besides runtimeRef and trainer (suspend, activeDeadlineSeconds)."""
    jobset: dict[str, Any]
    """JobSet template spec fields besides replicatedJobs (failurePolicy, ttl)."""
    job: dict[str, Any]
    """The replicated Job's spec fields besides its pod template."""
    pod_group_policy: dict[str, Any]
    annotations: dict[str, str]
    """The JobSet template's annotations, which Trainer propagates (Volcano's queue)."""


SWEEP_LABEL = "ctxlaunch/sweep"


def pod_command(entry: JobEntry) -> list[str]:
    """The container command of a pod running `entry`. The trainer starts through the pod entry
    (torchrun on the trainer, from the PET_* variables the operator sets, exiting with a status
    its ExitCode restart policy reads right); any other entry is one process per pod that
    starts whatever else it needs itself."""
    spec_file = f"{K8S_SPEC_DIR}/{K8S_SPEC_FILE}"
    if entry.module == TRAINER_MODULE:
        return ["python3", "-m", POD_MODULE, spec_file]
    return ["python3", "-m", entry.module, spec_file, *entry.args]


def kubernetes_request(
    spec: JobSpec, sweep: str | None = None, entry: JobEntry = TRAINING
) -> KubernetesRequest:
    """The manifest's parts; `sweep` (a sweep id) adds the label every point of it shares;
    `entry` is what the pods run (the trainer)."""
    c, k = spec.cluster, spec.cluster.kubernetes
    rdma = spec.fabric.network in RDMA_NETWORKS and c.gpu != "cpu"
    limits: dict[str, str] = {}
    if c.gpu != "cpu":
        limits["nvidia.com/gpu"] = str(c.gpus_per_node)
    if rdma:
        limits[k.rdma_resource or "rdma/ib"] = str(k.rdma_per_node or c.gpus_per_node)
    if k.cpu:
        limits["cpu"] = k.cpu
    if k.memory:
        limits["memory"] = k.memory
    # Requests equal limits: a training pod should be Guaranteed, never evicted for pressure.
    requests = dict(limits)
    replicas = [ReplicaRequest("Master", 1)]
    if c.nodes > 1:
        replicas.append(ReplicaRequest("Worker", c.nodes - 1))
    run_policy: dict[str, Any] = {
        "cleanPodPolicy": k.clean_pod_policy,
        "backoffLimit": k.backoff_limit,
    }
    if k.active_deadline_seconds is not None:
        run_policy["activeDeadlineSeconds"] = k.active_deadline_seconds
    if k.ttl_seconds_after_finished is not None:
        run_policy["ttlSecondsAfterFinished"] = k.ttl_seconds_after_finished
    if k.queue:
        run_policy["suspend"] = True  # Kueue admits the job by unsuspending it
    fewest = spec.training.heal.fewest_nodes(c.nodes)
    if k.scheduler:
        run_policy["schedulingPolicy"] = scheduling_policy(k, fewest)
    tolerations = [t.model_dump(exclude_none=True) for t in k.tolerations]
    labels = {
        "app.kubernetes.io/name": "ctxlaunch",
        "ctxlaunch/job": spec.name,
        **({SWEEP_LABEL: sweep} if sweep else {}),
    }
    trainjob = k.api == "trainjob"
    access = status_access(k, spec.name) if trainjob and k.trainer_status else None
    env = job_environment(spec)
    # ctxlaunch's own variables last (the spec's environment cannot name them anyway).
    if k.run_dir:
        env[RUN_DIR_ENV] = k.run_dir
    if access is not None:
        env[TRAINJOB_ENV] = f"{k.namespace}/{spec.name}"
    return KubernetesRequest(
        name=spec.name,
        namespace=k.namespace,
        labels=labels,
        job_labels={**labels, **({QUEUE_LABEL: k.queue} if k.queue else {})},
        replicas=replicas,
        nproc_per_node=ranks_per_node_of(spec, entry),
        image=k.image or "",
        image_pull_policy=k.image_pull_policy,
        command=pod_command(entry),
        restart_policy=POD_RESTART_POLICY,
        env=env,
        secret_env=references.secret_key_refs(env_references(spec.fabric.env)),
        limits=limits,
        requests=requests,
        capabilities=["IPC_LOCK"] if rdma else [],
        pod_security_context=pod_security_context(k),
        container_security_context=container_security_context(["IPC_LOCK"] if rdma else []),
        automount_service_account_token=k.mount_service_account_token,
        host_network=k.host_network,
        dns_policy="ClusterFirstWithHostNet" if k.host_network else None,
        shm_size=k.shm_size,
        spec_dir=K8S_SPEC_DIR,
        spec_file=K8S_SPEC_FILE,
        # The profile is a file on the submitter's machine, not in the pod: the pod's spec
        # leaves it out (a path that is not there would fail the spec's validation).
        spec_json=spec_json(
            spec.model_copy(update={"cluster": spec.cluster.model_copy(update={"profile": None})})
        ),
        config_map=f"{spec.name}-spec",
        master_port=TRAINJOB_MASTER_PORT if trainjob else K8S_MASTER_PORT,
        api=k.api,
        container=TRAINJOB_CONTAINER if trainjob else "pytorch",
        port_name="rendezvous" if trainjob else "pytorchjob-port",
        scheduler_name=SCHEDULER_NAMES[k.scheduler] if k.scheduler else None,
        pod_restart_policy="Never" if trainjob else None,
        trainjob=trainjob_request(k, spec.name, c.nodes, labels) if trainjob else None,
        node_selector=dict(k.node_selector),
        tolerations=tolerations,
        image_pull_secrets=list(k.image_pull_secrets),
        service_account=access.service_account if access is not None else k.service_account,
        status_access=access,
        priority_class=k.priority_class,
        run_policy=run_policy,
        elastic_policy=elastic_policy(k, fewest, c.nodes),
        metrics_ports=[(f"metrics-{r}", spec.telemetry.port + r) for r in range(c.gpus_per_node)]
        if spec.telemetry.prometheus == "scrape"
        else [],
    )


STATUS_TOKEN_SECONDS = 3600
"""The projected token's lifetime: the kubelet rotates it before it expires (the trainer reads
the file at each write)."""


def status_access(k: KubernetesSpec, name: str) -> StatusAccess:
    """The least privilege that lets rank 0 write the TrainJob `name`'s trainerStatus: patch
    (and get) on that TrainJob's status subresource alone."""
    return StatusAccess(
        service_account=k.service_account or f"{name}-status",
        create_service_account=k.service_account is None,
        role=f"{name}-status",
        rules=[
            {
                "apiGroups": ["trainer.kubeflow.org"],
                "resources": ["trainjobs/status"],
                "resourceNames": [name],
                "verbs": ["get", "patch"],
            }
        ],
        token_dir=TRAINJOB_TOKEN_DIR,
        volume={
            "name": "trainjob-status",
            "projected": {
                "sources": [
                    {
                        "serviceAccountToken": {
                            "path": "token",
                            "expirationSeconds": STATUS_TOKEN_SECONDS,
                        }
                    },
                    {
                        "configMap": {
                            "name": "kube-root-ca.crt",
                            "items": [{"key": "ca.crt", "path": "ca.crt"}],
                        }
                    },
                ]
            },
        },
    )


def pod_security_context(k: KubernetesSpec) -> dict[str, Any]:
    """A pod's securityContext: never root (unless run_as_non_root is off), the runtime's
    default seccomp profile, and with
    run_as_user that user and group, which also owns what mounted volumes it writes."""
    context: dict[str, Any] = {
        "runAsNonRoot": k.run_as_non_root,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    if k.run_as_user is not None:
        context.update(runAsUser=k.run_as_user, runAsGroup=k.run_as_user, fsGroup=k.run_as_user)
    return context


def container_security_context(keep: list[str]) -> dict[str, Any]:
    """A container's securityContext: no privilege escalation, every capability dropped but
    `keep` (IPC_LOCK for RDMA: verbs pin memory)."""
    capabilities: dict[str, Any] = {"drop": ["ALL"]}
    if keep:
        capabilities["add"] = keep
    return {"allowPrivilegeEscalation": False, "capabilities": capabilities}


def elastic_policy(k: KubernetesSpec, fewest: int, nodes: int) -> dict[str, Any]:
    """A PyTorchJob's elasticPolicy for a job that may run on `fewest` to `nodes` pods
    (training.heal on_allocation_change replan; none for a job of fixed size or a TrainJob):
    torchrun's c10d rendezvous admits what is there, and the trainer re-plans for it."""
    if fewest >= nodes or k.api != "pytorchjob":
        return {}
    return {
        "rdzvBackend": "c10d",
        "minReplicas": fewest,
        "maxReplicas": nodes,
        "maxRestarts": k.backoff_limit,
    }


def scheduling_policy(k: KubernetesSpec, nodes: int) -> dict[str, Any]:
    """A PyTorchJob's runPolicy.schedulingPolicy: the operator makes a PodGroup of every pod
    (minAvailable: all nodes), for Volcano in its queue, at the pods' priority."""
    policy: dict[str, Any] = {"minAvailable": nodes}
    if k.scheduler_queue:
        policy["queue"] = k.scheduler_queue
    if k.priority_class:
        policy["priorityClass"] = k.priority_class
    if k.schedule_timeout_seconds:
        policy["scheduleTimeoutSeconds"] = k.schedule_timeout_seconds
    return policy


def trainjob_request(
    k: KubernetesSpec, name: str, nodes: int, labels: dict[str, str]
) -> TrainJobRequest:
    """What a TrainJob needs beside the pod spec: suspension for Kueue, the JobSet's restarts
    (failurePolicy) and the Job's permanent exits (podFailurePolicy), the gang's PodGroup."""
    spec: dict[str, Any] = {}
    if k.queue:
        spec["suspend"] = True
    if k.active_deadline_seconds is not None:
        spec["activeDeadlineSeconds"] = k.active_deadline_seconds
    jobset: dict[str, Any] = {
        "failurePolicy": {
            "maxRestarts": k.backoff_limit,
            "rules": [
                {
                    "name": "permanent-exit",
                    "action": "FailJobSet",
                    "onJobFailureReasons": ["PodFailurePolicy"],
                }
            ],
        }
    }
    if k.ttl_seconds_after_finished is not None:
        jobset["ttlSecondsAfterFinished"] = k.ttl_seconds_after_finished
    # backoffLimit 0: one failed pod fails its Job and the JobSet restarts every node together,
    # as torchrun's rendezvous needs.
    job = {
        "backoffLimit": 0,
        "podFailurePolicy": {
            "rules": [
                {
                    "action": "FailJob",
                    "onExitCodes": {
                        "containerName": TRAINJOB_CONTAINER,
                        "operator": "In",
                        "values": PERMANENT_EXITS,
                    },
                }
            ]
        },
    }
    pod_group: dict[str, Any] = {}
    if k.scheduler == "volcano":
        pod_group = {"volcano": {}}
    elif k.scheduler == "coscheduling":
        pod_group = {"coscheduling": {"scheduleTimeoutSeconds": k.schedule_timeout_seconds or 60}}
    return TrainJobRequest(
        runtime=f"{name}-runtime",
        num_nodes=nodes,
        suspend=bool(k.queue),
        runtime_labels={**labels, "trainer.kubeflow.org/framework": "torch"},
        spec=spec,
        jobset=jobset,
        job=job,
        pod_group_policy=pod_group,
        annotations={VOLCANO_QUEUE_ANNOTATION: k.scheduler_queue} if k.scheduler_queue else {},
    )

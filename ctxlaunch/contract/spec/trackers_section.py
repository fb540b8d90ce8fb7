"""The experiment trackers of the telemetry section: TensorBoard, MLflow and Weights &
Biases, each written by rank 0."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Tag, field_validator

from ctxlaunch.contract.spec.fields import _Strict


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
    `file:<run dir>/mlruns`. The `mlflow` extra is the client alone (mlflow-skinny, no UI): to
    browse a file store, `pip install mlflow` and run `MLFLOW_ALLOW_FILE_STORE=true mlflow ui
    --backend-store-uri file:<run dir>/mlruns` (MLflow refuses a file store without it)."""
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

"""The telemetry section of the job spec: Prometheus export from every rank, and the
experiment trackers rank 0 writes."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from ctxlaunch.contract.spec.fields import _problem, _Strict
from ctxlaunch.contract.spec.trackers_section import TrackerSpec


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
    dir}], or by name alone for their defaults ([tensorboard, mlflow]). Each logged step:
    loss, learning rate, gradient norm, tokens/s per GPU, MFU (full and causal), peak memory
    against the planner's prediction; each evaluation: the loss per context-length bucket and
    the passkey grid; at the start, the resolved spec. A tracker that cannot start or fails is
    reported once and left out; training goes on."""

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

    @field_validator("trackers", mode="before")
    @classmethod
    def _names_for_defaults(cls, value: Any) -> Any:
        """A tracker named alone (`trackers: [tensorboard, mlflow]`) is that kind with its
        defaults; an unknown name is then refused as an unknown kind."""
        if isinstance(value, list):
            return [{"kind": item} if isinstance(item, str) else item for item in value]
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

"""Environment values given by reference, so a secret never lands in a rendered artifact.

A `fabric.env` value is text (written into the batch script, the manifests and the spec the job
carries) or a reference to where the value lives:

- `{secret: {name: hf-token, key: token}}`: a key of a Kubernetes Secret in the job's
  namespace, rendered as the container's `valueFrom.secretKeyRef` (Kubernetes only);
- `{from_env: HF_TOKEN}`: a variable of the environment ctxlaunch (and sbatch) runs in: the
  batch script takes it from the environment sbatch passes on (its default `--export=ALL`), a
  local job from ctxlaunch's own (Slurm and local);
- `{from_file: ~/.config/hf/token}`: a file's text, its trailing line break removed, read
  where the job starts: by the batch script on the node that runs it (the file must be there,
  as a home directory on a shared file system is), by ctxlaunch for a local job (Slurm and
  local).

The artifact holds the reference (a name or a path), never the value.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import Discriminator, Tag, field_validator
from pydantic_core import InitErrorDetails

from ctxlaunch.contract.spec.fields import ENV_NAME, RFC1123_SUBDOMAIN, _problem, _Strict

SECRET_KEY = re.compile(r"[-._a-zA-Z0-9]{1,253}")
"""What Kubernetes accepts as a key of a Secret's data."""


class SecretKeyRef(_Strict):
    """A key of a Kubernetes Secret in the job's namespace."""

    name: str
    """The Secret's name (an RFC 1123 subdomain)."""
    key: str
    """The key in the Secret's data (letters, digits, '-', '_', '.')."""

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if len(value) > 253 or not RFC1123_SUBDOMAIN.fullmatch(value):
            raise ValueError(f"{value!r} is not a Secret name (an RFC 1123 subdomain)")
        return value

    @field_validator("key")
    @classmethod
    def _key(cls, value: str) -> str:
        if not SECRET_KEY.fullmatch(value):
            raise ValueError(f"{value!r} is not a Secret key (letters, digits, '-', '_', '.')")
        return value


class EnvFromSecret(_Strict):
    """The value of a Kubernetes Secret's key (valueFrom.secretKeyRef)."""

    secret: SecretKeyRef
    """Which Secret and key."""


class EnvFromSubmitter(_Strict):
    """The value of a variable of the environment the job is submitted from."""

    from_env: str
    """The variable's name there (it may differ from the name the job sees)."""

    @field_validator("from_env")
    @classmethod
    def _env_name(cls, value: str) -> str:
        if not ENV_NAME.fullmatch(value):
            raise ValueError(f"{value!r} is not an environment variable name")
        return value


class EnvFromFile(_Strict):
    """The text of a file (its trailing line break removed), read where the job starts."""

    from_file: str
    """The file's path; `~` is the home directory of whoever starts the job."""

    @field_validator("from_file")
    @classmethod
    def _path(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("an empty path: name the file that holds the value")
        return value


EnvReference = EnvFromSecret | EnvFromSubmitter | EnvFromFile
"""Where an environment value lives, instead of the value itself."""

REFERENCE_KEYS = ("secret", "from_env", "from_file")
"""The key that says which reference a mapping is."""


def _env_kind(value: Any) -> str | None:
    if isinstance(value, str):
        return "text"
    if isinstance(value, dict):
        found = [key for key in REFERENCE_KEYS if key in value]
        return found[0] if len(found) == 1 else None
    if isinstance(value, EnvFromSecret):
        return "secret"
    if isinstance(value, EnvFromSubmitter):
        return "from_env"
    if isinstance(value, EnvFromFile):
        return "from_file"
    return None


EnvValue = Annotated[
    Annotated[str, Tag("text")]
    | Annotated[EnvFromSecret, Tag("secret")]
    | Annotated[EnvFromSubmitter, Tag("from_env")]
    | Annotated[EnvFromFile, Tag("from_file")],
    Discriminator(
        _env_kind,
        custom_error_type="env_value",
        custom_error_message=(
            "an environment value is text, or one reference: {secret: {name, key}} "
            "(Kubernetes), {from_env: NAME} or {from_file: PATH} (Slurm, local)"
        ),
    ),
]
"""A `fabric.env` value: text, or a reference to a Secret's key, a submitter's variable or a
file."""

TARGETS_OF: dict[type, tuple[str, ...]] = {
    EnvFromSecret: ("kubernetes",),
    EnvFromSubmitter: ("slurm", "local"),
    EnvFromFile: ("slurm", "local"),
}


def env_reference_problems(target: str, env: dict[str, Any]) -> list[InitErrorDetails]:
    """A reference the job's target cannot honour, at its field: a Secret outside Kubernetes
    (nothing there can read it), a submitter's variable or file on Kubernetes (the pod never
    sees the submitting machine, and writing the value into the manifest is what a reference
    avoids)."""
    problems: list[InitErrorDetails] = []
    for name, value in env.items():
        targets = TARGETS_OF.get(type(value))
        if targets is None or target in targets:
            continue
        if isinstance(value, EnvFromSecret):
            message = (
                f"fabric.env.{name} is a Kubernetes Secret's key, but cluster.target is "
                f"{target}; use {{from_env: NAME}} or {{from_file: PATH}} there"
            )
        else:
            message = (
                f"fabric.env.{name} comes from the submitting machine, which a Kubernetes pod "
                "never sees; put the value in a Secret and use {secret: {name, key}}"
            )
        problems.append(_problem(("fabric", "env", name), value.model_dump(), message))
    return problems


def plain_env(env: dict[str, Any]) -> dict[str, str]:
    """The values given as text."""
    return {name: value for name, value in env.items() if isinstance(value, str)}


def env_references(env: dict[str, Any]) -> dict[str, EnvReference]:
    """The values given by reference."""
    return {name: value for name, value in env.items() if not isinstance(value, str)}

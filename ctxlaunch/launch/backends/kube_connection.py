"""The connection to a Kubernetes API server: which server and user (the kubeconfig's context,
or the pod's service account), the transport that carries the requests, and the one-line
errors a refused or unreachable server turns into.

The transport is urllib3 directly for a kubeconfig that holds only TLS material and a token
(kuberest.py), else the official `kubernetes` client, which handles everything else (exec
plugins, auth providers, proxies, in-cluster credentials) and is imported only then.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from ctxlaunch.launch import jobstore


class KubeError(RuntimeError):
    """The API server refused or failed a request, or cannot be reached; one line."""


class ApiError(KubeError):
    """The API server answered with an HTTP error; `status` is its code."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class _ClientTransport:
    """kuberest.Direct's `send` through the official client's ApiClient (its auth settings,
    refreshes and proxy)."""

    def __init__(self, api: Any):
        self.api = api

    def send(
        self,
        method: str,
        path: str,
        query: list[tuple[str, str]],
        headers: dict[str, str],
        body: Any,
        timeout: float | None,
    ) -> Any:
        method, url, headers, serialized, post = self.api.param_serialize(
            method,
            path,
            query_params=query,
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        return self.api.call_api(
            method,
            url,
            header_params=headers,
            body=serialized,
            post_params=post,
            _request_timeout=timeout,
        ).response


@dataclass
class Connection:
    """An API client for the user's kubeconfig (KUBECONFIG or ~/.kube/config, its current
    context or `context`), else the pod's service account when run inside a cluster."""

    api: Any
    """The transport: kuberest.Direct, or _ClientTransport (the official client)."""
    host: str
    context: str | None
    kubeconfig: str | None

    @classmethod
    def open(cls, context: str | None = None, kubeconfig: str | None = None) -> Connection:
        """The connection for `context` of `kubeconfig` (defaults: KUBECONFIG or
        ~/.kube/config, and its current context); in a pod without either, its service
        account's."""
        kubeconfig = kubeconfig or os.environ.get("KUBECONFIG") or None
        default = os.path.expanduser("~/.kube/config")
        in_cluster = (
            kubeconfig is None
            and not os.path.exists(default)
            and bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
        )
        if not in_cluster:
            from ctxlaunch.launch.backends import kuberest

            direct = kuberest.load(kubeconfig or default, context)
            if direct is not None:  # no official client needed (kuberest's docstring)
                return cls(direct, direct.host, direct.context, kubeconfig)
        return cls._with_client(context, kubeconfig, default, in_cluster)

    @classmethod
    def _with_client(
        cls, context: str | None, kubeconfig: str | None, default: str, in_cluster: bool
    ) -> Connection:
        """Through the official client: in a pod, and for kubeconfigs kuberest leaves to it."""
        from kubernetes import client, config
        from kubernetes.config.config_exception import ConfigException

        try:
            if in_cluster:
                configuration = client.Configuration()
                config.load_incluster_config(client_configuration=configuration)
                context = "in-cluster"
            else:
                configuration = client.Configuration()
                config.load_kube_config(
                    config_file=kubeconfig or default,
                    context=context,
                    client_configuration=configuration,
                )
                # Record the context by name, so that later status calls reach this server
                # even after the kubeconfig's current context changed.
                context = (
                    context or config.list_kube_config_contexts(kubeconfig or default)[1]["name"]
                )
        except (ConfigException, OSError, ValueError) as exc:
            where = kubeconfig or default
            raise KubeError(
                f"no usable Kubernetes credentials in {where}"
                f"{f' (context {context})' if context else ''}: {exc}"
            ) from None
        configuration.retries = 0  # a refused connection is an answer: fail at once
        return cls(
            _ClientTransport(client.ApiClient(configuration)),
            configuration.host,
            context,
            kubeconfig,
        )

    @classmethod
    def for_record(cls, record: jobstore.JobRecord) -> Connection:
        """The same server and user the job was submitted with."""
        extra = record.extra
        if extra.get("context") == "in-cluster":
            return cls.open()
        return cls.open(extra.get("context"), extra.get("kubeconfig"))

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        query: list[tuple[str, str]] | None = None,
        content_type: str | None = None,
        timeout: float | None = 15.0,
        raw: bool = False,
    ) -> tuple[int, Any]:
        """(HTTP status, decoded JSON body) of one request, or with `raw` the unread urllib3
        response (a log to stream or decode); ApiError for an HTTP error, KubeError when the
        server cannot be reached."""
        from urllib3.exceptions import HTTPError

        headers = {"Accept": "application/json"}
        if content_type:
            headers["Content-Type"] = content_type
        try:
            response = self.api.send(method, path, query or [], headers, body, timeout)
            if raw and response.status < 400:
                return response.status, response
            data = response.read()
        except (HTTPError, OSError) as exc:
            reason = _connection_reason(exc)
            if "CERTIFICATE_VERIFY_FAILED" in reason:
                raise KubeError(
                    f"the Kubernetes API server {self.host} presents a certificate "
                    f"the kubeconfig's certificate-authority does not vouch for "
                    f"({reason})"
                ) from None
            raise KubeError(
                f"cannot reach the Kubernetes API server {self.host}: {reason}"
            ) from None
        if response.status >= 400:
            raise ApiError(response.status, _api_message(response.status, response.reason, data))
        return response.status, json.loads(data) if data else None

    def get(self, path: str, **query: str) -> Any | None:
        """The object at `path`, or None when it does not exist (404)."""
        try:
            return self.request("GET", path, query=list(query.items()))[1]
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    def delete(self, path: str, propagation: str = "Background") -> bool:
        """Delete the object at `path`; False when it was not there."""
        try:
            self.request(
                "DELETE",
                path,
                body={"propagationPolicy": propagation},
                content_type="application/json",
            )
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise
        return True


def _api_message(status: int, reason: str, data: bytes) -> str:
    """The server's own message (a Status object's), else the HTTP status line."""
    try:
        return str(json.loads(data).get("message") or f"{status} {reason}")
    except (TypeError, ValueError, AttributeError):
        return f"{status} {reason}"


def _connection_reason(exc: Exception) -> str:
    """Why the server could not be reached, in words: urllib3's reason without the repr of the
    connection object it names."""
    reason = getattr(exc, "reason", None) or exc
    text = str(reason)
    if "Connection refused" in text:
        return "connection refused (is the server running?)"
    return text.split(": ", 1)[-1] if "object at 0x" in text else text

"""The API server over urllib3 alone, for kubeconfigs that need nothing but a server, TLS
material and a bearer token: what most kubeconfigs hold (kubeadm's admin.conf, a service
account's, a test cluster's).

The official client costs a submit a fifth of a second before its first request (its package
loads its config loader's auth providers, dateutil, requests and oauthlib, which such a
kubeconfig never uses), about as long as `kubectl apply` takes for the whole submission. This
transport reads the same kubeconfig fields the client reads (kubernetes/config/kube_config.py:
server, certificate-authority[-data], insecure-skip-tls-verify, tls-server-name,
client-certificate[-data], client-key[-data], token, tokenFile; relative paths from the
kubeconfig's folder) and passes them to the same urllib3 pool arguments (client/rest.py).
Anything else (an exec plugin, an auth provider, basic auth, a proxy, several kubeconfig files,
a context or user it cannot find) makes `load` return None, and the caller uses the official
client, whose errors and refreshes are the reference.
"""

from __future__ import annotations

import atexit
import base64
import binascii
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

PLAIN_USER_KEYS = frozenset(
    {
        "token",
        "tokenFile",
        "client-certificate",
        "client-certificate-data",
        "client-key",
        "client-key-data",
    }
)
"""The user fields this transport handles; a user with any other field gets the client."""
PLAIN_CLUSTER_KEYS = frozenset(
    {
        "server",
        "certificate-authority",
        "certificate-authority-data",
        "insecure-skip-tls-verify",
        "tls-server-name",
        "extensions",
    }
)


@dataclass
class Direct:
    """One server and user: `send` returns urllib3's unread response."""

    host: str
    context: str
    pool: Any  # urllib3.PoolManager
    authorization: str | None

    def send(
        self,
        method: str,
        path: str,
        query: list[tuple[str, str]],
        headers: dict[str, str],
        body: Any,
        timeout: float | None,
    ) -> Any:
        """`body` (JSON-serialisable, or None) sent as JSON, as the client sends it for JSON
        and structured-YAML content types alike."""
        import urllib3

        headers = dict(headers)
        if self.authorization:
            headers["Authorization"] = self.authorization
        url = self.host + path + (f"?{urlencode(query)}" if query else "")
        data = None if body is None else json.dumps(body).encode()
        return self.pool.request(
            method,
            url,
            body=data,
            headers=headers,
            timeout=urllib3.Timeout(total=timeout),
            preload_content=False,
        )


def load(kubeconfig: str, context: str | None) -> Direct | None:
    """The transport for `context` (default: the current one) of the kubeconfig at
    `kubeconfig`, or None where the official client must be used (see the module's docstring).
    A kubeconfig that cannot be read also gives None: the client then says why."""
    import yaml

    if os.pathsep in kubeconfig:  # several files, merged by the client
        return None
    try:
        with open(kubeconfig) as f:
            config = yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return None
    if not isinstance(config, dict):
        return None
    name = context or config.get("current-context")
    ctx = _named(config.get("contexts"), name, "context")
    if ctx is None:
        return None
    cluster = _named(config.get("clusters"), ctx.get("cluster"), "cluster")
    user = _named(config.get("users"), ctx.get("user"), "user") or {}
    if cluster is None or not isinstance(user, dict) or not isinstance(cluster.get("server"), str):
        return None
    if set(user) - PLAIN_USER_KEYS or set(cluster) - PLAIN_CLUSTER_KEYS:
        return None
    base = os.path.dirname(os.path.abspath(kubeconfig))
    try:
        return _direct(str(name), cluster, user, base)
    except (OSError, ValueError, binascii.Error):
        return None


def _named(items: Any, name: Any, key: str) -> dict[str, Any] | None:
    for item in items or []:
        if isinstance(item, dict) and item.get("name") == name:
            value = item.get(key)
            return value if isinstance(value, dict) else None
    return None


def _direct(name: str, cluster: dict[str, Any], user: dict[str, Any], base: str) -> Direct:
    import urllib3

    host = cluster["server"].rstrip("/")
    token = user.get("token")
    if token is None and user.get("tokenFile"):
        with open(_path(user["tokenFile"], base)) as f:
            token = f.read().strip()
    verify = not cluster.get("insecure-skip-tls-verify", False)
    pool_args: dict[str, Any] = {"retries": 0}  # a refused connection is an answer
    if host.startswith("https"):
        pool_args["cert_reqs"] = "CERT_REQUIRED" if verify else "CERT_NONE"
        pool_args["ca_certs"] = _file(cluster, "certificate-authority", base)
        pool_args["cert_file"] = _file(user, "client-certificate", base)
        pool_args["key_file"] = _file(user, "client-key", base)
        if not verify:
            pool_args["assert_hostname"] = False
        if cluster.get("tls-server-name"):
            pool_args["server_hostname"] = cluster["tls-server-name"]
    return Direct(
        host=host,
        context=name,
        pool=urllib3.PoolManager(**pool_args),
        authorization=f"Bearer {token}" if token else None,
    )


def _path(path: str, base: str) -> str:
    return path if os.path.isabs(path) else os.path.join(base, path)


def _file(node: dict[str, Any], key: str, base: str) -> str | None:
    """The file holding `key`: its path, or its base64 `-data` written to a private temporary
    file (as the client does; removed when the process ends)."""
    data = node.get(f"{key}-data")
    if data:
        directory = _private_dir()
        fd, path = tempfile.mkstemp(dir=directory)
        with os.fdopen(fd, "wb") as f:
            f.write(base64.standard_b64decode(data))
        return path
    named = node.get(key)
    if not named:
        return None
    path = _path(str(named), base)
    if not os.path.isfile(path):
        raise OSError(f"{key} {path} does not exist")
    return path


_PRIVATE: list[str] = []


def _private_dir() -> str:
    if not _PRIVATE:
        _PRIVATE.append(tempfile.mkdtemp(prefix="ctxlaunch-kube-"))
        atexit.register(shutil.rmtree, _PRIVATE[0], True)
    return _PRIVATE[0]

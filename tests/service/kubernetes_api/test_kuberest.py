"""The urllib3 transport (ctxlaunch/launch/backends/kuberest.py) against the real API server
(scripts/services/kubernetes.sh): a plain kubeconfig reaches the server without importing the
official client, embedded (-data) and relative-path TLS material work as the client reads them,
and a kubeconfig it does not handle (here an exec credential plugin, run for real) goes through
the official client and reaches the same server."""

from __future__ import annotations

import base64
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ctxlaunch.launch.backends import kuberest
from tests.helpers.services import KUBE_ADMIN, require_kubernetes


@pytest.fixture(scope="module", autouse=True)
def kube() -> None:
    require_kubernetes()


def admin() -> dict:
    return yaml.safe_load(KUBE_ADMIN.read_text())


def write(tmp_path: Path, config: dict) -> Path:
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(config))
    return path


def open_and_get(kubeconfig: Path) -> dict:
    """In a fresh interpreter: open a Connection, GET /version, and say whether the official
    client was imported."""
    code = (
        "import json, sys\n"
        "from ctxlaunch.launch.backends.kube_connection import Connection\n"
        f"conn = Connection.open(kubeconfig={str(kubeconfig)!r})\n"
        "version = conn.get('/version')\n"
        "print(json.dumps({'git': version['gitVersion'], 'context': conn.context,\n"
        "                  'client': 'kubernetes' in sys.modules}))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.timeout(60)
def test_a_plain_kubeconfig_reaches_the_server_without_the_official_client() -> None:
    answer = open_and_get(KUBE_ADMIN)
    assert answer["git"].startswith("v1.")
    assert answer["context"] == admin()["current-context"]
    assert answer["client"] is False


@pytest.mark.timeout(60)
def test_embedded_and_relative_certificate_authorities(tmp_path: Path) -> None:
    config = admin()
    cluster = config["clusters"][0]["cluster"]
    ca = Path(cluster.pop("certificate-authority"))
    cluster["certificate-authority-data"] = base64.b64encode(ca.read_bytes()).decode()
    assert open_and_get(write(tmp_path, config))["client"] is False
    (tmp_path / "pki").mkdir()
    (tmp_path / "pki" / "ca.crt").write_bytes(ca.read_bytes())
    del cluster["certificate-authority-data"]
    cluster["certificate-authority"] = "pki/ca.crt"  # relative to the kubeconfig's folder
    assert open_and_get(write(tmp_path, config))["client"] is False


@pytest.mark.timeout(60)
def test_a_token_file_is_read(tmp_path: Path) -> None:
    config = admin()
    user = config["users"][0]["user"]
    (tmp_path / "token").write_text(user.pop("token") + "\n")
    user["tokenFile"] = str(tmp_path / "token")
    assert open_and_get(write(tmp_path, config))["client"] is False


@pytest.mark.timeout(60)
def test_an_exec_plugin_goes_through_the_official_client(tmp_path: Path) -> None:
    config = admin()
    token = config["users"][0]["user"].pop("token")
    plugin = tmp_path / "credential-plugin"
    credential = {
        "apiVersion": "client.authentication.k8s.io/v1beta1",
        "kind": "ExecCredential",
        "status": {"token": token},
    }
    plugin.write_text(f"#!/bin/sh\necho '{json.dumps(credential)}'\n")
    plugin.chmod(plugin.stat().st_mode | stat.S_IXUSR)
    config["users"][0]["user"]["exec"] = {
        "apiVersion": "client.authentication.k8s.io/v1beta1",
        "command": str(plugin),
    }
    path = write(tmp_path, config)
    assert kuberest.load(str(path), None) is None
    answer = open_and_get(path)
    assert answer["client"] is True and answer["git"].startswith("v1.")


def test_what_the_transport_leaves_to_the_client(tmp_path: Path) -> None:
    config = admin()
    path = write(tmp_path, config)
    assert kuberest.load(str(path), None) is not None
    assert kuberest.load(str(path), "no-such-context") is None
    assert kuberest.load(f"{path}{os.pathsep}{path}", None) is None  # merged files
    config["clusters"][0]["cluster"]["proxy-url"] = "http://127.0.0.1:3128"
    assert kuberest.load(str(write(tmp_path, config)), None) is None
    assert kuberest.load(str(tmp_path / "absent"), None) is None

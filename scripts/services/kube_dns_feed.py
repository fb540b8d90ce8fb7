"""The DNS stand-in's feeder (no CoreDNS is packaged here): polls the API server's Endpoints and
Services and keeps one hosts file that dnsmasq (started by scripts/services/kubernetes.sh with
--hostsdir) serves, the way CoreDNS's kubernetes plugin answers for headless services:

    <pod ip>  <service>.<namespace>.svc.cluster.local

for every ready address of every Service's Endpoints, and the cluster IP for a Service that has
one. Run by kubernetes.sh with the project's .venv Python (PyYAML reads the kubeconfig):

    kube_dns_feed.py --kubeconfig FILE --hosts-dir DIR [--interval SECONDS]
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
import sys
import time
import urllib.request
from pathlib import Path

import yaml

DOMAIN = "svc.cluster.local"


def connection(kubeconfig: Path) -> tuple[str, ssl.SSLContext, str]:
    config = yaml.safe_load(kubeconfig.read_text())
    cluster = config["clusters"][0]["cluster"]
    user = config["users"][0]["user"]
    context = ssl.create_default_context(cafile=cluster["certificate-authority"])
    return cluster["server"], context, user["token"]


def get(server: str, context: ssl.SSLContext, token: str, path: str) -> dict:
    request = urllib.request.Request(server + path, headers={"Authorization": f"Bearer {token}"})
    opener = urllib.request.build_opener(
        urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=context)
    )
    with opener.open(request, timeout=10) as response:
        return json.loads(response.read())


def hosts_lines(services: dict, endpoints: dict) -> list[str]:
    lines = []
    for svc in services.get("items", []):
        meta, spec = svc["metadata"], svc.get("spec", {})
        ip = spec.get("clusterIP")
        if ip and ip != "None":
            lines.append(f"{ip} {meta['name']}.{meta['namespace']}.{DOMAIN}")
    for ep in endpoints.get("items", []):
        meta = ep["metadata"]
        for subset in ep.get("subsets") or []:
            for address in subset.get("addresses") or []:
                lines.append(f"{address['ip']} {meta['name']}.{meta['namespace']}.{DOMAIN}")
    return sorted(set(lines))


def name_process(name: str) -> None:
    """Set the process's command name (what kubernetes.sh's pidfile check reads in
    /proc/PID/comm) from "python3" to `name`."""
    import ctypes

    libc = ctypes.CDLL(None)
    libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME


def main(argv: list[str] | None = None) -> int:
    name_process("kube-dns-feed")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kubeconfig", type=Path, required=True)
    parser.add_argument("--hosts-dir", type=Path, required=True)
    parser.add_argument("--interval", type=float, default=0.5)
    args = parser.parse_args(argv)
    server, context, token = connection(args.kubeconfig)
    args.hosts_dir.mkdir(parents=True, exist_ok=True)
    target = args.hosts_dir / "services"
    written = None
    while True:
        try:
            lines = hosts_lines(
                get(server, context, token, "/api/v1/services"),
                get(server, context, token, "/api/v1/endpoints"),
            )
        except OSError as exc:
            print(f"kube-dns-feed: {exc}", file=sys.stderr, flush=True)
            time.sleep(2.0)
            continue
        text = "".join(line + "\n" for line in lines)
        if text != written:
            tmp = args.hosts_dir / ".services.tmp"
            tmp.write_text(text)
            os.replace(tmp, target)  # dnsmasq sees the rename (inotify) and re-reads it
            written = text
        time.sleep(args.interval)


if __name__ == "__main__":
    sys.exit(main())

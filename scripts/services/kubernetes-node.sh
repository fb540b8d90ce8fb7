#!/usr/bin/env bash
# The single-node Kubernetes cluster: kubernetes.sh with CTXLAUNCH_KUBE_NODE=1 (etcd,
# kube-apiserver, kube-controller-manager, kube-scheduler, kubelet with containerd + runc, the
# bridge CNI and dnsmasq as the service DNS), in $CTXLAUNCH_SERVICES_DIR/kubernetes-node on
# https://127.0.0.1:6543 (etcd 2479), beside the API-server-only instance of kubernetes.sh.
# Usage: scripts/services/kubernetes-node.sh install|start|stop|restart|status|env
set -euo pipefail
CTXLAUNCH_KUBE_NODE=1 exec "$(dirname "${BASH_SOURCE[0]}")/kubernetes.sh" "$@"

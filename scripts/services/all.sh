#!/usr/bin/env bash
# Every real service the tests use: Slurm (with accounting), Prometheus + Pushgateway, a
# Kubernetes API server (etcd + kube-apiserver with the PyTorchJob CRD) and a single-node
# Kubernetes cluster beside it (kubernetes-node.sh: the same with a kubelet, a scheduler, a
# controller manager and containerd). The node's four binaries are built in one make the first
# time (5 min 12 s on a quiet 2-core machine), and that build's kube-apiserver serves the API server
# alone too, so the node is installed first. CTXLAUNCH_KUBE_NODE_TESTS=0 leaves the node out
# (its tests then skip, saying so).
#
# Usage: scripts/services/all.sh install|start|stop|restart|status
#
# install and start run slurm.sh, prometheus.sh, kubernetes-node.sh then kubernetes.sh; stop runs them in reverse
# order. stop goes on to the next service when one fails and reports the failure at the end.
# See slurm.sh, prometheus.sh and kubernetes.sh for what each does and the environment variables
# they read (CTXLAUNCH_SERVICES_DIR, CTXLAUNCH_PROMETHEUS_PORT, CTXLAUNCH_KUBE_PORT, ...).
set -euo pipefail

readonly PROG="all.sh"
# shellcheck source=scripts/services/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
readonly SCRIPT_DIR
case "${CTXLAUNCH_KUBE_NODE_TESTS:-1}" in
    0) readonly SERVICES=(slurm prometheus kubernetes) ;;
    1) readonly SERVICES=(slurm prometheus kubernetes-node kubernetes) ;;
    *) die "CTXLAUNCH_KUBE_NODE_TESTS must be 0 or 1, got '$CTXLAUNCH_KUBE_NODE_TESTS'" ;;
esac
# kubernetes.sh runs the API server alone; kubernetes-node.sh sets CTXLAUNCH_KUBE_NODE=1 itself.
export CTXLAUNCH_KUBE_NODE=0

run_in_order() { # action service...: stop at the first failure
    local action="$1" service
    shift
    for service in "$@"; do
        "$SCRIPT_DIR/$service.sh" "$action"
    done
}

run_all() { # action service...: run every one, fail at the end if any failed
    local action="$1" service failed=()
    shift
    for service in "$@"; do
        "$SCRIPT_DIR/$service.sh" "$action" || failed+=("$service")
    done
    if [ "${#failed[@]}" -gt 0 ]; then
        printf '%s: %s failed for: %s\n' "$PROG" "$action" "${failed[*]}" >&2
        return 1
    fi
}

reversed_services() {
    local i
    for ((i = ${#SERVICES[@]} - 1; i >= 0; i--)); do
        echo "${SERVICES[i]}"
    done
}

main() {
    [ "$#" -eq 1 ] || usage
    local reversed
    mapfile -t reversed < <(reversed_services)
    case "$1" in
        install | start) run_in_order "$1" "${SERVICES[@]}" ;;
        stop) run_all stop "${reversed[@]}" ;;
        restart)
            run_all stop "${reversed[@]}"
            run_in_order start "${SERVICES[@]}"
            ;;
        status) run_all status "${SERVICES[@]}" ;;
        *) usage ;;
    esac
}

main "$@"

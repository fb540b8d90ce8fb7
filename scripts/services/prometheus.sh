#!/usr/bin/env bash
# A real Prometheus and Pushgateway for the tests, on loopback, without systemd.
#
# Usage: scripts/services/prometheus.sh install|start|stop|restart|status
#
#   install  apt-get prometheus, prometheus-pushgateway (and curl); no-op when present
#   start    generate the config, start the Pushgateway and Prometheus (fresh: empty TSDB, empty
#            targets and rules dirs) and wait for /-/ready on both; when they run already:
#            check them and reload the config if it changed
#   stop     stop both by the PIDs in their pidfiles
#   status   show what runs; exit 0 only when both run and are ready
#
# Prometheus scrapes every 1 s: the Pushgateway (job "pushgateway") and, as job "ctxlaunch", every
# target listed in $DIR/targets/*.json (file_sd, re-read every 1 s), both with honor_labels. Rule
# files are $DIR/rules/*.yml: drop one in and POST /-/reload (or send SIGHUP). Here
# DIR=$CTXLAUNCH_SERVICES_DIR/prometheus (default /var/tmp/ctxlaunch-services/prometheus).
#
# Environment:
#   CTXLAUNCH_SERVICES_DIR       base state directory (default /var/tmp/ctxlaunch-services)
#   CTXLAUNCH_PROMETHEUS_PORT    Prometheus port on 127.0.0.1 (default 9090)
#   CTXLAUNCH_PUSHGATEWAY_PORT   Pushgateway port on 127.0.0.1 (default 9091)
#   CTXLAUNCH_SERVICES_TIMEOUT   seconds to wait for each daemon (default 30)
set -euo pipefail

readonly PROG="prometheus.sh"
readonly BASE_DIR="${CTXLAUNCH_SERVICES_DIR:-/var/tmp/ctxlaunch-services}"
readonly STATE_DIR="$BASE_DIR/prometheus"
readonly RUN_DIR="$STATE_DIR/run"
readonly LOG_DIR="$STATE_DIR/log"
readonly TARGETS_DIR="$STATE_DIR/targets"
readonly RULES_DIR="$STATE_DIR/rules"
readonly TSDB_DIR="$STATE_DIR/tsdb"
readonly CONFIG_FILE="$STATE_DIR/prometheus.yml"
readonly PROMETHEUS_PORT="${CTXLAUNCH_PROMETHEUS_PORT:-9090}"
readonly PUSHGATEWAY_PORT="${CTXLAUNCH_PUSHGATEWAY_PORT:-9091}"
readonly PROMETHEUS_URL="http://127.0.0.1:$PROMETHEUS_PORT"
readonly PUSHGATEWAY_URL="http://127.0.0.1:$PUSHGATEWAY_PORT"
readonly TIMEOUT="${CTXLAUNCH_SERVICES_TIMEOUT:-30}"

readonly PACKAGES=(prometheus prometheus-pushgateway curl)
# Daemons in start order, named by their executable.
readonly DAEMONS=(prometheus-pushgateway prometheus)

log() { printf '%s: %s\n' "$PROG" "$*"; }
warn() { printf '%s: warning: %s\n' "$PROG" "$*" >&2; }
die() {
    printf '%s: error: %s\n' "$PROG" "$*" >&2
    exit 1
}

require_root() {
    [ "$(id -u)" -eq 0 ] || die "'$1' must run as root"
}

now_ms() { date +%s%3N; }

elapsed_since() { # start_ms -> "1.23s"
    local ms=$(($(now_ms) - $1))
    printf '%d.%02ds' $((ms / 1000)) $((ms % 1000 / 10))
}

check_port() { # name value
    [[ "$2" =~ ^[1-9][0-9]{0,4}$ ]] && [ "$2" -le 65535 ] || die "$1 must be a port number, got '$2'"
}

pidfile_of() { echo "$RUN_DIR/$1.pid"; }
logfile_of() { echo "$LOG_DIR/$1.log"; }
url_of() {
    case "$1" in
        prometheus) echo "$PROMETHEUS_URL" ;;
        prometheus-pushgateway) echo "$PUSHGATEWAY_URL" ;;
        *) die "unknown daemon $1" ;;
    esac
}

pid_is_alive() { # a zombie (PID 1 here reaps orphans late) counts as dead
    local pid="$1" stat state
    [ -n "$pid" ] || return 1
    stat="$(cat "/proc/$pid/stat" 2>/dev/null)" || return 1
    state="${stat##*) }"
    state="${state%% *}"
    [ "$state" != "Z" ] && [ "$state" != "X" ]
}

pid_is_dead() { ! pid_is_alive "$1"; }

# Prints the PID of daemon NAME when its pidfile names a live process running NAME (the kernel
# keeps the first 15 characters of the command name); a stale pidfile prints nothing.
running_pid() {
    local name="$1" pidfile pid comm
    pidfile="$(pidfile_of "$name")"
    [ -r "$pidfile" ] || return 1
    pid="$(tr -dc '0-9' <"$pidfile")"
    pid_is_alive "$pid" || return 1
    comm="$(cat "/proc/$pid/comm" 2>/dev/null)" || return 1
    [ "$comm" = "${name:0:15}" ] || return 1
    echo "$pid"
}

is_running() { running_pid "$1" >/dev/null; }

is_ready() { curl --noproxy '*' -fsS --max-time 2 "$(url_of "$1")/-/ready"; }

# wait_for SECONDS COMMAND...: run COMMAND every 0.2 s until it succeeds; false after SECONDS.
wait_for() {
    local seconds="$1" deadline
    shift
    deadline=$(($(now_ms) + seconds * 1000))
    until "$@" >/dev/null 2>&1; do
        [ "$(now_ms)" -lt "$deadline" ] || return 1
        sleep 0.2
    done
}

show_log_tail() {
    local logfile="$1"
    if [ -s "$logfile" ]; then
        printf '%s: last lines of %s:\n' "$PROG" "$logfile" >&2
        tail -n 25 "$logfile" | sed 's/^/    /' >&2
    else
        printf '%s: (log %s is empty or missing)\n' "$PROG" "$logfile" >&2
    fi
}

fail_daemon() { # name message
    printf '%s: error: %s\n' "$PROG" "$2" >&2
    show_log_tail "$(logfile_of "$1")"
    exit 1
}

# ---------------------------------------------------------------------------------------------
# install

package_installed() {
    dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'ok installed'
}

cmd_install() {
    require_root install
    local missing=() pkg start aptlog policy_created=""
    for pkg in "${PACKAGES[@]}"; do
        package_installed "$pkg" || missing+=("$pkg")
    done
    if [ "${#missing[@]}" -eq 0 ]; then
        log "packages already installed: ${PACKAGES[*]}"
        return 0
    fi
    start="$(now_ms)"
    mkdir -p "$LOG_DIR"
    aptlog="$LOG_DIR/apt-install.log"
    log "installing ${missing[*]} (apt-get, log in $aptlog)"
    # Keep the packages' init scripts from starting system-wide daemons on 9090/9091.
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod 755 /usr/sbin/policy-rc.d
        policy_created=1
    fi
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        --no-install-recommends "${missing[@]}"; } >"$aptlog" 2>&1; then
        [ -z "$policy_created" ] || rm -f /usr/sbin/policy-rc.d
        show_log_tail "$aptlog"
        die "apt-get install failed"
    fi
    [ -z "$policy_created" ] || rm -f /usr/sbin/policy-rc.d
    log "installed in $(elapsed_since "$start")"
}

require_installed() {
    local cmd
    for cmd in prometheus prometheus-pushgateway promtool curl; do
        command -v "$cmd" >/dev/null 2>&1 || die "'$cmd' not found: run '$0 install' first"
    done
}

# ---------------------------------------------------------------------------------------------
# configuration

render_config() {
    cat <<EOF
# Generated by ctxlaunch scripts/services/prometheus.sh: regenerated on each start.
global:
  scrape_interval: 1s
  scrape_timeout: 1s
  evaluation_interval: 1s

rule_files:
  - $RULES_DIR/*.yml
  - $RULES_DIR/*.yaml

scrape_configs:
  - job_name: pushgateway
    honor_labels: true
    static_configs:
      - targets: ["127.0.0.1:$PUSHGATEWAY_PORT"]

  # Tests add targets by writing a JSON file into the targets directory, e.g.
  # [{"targets": ["127.0.0.1:8000"], "labels": {"run": "t1"}}]
  - job_name: ctxlaunch
    honor_labels: true
    file_sd_configs:
      - files:
          - $TARGETS_DIR/*.json
          - $TARGETS_DIR/*.yml
        refresh_interval: 1s
EOF
}

# Writes the config (checked with promtool). Returns 0 when it changed.
write_config() {
    local content tmp
    content="$(render_config)"
    if [ -f "$CONFIG_FILE" ] && [ "$(cat "$CONFIG_FILE")" = "$content" ]; then
        return 1
    fi
    tmp="$CONFIG_FILE.tmp"
    printf '%s\n' "$content" >"$tmp"
    if ! promtool check config "$tmp" >"$LOG_DIR/promtool.log" 2>&1; then
        show_log_tail "$LOG_DIR/promtool.log"
        die "promtool rejects the generated config $tmp"
    fi
    mv -f "$tmp" "$CONFIG_FILE"
}

# ---------------------------------------------------------------------------------------------
# start

# spawn_detached PIDFILE LOGFILE COMMAND...: start COMMAND in a session of its own with output to
# LOGFILE; the process writes its own PID to PIDFILE before it execs COMMAND. Prints the PID.
spawn_detached() {
    local pidfile="$1" logfile="$2"
    shift 2
    rm -f "$pidfile"
    # shellcheck disable=SC2016 # $$ and $@ expand in the child shell
    setsid bash -c 'echo "$$" >"$0" && exec "$@"' "$pidfile" "$@" </dev/null >"$logfile" 2>&1 &
    wait_for 10 test -s "$pidfile" || die "could not start $1 (no pidfile $pidfile); see $logfile"
    tr -dc '0-9' <"$pidfile"
}

# await_ready NAME PID: wait until NAME answers /-/ready; fail at once when it exits.
await_ready() {
    local name="$1" pid="$2" deadline
    deadline=$(($(now_ms) + TIMEOUT * 1000))
    until is_ready "$name" >/dev/null 2>&1; do
        pid_is_alive "$pid" || fail_daemon "$name" "$name (pid $pid) exited while starting"
        if [ "$(now_ms)" -ge "$deadline" ]; then
            kill -TERM "$pid" 2>/dev/null || true
            fail_daemon "$name" "$name is not ready at $(url_of "$name")/-/ready within ${TIMEOUT}s"
        fi
        sleep 0.1
    done
}

pushgateway_scraped() {
    curl --noproxy '*' -fsS --max-time 2 --get --data-urlencode 'query=up{job="pushgateway"} == 1' \
        "$PROMETHEUS_URL/api/v1/query" | grep -q '"value":\['
}

start_daemon() { # name command...
    local name="$1" pid
    shift
    if is_running "$name"; then
        wait_for "$TIMEOUT" is_ready "$name" ||
            fail_daemon "$name" "$name runs (pid $(running_pid "$name")) but $(url_of "$name")/-/ready does not answer; a different port? run '$0 stop' first"
        return 0
    fi
    if is_ready "$name" >/dev/null 2>&1; then
        die "something else answers on $(url_of "$name") (not started by this script); stop it or choose another port"
    fi
    pid="$(spawn_detached "$(pidfile_of "$name")" "$(logfile_of "$name")" "$@")"
    await_ready "$name" "$pid"
}

cmd_start() {
    require_root start
    require_installed
    check_port CTXLAUNCH_PROMETHEUS_PORT "$PROMETHEUS_PORT"
    check_port CTXLAUNCH_PUSHGATEWAY_PORT "$PUSHGATEWAY_PORT"
    [ "$PROMETHEUS_PORT" != "$PUSHGATEWAY_PORT" ] || die "Prometheus and the Pushgateway need different ports"
    local start changed=""
    start="$(now_ms)"
    mkdir -p "$RUN_DIR" "$LOG_DIR" "$TARGETS_DIR" "$RULES_DIR"
    if ! is_running prometheus; then
        # A fresh start: empty TSDB, no targets or rules left over from earlier runs.
        rm -rf "$TSDB_DIR"
        mkdir -p "$TSDB_DIR"
        find "$TARGETS_DIR" "$RULES_DIR" -mindepth 1 -delete
    fi
    write_config && changed=1

    # In memory only (Debian's default persists to /var/lib/prometheus/pushgateway.data).
    start_daemon prometheus-pushgateway /usr/bin/prometheus-pushgateway \
        --web.listen-address="127.0.0.1:$PUSHGATEWAY_PORT" --persistence.file="" \
        --web.enable-admin-api --web.enable-lifecycle

    if is_running prometheus; then
        start_daemon prometheus
        if [ -n "$changed" ]; then
            log "config changed: reloading Prometheus"
            curl --noproxy '*' -fsS --max-time 10 -X POST "$PROMETHEUS_URL/-/reload" >/dev/null ||
                fail_daemon prometheus "POST $PROMETHEUS_URL/-/reload failed"
        fi
    else
        start_daemon prometheus /usr/bin/prometheus \
            --config.file="$CONFIG_FILE" --storage.tsdb.path="$TSDB_DIR" \
            --storage.tsdb.retention.time=1d \
            --web.listen-address="127.0.0.1:$PROMETHEUS_PORT" \
            --web.enable-lifecycle --web.enable-admin-api
    fi
    # New targets become active only every ~5 s: wait until the Pushgateway is scraped, so a
    # metric pushed after start shows up within one scrape interval.
    wait_for "$TIMEOUT" pushgateway_scraped ||
        fail_daemon prometheus "Prometheus does not scrape the Pushgateway (up{job=\"pushgateway\"}) within ${TIMEOUT}s"
    log "Prometheus $PROMETHEUS_URL and Pushgateway $PUSHGATEWAY_URL ready in $(elapsed_since "$start")"
    log "config:      $CONFIG_FILE"
    log "targets dir: $TARGETS_DIR (file_sd *.json, job ctxlaunch)"
    log "rules dir:   $RULES_DIR (*.yml; then POST $PROMETHEUS_URL/-/reload)"
    log "logs:        $LOG_DIR"
}

# ---------------------------------------------------------------------------------------------
# stop

stop_daemon() {
    local name="$1" pid pidfile
    pidfile="$(pidfile_of "$name")"
    if ! pid="$(running_pid "$name")"; then
        rm -f "$pidfile"
        return 0
    fi
    kill -TERM "$pid" 2>/dev/null || true
    if ! wait_for "$TIMEOUT" pid_is_dead "$pid"; then
        warn "$name (pid $pid) did not exit within ${TIMEOUT}s of SIGTERM: sending SIGKILL"
        kill -KILL "$pid" 2>/dev/null || true
        wait_for 5 pid_is_dead "$pid" || die "$name (pid $pid) survives SIGKILL"
    fi
    rm -f "$pidfile"
    log "stopped $name (pid $pid)"
}

cmd_stop() {
    require_root stop
    local start i
    start="$(now_ms)"
    for ((i = ${#DAEMONS[@]} - 1; i >= 0; i--)); do
        stop_daemon "${DAEMONS[i]}"
    done
    log "stopped in $(elapsed_since "$start")"
}

# ---------------------------------------------------------------------------------------------
# status

cmd_status() {
    local name pid all=0
    for name in "${DAEMONS[@]}"; do
        if pid="$(running_pid "$name")"; then
            if is_ready "$name" >/dev/null 2>&1; then
                printf '%-24s running (pid %s), ready at %s\n' "$name" "$pid" "$(url_of "$name")"
            else
                printf '%-24s running (pid %s), NOT ready at %s\n' "$name" "$pid" "$(url_of "$name")"
                all=1
            fi
        else
            printf '%-24s stopped\n' "$name"
            all=1
        fi
    done
    printf 'targets dir: %s\nrules dir:   %s\n' "$TARGETS_DIR" "$RULES_DIR"
    return "$all"
}

usage() {
    echo "usage: $0 install|start|stop|restart|status" >&2
    exit 2
}

main() {
    [ "$#" -eq 1 ] || usage
    case "$1" in
        install) cmd_install ;;
        start) cmd_start ;;
        stop) cmd_stop ;;
        restart) cmd_stop && cmd_start ;;
        status) cmd_status ;;
        *) usage ;;
    esac
}

main "$@"

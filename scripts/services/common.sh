# shellcheck shell=bash
# Helpers shared by slurm.sh, prometheus.sh and all.sh; sourced, not run.
#
# Before sourcing, a script sets:
#   PROG         its name, the prefix of every message
#   ROOT_REASON  optional: why it needs root, appended to require_root's error
# A script that uses the daemon helpers (running_pid, fail_daemon, stop_daemon, ...) also defines
#   pidfile_of NAME, logfile_of NAME   where daemon NAME keeps its pidfile and its log
#   DAEMONS                            its daemons in start order (stop_all_daemons)
#   LOG_DIR                            where install_packages writes the apt log
#   cmd_install, cmd_start, cmd_stop, cmd_status   the commands that service_main runs
: "${PROG:?set PROG before sourcing common.sh}"

# The settings that every service reads from the environment.
# shellcheck disable=SC2034 # BASE_DIR is used by the scripts that source this file
readonly BASE_DIR="${CTXLAUNCH_SERVICES_DIR:-/var/tmp/ctxlaunch-services}"
readonly TIMEOUT="${CTXLAUNCH_SERVICES_TIMEOUT:-30}"

# ---------------------------------------------------------------------------------------------
# messages

log() { printf '%s: %s\n' "$PROG" "$*"; }
warn() { printf '%s: warning: %s\n' "$PROG" "$*" >&2; }
die() {
    printf '%s: error: %s\n' "$PROG" "$*" >&2
    exit 1
}

usage() {
    echo "usage: $0 install|start|stop|restart|status" >&2
    exit 2
}

require_root() { # command
    [ "$(id -u)" -eq 0 ] || die "'$1' must run as root${ROOT_REASON:+ ($ROOT_REASON)}"
}

# ---------------------------------------------------------------------------------------------
# timing

now_ms() { date +%s%3N; }

elapsed_since() { # start_ms -> "1.23s"
    local ms=$(($(now_ms) - $1))
    printf '%d.%02ds' $((ms / 1000)) $((ms % 1000 / 10))
}

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

# ---------------------------------------------------------------------------------------------
# processes and pidfiles

# True when PID exists and is not a zombie (PID 1 here reaps orphans late, so `kill -0` is not
# enough: a stopped daemon can linger as a zombie).
pid_is_alive() {
    local pid="$1" stat state
    [ -n "$pid" ] || return 1
    stat="$(cat "/proc/$pid/stat" 2>/dev/null)" || return 1
    state="${stat##*) }"
    state="${state%% *}"
    [ "$state" != "Z" ] && [ "$state" != "X" ]
}

pid_is_dead() { ! pid_is_alive "$1"; }

# Prints the PID of daemon NAME when its pidfile names a live process whose command is NAME (the
# kernel keeps the first 15 characters of the command name). A stale pidfile (dead process, or a
# PID reused by another program) prints nothing. NAME may be PROGRAM@INSTANCE (slurmd@node1): one
# of several instances of PROGRAM, each with its own pidfile.
running_pid() {
    local name="$1" program="${1%%@*}" pidfile pid comm
    pidfile="$(pidfile_of "$name")"
    [ -r "$pidfile" ] || return 1
    pid="$(tr -dc '0-9' <"$pidfile")"
    pid_is_alive "$pid" || return 1
    comm="$(cat "/proc/$pid/comm" 2>/dev/null)" || return 1
    [ "$comm" = "${program:0:15}" ] || return 1
    echo "$pid"
}

is_running() { running_pid "$1" >/dev/null; }

# spawn_detached PIDFILE LOGFILE COMMAND...: start COMMAND (a program that stays in the
# foreground) in a session of its own, with output to LOGFILE; the process writes its own PID to
# PIDFILE before it execs COMMAND, so the PID is right whatever setsid does. Prints the PID.
spawn_detached() {
    local pidfile="$1" logfile="$2"
    shift 2
    rm -f "$pidfile"
    # shellcheck disable=SC2016 # $$ and $@ expand in the child shell
    setsid bash -c 'echo "$$" >"$0" && exec "$@"' "$pidfile" "$@" </dev/null >"$logfile" 2>&1 &
    wait_for 10 test -s "$pidfile" || die "could not start $1 (no pidfile $pidfile); see $logfile"
    tr -dc '0-9' <"$pidfile"
}

# stop_daemon NAME: SIGTERM the daemon named in its pidfile, SIGKILL it after TIMEOUT seconds.
# A daemon that does not run (or a stale pidfile) only has its pidfile removed.
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

# stop_all_daemons [FIRST_STEP...]: run FIRST_STEP when given, then stop every daemon of DAEMONS
# (listed in start order) last one first, so that none loses a daemon it depends on while it
# still runs; log how long it all took.
stop_all_daemons() {
    local start i
    start="$(now_ms)"
    if [ "$#" -gt 0 ]; then "$@"; fi
    for ((i = ${#DAEMONS[@]} - 1; i >= 0; i--)); do
        stop_daemon "${DAEMONS[i]}"
    done
    log "stopped in $(elapsed_since "$start")"
}

# ---------------------------------------------------------------------------------------------
# failure reports

show_log_tail() {
    local logfile="$1"
    if [ -s "$logfile" ]; then
        printf '%s: last lines of %s:\n' "$PROG" "$logfile" >&2
        tail -n 25 "$logfile" | sed 's/^/    /' >&2
    else
        printf '%s: (log %s is empty or missing)\n' "$PROG" "$logfile" >&2
    fi
}

# fail_daemon NAME MESSAGE [EXTRA_LOG]: print MESSAGE and the end of NAME's log (and of EXTRA_LOG,
# e.g. the daemon's captured stdout), then exit 1.
fail_daemon() {
    local name="$1" message="$2"
    printf '%s: error: %s\n' "$PROG" "$message" >&2
    show_log_tail "$(logfile_of "$name")"
    if [ -n "${3:-}" ]; then show_log_tail "$3"; fi
    exit 1
}

# ---------------------------------------------------------------------------------------------
# install

package_installed() {
    dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'ok installed'
}

# install_packages PACKAGE...: apt-get the packages that are missing (log in LOG_DIR); a no-op
# when all are installed.
install_packages() {
    local packages=("$@") missing=() pkg start aptlog policy_created=""
    for pkg in "${packages[@]}"; do
        package_installed "$pkg" || missing+=("$pkg")
    done
    if [ "${#missing[@]}" -eq 0 ]; then
        log "packages already installed: ${packages[*]}"
        return 0
    fi
    start="$(now_ms)"
    mkdir -p "$LOG_DIR"
    aptlog="$LOG_DIR/apt-install.log"
    log "installing ${missing[*]} (apt-get, log in $aptlog)"
    # Keep the packages' init scripts from starting system-wide daemons (munge, MariaDB,
    # Prometheus on 9090/9091) on machines that do not block it already: these scripts start
    # their own instances.
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

# ---------------------------------------------------------------------------------------------
# entry point

# service_main ARG...: run the one command given (install|start|stop|restart|status) through the
# script's cmd_* functions; anything else prints the usage and exits 2.
service_main() {
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

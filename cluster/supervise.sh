#!/bin/bash
# Run the same `raysim run CONFIG ... --out DIR` again until it finishes: the smallest supervisor.
#
#   cluster/supervise.sh raysim run CONFIG [key=value ...] --out DIR
#   cluster/supervise.sh python -m raysim run CONFIG --out DIR
#
# `raysim run CONFIG --out DIR` on a folder that holds checkpoints of the same config continues
# it, so restarting the very same command after the driver died (killed, out of memory, its
# node's Ray gone) is all a recovery takes. The contract: the exit status of the command, and
# what this does.
#
#   0           the run finished: exit 0
#   2           a usage error (a bad config, --out held by a live raysim on this host or by another
#               config's run): rerunning would say the same, so stop with 2
#   130, 143    stopped on purpose (Ctrl-C, SIGTERM: the user, scancel, a preemption): stop with it;
#               a Slurm requeue or the next submission of the same command continues the run
#   75          try later (EX_TEMPFAIL: a lock another host still refreshes, which is taken over
#               once it stops; a lost node and no spare capacity yet; Ray's GCS gone): run the
#               same command again after a delay that starts at RAYSIM_RETRY_DELAY seconds [10]
#               and doubles with each 75 in a row, up to RAYSIM_RETRY_MAX_DELAY [300]
#   other       (1: a failed run or write; 137 / killed by a signal: the driver died) run the same
#               command again after RAYSIM_RETRY_DELAY seconds [10]
#
# Every run of the command counts: at most RAYSIM_MAX_TRIES [10] in all, then exit with the last
# status (with the defaults, ten 75s in a row wait about 25 minutes in all). Delays may be
# fractions of a second.
#
# SIGTERM or SIGINT sent to this script is passed on to the command (which stops at once with
# the resume hint) and ends the loop.
set -u
set -m  # the command in its own process group: a background job would ignore SIGINT otherwise

if [ $# -eq 0 ]; then
    echo "usage: cluster/supervise.sh raysim run CONFIG [key=value ...] --out DIR" >&2
    exit 2
fi
max_tries=${RAYSIM_MAX_TRIES:-10}
base_delay=${RAYSIM_RETRY_DELAY:-10}
max_delay=${RAYSIM_RETRY_MAX_DELAY:-300}
log() { echo "raysim supervise: $*" >&2; }
later_delay=$base_delay  # the next wait after a 75: doubles while the command keeps asking to wait
doubled() { awk -v d="$1" -v m="$max_delay" 'BEGIN { d *= 2; if (d > m) d = m; print d }'; }

child=
stopping=
forward() {  # pass the signal on; the loop ends with the command's own status
    stopping=$1
    [ -n "$child" ] && kill "-$1" "$child" 2>/dev/null
}
trap 'forward TERM' TERM
trap 'forward INT' INT

try=1
while :; do
    "$@" &
    child=$!
    # wait returns early (>128) when a trapped signal arrives: wait again for the command itself
    while :; do
        wait "$child"
        rc=$?
        kill -0 "$child" 2>/dev/null || break
    done
    child=
    case $rc in
        0) exit 0 ;;
        2|130|143) exit "$rc" ;;
    esac
    if [ -n "$stopping" ]; then
        exit "$rc"
    fi
    if [ "$try" -ge "$max_tries" ]; then
        log "the command failed $try times (last exit status $rc); giving up"
        exit "$rc"
    fi
    if [ "$rc" -eq 75 ]; then
        delay=$later_delay
        later_delay=$(doubled "$later_delay")
        log "the command asked to be run again later (status 75, try $try of $max_tries); running it again in ${delay}s: $*"
    else
        delay=$base_delay
        later_delay=$base_delay
        log "the command exited with status $rc (try $try of $max_tries); running it again in ${delay}s: $*"
    fi
    sleep "$delay" &
    wait $! 2>/dev/null
    if [ -n "$stopping" ]; then
        exit "$rc"
    fi
    try=$((try + 1))
done

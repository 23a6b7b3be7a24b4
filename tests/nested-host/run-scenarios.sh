#!/bin/sh
# Runs nested-host scenarios one after the other, each in its own session with its own time
# limit, and writes one line per event to RESULTS (inside the outer guest: the virtio-serial
# port org.tenantvm.nested.results; on a real host: a file):
#
#   START <name> <limit s>
#   PASS <name> <seconds>
#   FAIL <name> <seconds> <reason>
#   SKIP <name> <seconds> <reason>
#   NOTE <name> <text>          a line the scenario wrote to $NH_NOTES (benchmark figures)
#   DONE
#
# A scenario passes by exiting 0, skips by exiting 77, fails otherwise; lib.sh's `fail` and
# `skip` write the reason to $NH_REASON. One that outlives its limit (`# limit: N` in its
# header, default 300 s) is killed with everything it started and reported as timed out;
# the next one still runs. Scenario output goes to this script's standard output (the
# console inside the outer guest) and to $NH_WORK/output.log.
#
# usage: run-scenarios.sh RESULTS NAME...
# env:   NH_SCENARIOS (the scenarios folder), NH_WORK_ROOT (a folder for their work files),
#        and the NH_* paths the scenarios use (docs/testing.md)
set -u
results="${1:?usage: run-scenarios.sh RESULTS NAME...}"
shift
: "${NH_SCENARIOS:?NH_SCENARIOS must name the scenarios folder}"
: "${NH_WORK_ROOT:?NH_WORK_ROOT must name a work folder}"

emit() { printf '%s\n' "$*" >>"$results"; }
now() { cut -d' ' -f1 /proc/uptime; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
one_line() { tr '\r\n\t' '   ' | sed 's/ *$//' | cut -c1-400; }
# Whether process $1 still runs (a zombie does not).
running() {
    state="$(cut -d' ' -f3 "/proc/$1/stat" 2>/dev/null)" || return 1
    [ -n "$state" ] && [ "$state" != Z ]
}

for name in "$@"; do
    script="$NH_SCENARIOS/$name.sh"
    if [ ! -f "$script" ]; then
        emit "FAIL $name 0 no scenario $script"
        continue
    fi
    limit="$(sed -n 's/^# limit: *\([0-9][0-9]*\).*/\1/p' "$script" | head -n 1)"
    limit="${limit:-300}"
    work="$NH_WORK_ROOT/$name"
    rm -rf "$work"
    mkdir -p "$work"
    export NH_WORK="$work" NH_REASON="$work/.reason" NH_NOTES="$work/.notes" NH_SCENARIO="$name"
    emit "START $name $limit"
    echo "==== nested-host: $name: start (limit $limit s)"
    t0="$(now)"
    # Its own session, so that the kill at the limit reaches everything it started.
    setsid sh -c '{ sh "$1"; echo $? >"$2"; } </dev/null 2>&1 | tee "$3"' nh-scenario \
        "$script" "$work/.status" "$work/output.log" &
    pid=$!
    timed_out=0
    while [ ! -s "$work/.status" ] && running "$pid"; do
        if awk -v t0="$t0" -v now="$(now)" -v limit="$limit" 'BEGIN { exit !(now - t0 >= limit) }'; then
            timed_out=1
            break
        fi
        sleep 0.5
    done
    # Let tee finish the output, then end whatever the scenario left behind.
    i=0
    while [ "$timed_out" = 0 ] && running "$pid" && [ $i -lt 10 ]; do sleep 0.3; i=$((i + 1)); done
    kill -KILL "-$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
    took="$(since "$t0")"
    if [ -f "$NH_NOTES" ]; then
        while IFS= read -r note; do
            emit "NOTE $name $(printf '%s' "$note" | one_line)"
        done <"$NH_NOTES"
    fi
    status="$(cat "$work/.status" 2>/dev/null)"
    reason=""
    [ -f "$NH_REASON" ] && reason="$(one_line <"$NH_REASON")"
    if [ "$timed_out" = 1 ]; then
        emit "FAIL $name $took timed out after $limit s; killed it and everything it started"
        echo "==== nested-host: $name: FAIL (timed out after $limit s)"
    elif [ "$status" = 0 ]; then
        emit "PASS $name $took"
        echo "==== nested-host: $name: PASS ($took s)"
    elif [ "$status" = 77 ]; then
        emit "SKIP $name $took ${reason:-no reason given}"
        echo "==== nested-host: $name: SKIP: ${reason:-no reason given}"
    else
        if [ -z "$reason" ]; then
            last="$(grep -v '^[[:space:]]*$' "$work/output.log" 2>/dev/null | tail -n 1 | one_line)"
            reason="exit status ${status:-unknown}${last:+; last output: $last}"
        fi
        emit "FAIL $name $took $reason"
        echo "==== nested-host: $name: FAIL: $reason"
    fi
done
emit "DONE"

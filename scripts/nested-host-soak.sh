#!/usr/bin/env bash
# Runs nested-host scenarios again and again to measure how often the outer guest freezes
# (docs/testing.md, "A frozen outer guest"): each run is one `nested-host run` (a fresh
# outer guest), optionally with busy loops beside it, and the tally says how many runs
# passed, how many froze (and in which scenario), and how many failed otherwise.
#
# usage: scripts/nested-host-soak.sh [--runs N] [--load K] [--until-freeze] [--release]
#                                    [nested-host run options] SCENARIO|@SET...
#   --runs N          runs to make (default 10)
#   --load K          K busy loops (one shell each) run beside every run (default 0)
#   --until-freeze    stop after the first run with a freeze
#   --inputs FILE     use these prepared inputs (tests/nested-host/prepare.sh) as they are
#   other options go to `nested-host run` (e.g. --append lapic=notscdeadline,
#   --qemu-arg=-icount --qemu-arg=shift=auto); QEMU=PATH picks the QEMU binary
# Writes each run's JSON outcomes and the tally to target/nested-host/soak/<start time>/.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

runs=10 load=0 until_freeze=0 profile=debug inputs=""
args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --runs) runs="${2:?--runs needs a number}"; shift 2 ;;
        --load) load="${2:?--load needs a number}"; shift 2 ;;
        --until-freeze) until_freeze=1; shift ;;
        --release) profile=release; shift ;;
        --inputs) inputs="${2:?--inputs needs a file}"; shift 2 ;;
        *) args+=("$1"); shift ;;
    esac
done
[ "${#args[@]}" -gt 0 ] || { sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }

cargo build --quiet -p tenantvm-nested-host --bin nested-host
target/debug/nested-host run --check-names "${args[@]}"
if [ -z "$inputs" ]; then
    tests/nested-host/prepare.sh --profile "$profile"
    inputs="target/nested-host/$profile/inputs"
fi

out="target/nested-host/soak/$(date -u +%Y%m%dT%H%M%SZ)"
mkdir -p "$out"
loads=()
stop_loads() { for p in "${loads[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap stop_loads EXIT
for _ in $(seq 1 "$load"); do
    sh -c 'while :; do :; done' &
    loads+=("$!")
done

passed=0 froze=0 failed=0
: >"$out/tally"
for i in $(seq 1 "$runs"); do
    t0=$(date +%s)
    set +e
    target/debug/nested-host run --json --inputs "$inputs" \
        --work-dir "$out/run-$i" "${args[@]}" >"$out/run-$i.out" 2>"$out/run-$i.err"
    set -e
    took=$(($(date +%s) - t0))
    json="$(sed -n '/^\[/,$p' "$out/run-$i.out")"
    frozen="$(printf '%s' "$json" | python3 -c 'import json,sys
try: v = json.load(sys.stdin)
except Exception: v = []
print(" ".join(o["name"] for o in v if o["verdict"] == "fail" and "froze" in (o["reason"] or "")))')"
    bad="$(printf '%s' "$json" | python3 -c 'import json,sys
try: v = json.load(sys.stdin)
except Exception: print("no-outcomes"); sys.exit()
print(" ".join(o["name"] for o in v if o["verdict"] == "fail" and "froze" not in (o["reason"] or "")))')"
    [ "$bad" != no-outcomes ] || bad="no outcomes ($(tail -n 1 "$out/run-$i.err"))"
    # A scenario that skipped did not pass: the run line names it.
    skipped="$(printf '%s' "$json" | python3 -c 'import json,sys
try: v = json.load(sys.stdin)
except Exception: v = []
print(" ".join(o["name"] for o in v if o["verdict"] == "skip"))')"
    if [ -n "$frozen" ]; then
        froze=$((froze + 1)); verdict="FROZE in $frozen${bad:+; failed: $bad}"
    elif [ -n "$bad" ]; then
        failed=$((failed + 1)); verdict="FAILED: $bad"
    else
        passed=$((passed + 1)); verdict="passed${skipped:+ (skipped: $skipped)}"
    fi
    line="run $i/$runs (${took} s, load $load): $verdict"
    echo "$line" | tee -a "$out/tally"
    if [ -n "$frozen" ] && [ "$until_freeze" = 1 ]; then
        runs=$i
        break
    fi
done
summary="$runs runs of ${args[*]} with $load busy loops: $passed passed, $froze froze, $failed failed otherwise"
echo "$summary" | tee -a "$out/tally"
echo "files: $out"
[ "$froze" -eq 0 ] && [ "$failed" -eq 0 ]

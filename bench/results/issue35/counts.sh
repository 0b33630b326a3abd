#!/bin/bash
# usage: counts.sh OUT NAME PATH WORKLOAD REPS [shunt-bench run args...]
# Runs one path and workload pinned under `perf record` of every syscall
# entry and context switch on the machine, then counts them per proxy
# process (counts.py). Run it twice with different REPS: the difference
# between the two is the work of the extra repetitions alone (startup,
# readiness polling and teardown cancel out), see profile.md.
set -eu
out=$1; name=$2; path=$3; workload=$4; reps=$5; shift 5
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
perf record -q -e raw_syscalls:sys_enter -e sched:sched_switch -a -o "$out/$name.data" -- \
  "${SHUNT_BENCH:?set SHUNT_BENCH to the shunt-bench binary}" run --paths "$path" --workloads "$workload" \
  --reps "$reps" --placements pinned --out "$out" --name "$name" "$@" > "$out/$name.log" 2>&1 || true
perf script -i "$out/$name.data" -F comm,pid,tid,event,trace 2>/dev/null | python3 "$here/counts.py" "$out/$name.log" > "$out/$name.counts"
rm -f "$out/$name.data"
cat "$out/$name.counts"

#!/bin/bash
# usage: gaps.sh OUT NAME PATH [shunt-bench run args...]
# One pinned rr1 repetition of PATH with every scheduler switch and interrupt
# on the pinned CPU traced; gaps.py summarises the stalls. SHUNT_BENCH names
# the shunt-bench binary; the trace itself (~100 MB) is deleted.
set -eu
out=$1; name=$2; path=$3; shift 3
here=$(cd "$(dirname "$0")" && pwd)
cpu=1
perf record -o "$out/$name.data" -C "$cpu" -e sched:sched_switch -e irq_vectors:local_timer_entry \
  -e irq_vectors:local_timer_exit -e irq:softirq_entry -e irq:irq_handler_entry \
  -e irq_vectors:call_function_single_entry -e irq_vectors:reschedule_entry -- \
  "${SHUNT_BENCH:?set SHUNT_BENCH}" run --paths "$path" --workloads rr1 --placements pinned --reps 1 \
  --out "$out" --name "$name" "$@" > "$out/$name.log" 2>&1
perf script -i "$out/$name.data" -F comm,pid,tid,time,event,trace > "$out/$name.trace" 2>/dev/null
python3 "$here/gaps.py" "$out/$name.trace" | tee "$out/$name.gaps"
rm -f "$out/$name.data" "$out/$name.trace"

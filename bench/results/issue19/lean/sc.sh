#!/bin/bash
# usage: sc.sh NAME BIN [ENV=VAL...]: syscalls and context switches per agent per rr1 transaction
set -u
name=$1; bin=$2; shift 2
cd /tmp/lean
env "$@" perf record -q -e raw_syscalls:sys_enter -e sched:sched_switch -a -o /tmp/lean/sc-$name.data -- \
  /tmp/lean/shunt-bench run --shunt "$bin" --paths ebpf/cross/hbone --workloads ${SCWL:-rr1} --reps 1 --placements pinned \
  --out /tmp/lean/runs --name sc-$name > /tmp/lean/runs/sc-$name.log 2>&1
# per pid of the agent's runtime threads: syscall numbers and switches (switches counted on prev_pid = the thread leaving)
perf script -i /tmp/lean/sc-$name.data -F comm,pid,tid,event,trace 2>/dev/null | python3 /tmp/lean/sc.py > /tmp/lean/runs/sc-$name.txt
cat /tmp/lean/runs/sc-$name.txt
rm -f /tmp/lean/sc-$name.data

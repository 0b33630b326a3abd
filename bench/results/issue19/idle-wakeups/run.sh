#!/bin/sh
# Interleaved before/after: the same harness (this branch's shunt-bench),
# the agent binary of main d721283 (before) and of branch idle (after).
set -e
T=/work/wt/idle/target
OUT=/work/wt/idle/bench/results/issue19/idle-wakeups
for run in before-1 after-1 before-2 after-2; do
  bin=$T/cmp/shunt-${run%-*}
  $T/release/shunt-bench run --shunt "$bin" --paths ebpf/cross/hbone,ebpf-fastpath/cross/plain \
    --workloads idle10k --placements pinned --reps 2 --out "$OUT" --name "$run"
done

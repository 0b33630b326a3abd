#!/bin/bash
# usage: run.sh NAME BIN [ENV=VAL...]  -- one interleaved bench pass
set -u
name=$1; bin=$2; shift 2
cd /work/wt/lean
env "$@" /tmp/lean/shunt-bench run --shunt "$bin" \
  --paths direct/cross,ebpf/cross/hbone --workloads ${WL:-rr1,crr} --placements pinned --reps ${REPS:-3} \
  --out /tmp/lean/runs --name "$name" > /tmp/lean/runs/$name.log 2>&1
echo "$name rc=$? $(date -u +%T)"
grep -A4 "^| path | CPU µs per RR 1 B (agents)" /tmp/lean/runs/$name.md | tail -2

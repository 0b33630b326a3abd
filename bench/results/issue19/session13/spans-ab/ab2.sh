#!/bin/bash
set -u
for i in 1 2 3; do
  for v in info nospan; do
    /tmp/b19/shunt-bench run --shunt /tmp/s13/shunt-$v --paths direct/cross,ebpf/cross/hbone --workloads rr1,crr --placements pinned --reps 5 --out /tmp/s13/ab2 --name $v-$i > /tmp/s13/ab2-$v-$i.log 2>&1
  done
done
echo done

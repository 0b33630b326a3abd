#!/bin/bash
# Meant as info vs warn; the testbed overrides RUST_LOG, so all six runs are the same (see README.md).
set -u
for i in 1 2 3; do
  /tmp/b19/shunt-bench run --shunt /tmp/s13/shunt --paths direct/cross,ebpf/cross/hbone --workloads rr1 --placements pinned --reps 5 --out /tmp/s13/ab --name info-$i > /tmp/s13/ab-info-$i.log 2>&1
  RUST_LOG=warn /tmp/b19/shunt-bench run --shunt /tmp/s13/shunt --paths direct/cross,ebpf/cross/hbone --workloads rr1 --placements pinned --reps 5 --out /tmp/s13/ab --name warn-$i > /tmp/s13/ab-warn-$i.log 2>&1
done
echo done

#!/bin/bash
# usage: instructions-pair.sh OUT TAG SHUNT_BIN
# instructions.sh for one shunt binary: rr1 and crr over ebpf/cross/hbone,
# 1 and 3 repetitions each, then instructions.py's per-transaction figures
# (per connection for crr). SHUNT_BENCH names the shunt-bench binary.
set -eu
out=$1; tag=$2; bin=$3
here=$(cd "$(dirname "$0")" && pwd)
for w in rr1 crr; do
  for r in 1 3; do
    "$here/instructions.sh" "$out" "$tag-$w-r$r" ebpf/cross/hbone "$w" "$r" "$bin" --shunt @WRAPPER@ > /dev/null
  done
  python3 "$here/instructions.py" "$out" "$tag-$w-r1" "$tag-$w-r3"
done

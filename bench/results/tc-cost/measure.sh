#!/bin/bash
# usage: measure.sh <shunt-bin> <name> <workloads> <paths>
set -u
mkdir -p ${TCM_OUT:-/tmp/tcm}
bin=$1; name=$2; wl=$3; paths=$4
echo 1 > /proc/sys/kernel/bpf_stats_enabled
out=${TCM_OUT:-/tmp/tcm}/$name.samples; : > $out
${SHUNT_BENCH:-target/release/shunt-bench} run --shunt $bin --paths $paths --workloads $wl --placements pinned --reps 1 --out ${TCM_OUT:-/tmp/tcm}/runs --name $name > ${TCM_OUT:-/tmp/tcm}/$name.log 2>&1 &
b=$!
while kill -0 $b 2>/dev/null; do bpftool -j prog show 2>/dev/null >> $out; echo >> $out; sleep 0.5; done
echo 0 > /proc/sys/kernel/bpf_stats_enabled
python3 "$(dirname "$0")/agg.py" $out
grep -E "^\[" ${TCM_OUT:-/tmp/tcm}/$name.log | cut -c1-150

#!/bin/bash
# usage: packets.sh OUT NAME PATH REPS
# Counts device transmits, netif_rx, retransmits and context switches on the
# whole machine around one pinned rr1 run of PATH (perf stat -a). Run it with
# REPS 1 and 3: packets.py divides the difference by the difference of the
# transactions, so startup and teardown cancel out.
set -u
out=$1; name=$2; path=$3; reps=$4
mkdir -p "$out"
perf stat -a -x, -e net:net_dev_xmit,net:netif_rx,tcp:tcp_retransmit_skb,sched:sched_switch,skb:kfree_skb \
  -o "$out/$name.stat" -- \
  "${SHUNT_BENCH:?set SHUNT_BENCH}" run --shunt "${SHUNT:?set SHUNT}" --ztunnel "${ZTUNNEL:?set ZTUNNEL}" \
  --paths "$path" --workloads rr1 --reps "$reps" --placements pinned --out "$out" --name "$name" \
  > "$out/$name.log" 2>&1
grep -v '^#' "$out/$name.stat"

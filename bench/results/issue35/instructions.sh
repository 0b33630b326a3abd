#!/bin/bash
# usage: instructions.sh OUT NAME PATH WORKLOAD REPS PROXY_BIN [shunt-bench run args...]
# Runs one path and workload pinned with every proxy process under
# `valgrind --tool=callgrind` (PROXY_BIN wrapped; pass the wrapper as
# --shunt, or as --ztunnel for ztunnel paths, in the trailing args via
# $WRAPPER), then prints each proxy's total instructions (Ir). Run twice
# with different REPS: the difference is the extra repetitions' work
# alone (startup cancels out); see README.md.
set -eu
out=$1; name=$2; path=$3; workload=$4; reps=$5; bin=$6; shift 6
mkdir -p "$out/$name.cg"
export WRAPPER="$out/$name.cg/proxy"
printf '#!/bin/sh\nexec valgrind --tool=callgrind --callgrind-out-file=%s/out.%%p %s "$@"\n' "$out/$name.cg" "$bin" > "$WRAPPER"
chmod +x "$WRAPPER"
args=()
for a in "$@"; do args+=("${a//@WRAPPER@/$WRAPPER}"); done
"${SHUNT_BENCH:?set SHUNT_BENCH to the shunt-bench binary}" run --paths "$path" --workloads "$workload" \
  --reps "$reps" --placements pinned --out "$out" --name "$name" "${args[@]}" > "$out/$name.log" 2>&1 || true
for f in "$out/$name.cg"/out.*; do
  pid=${f##*.}
  ir=$(grep -m1 '^summary:' "$f" | awk '{print $2}')
  echo "{\"pid\": $pid, \"instructions\": ${ir:-0}}"
done > "$out/$name.instructions"
cat "$out/$name.instructions"

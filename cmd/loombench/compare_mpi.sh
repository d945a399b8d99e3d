#!/usr/bin/env bash
# Compares loombench -backend mpi with raw Open MPI (rawmpi/allreduce.c):
# float32 sum AllReduce, out of place, at 1 MiB and 64 MiB, for 2 and 4
# processes. Both time an iteration as the slowest rank's and report the
# median over iterations; the two programs alternate for ROUNDS rounds so
# that a noisy machine affects them alike, and the table shows the median
# over rounds and loom's time relative to raw MPI.
#
# Usage: cmd/loombench/compare_mpi.sh
# Environment: NPS="2 4", ROUNDS=5, ITERS=20, WARMUP=5.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
for tool in go mpicc mpirun; do
	command -v "$tool" >/dev/null || { echo "compare_mpi.sh: $tool not found (apt-get install -y openmpi-bin libopenmpi-dev)" >&2; exit 2; }
done
dir="$(mktemp -d)"
trap 'rm -rf "$dir"' EXIT
mpicc -O2 -o "$dir/rawmpi" cmd/loombench/rawmpi/allreduce.c
go build -tags mpi -o "$dir/loombench" ./cmd/loombench
flags=(--oversubscribe)
[ "$(id -u)" = 0 ] && flags+=(--allow-run-as-root)
iters=${ITERS:-20} warmup=${WARMUP:-5}
: >"$dir/times"
for np in ${NPS:-2 4}; do
	for round in $(seq "${ROUNDS:-5}"); do
		mpirun "${flags[@]}" -np "$np" "$dir/rawmpi" "$iters" "$warmup" 1048576 67108864 |
			awk '{print "raw", $3, $4, $5}' >>"$dir/times"
		mpirun "${flags[@]}" -np "$np" "$dir/loombench" -backend mpi -b 1M -e 64M -f 64 \
			-iters "$iters" -warmup "$warmup" -check=false |
			awk -v np="$np" '!/^#/ && NF >= 6 {print "loom", np, $1, $6}' >>"$dir/times"
	done
done
printf '%-6s %-10s %14s %14s %10s\n' ranks bytes raw_us loom_us loom/raw
for np in ${NPS:-2 4}; do
	for bytes in 1048576 67108864; do
		med() { awk -v k="$1" -v np="$np" -v b="$bytes" '$1 == k && $2 == np && $3 == b {print $4}' "$dir/times" | sort -g |
			awk '{a[NR] = $1} END {if (NR == 0) print "nan"; else if (NR % 2) print a[(NR + 1) / 2]; else print (a[NR / 2] + a[NR / 2 + 1]) / 2}'; }
		raw=$(med raw) loom=$(med loom)
		printf '%-6s %-10s %14s %14s %10s\n' "$np" "$bytes" "$raw" "$loom" "$(awk -v l="$loom" -v r="$raw" 'BEGIN {printf "%.2f", l / r}')"
	done
done

#!/usr/bin/env bash
# Compares loombench -backend mpi with raw Open MPI (rawmpi/allreduce.c):
# float32 sum AllReduce, out of place, at 1 MiB and 64 MiB, for 2 and 4
# processes, each loom call mode against the MPI call it issues: the
# nonblocking default (MPI_Iallreduce polled by Wait) against raw
# MPI_Iallreduce+MPI_Wait, and the blocking mode (LOOM_MPI_BLOCKING=1:
# MPI_Allreduce under a watchdog) against raw MPI_Allreduce. Raw MPI uses
# page-aligned buffers, as Go places loombench's (see rawmpi/allreduce.c
# for why it matters). All time an iteration as the slowest rank's and
# report the median over iterations; the programs alternate for ROUNDS
# rounds so that a noisy machine affects them alike, and the table shows
# the median over rounds and loom's times relative to raw MPI's.
#
# Processes are bound to cores when there are enough (unbound, Open MPI
# sometimes lets two ranks share a core, and a run takes 2.4x as long
# whatever the program); with more processes than cores they run
# oversubscribed, unbound.
#
# Usage: cmd/loombench/compare_mpi.sh
# Environment: NPS="2 4", ROUNDS=5, ITERS=20, WARMUP=5; LOOMBENCH, a
# loombench built elsewhere with `go build -tags mpi` (for a machine
# without Go), and RAWMPI, a prebuilt rawmpi/allreduce.c, instead of
# building them here.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
need=(mpirun nproc)
[ -n "${LOOMBENCH:-}" ] || need+=(go)
[ -n "${RAWMPI:-}" ] || need+=(mpicc)
for tool in "${need[@]}"; do
	command -v "$tool" >/dev/null || { echo "compare_mpi.sh: $tool not found (apt-get install -y openmpi-bin libopenmpi-dev)" >&2; exit 2; }
done
dir="$(mktemp -d)"
trap 'rm -rf "$dir"' EXIT
if [ -n "${RAWMPI:-}" ]; then
	cp "$RAWMPI" "$dir/rawmpi"
else
	mpicc -O2 -o "$dir/rawmpi" cmd/loombench/rawmpi/allreduce.c
fi
if [ -n "${LOOMBENCH:-}" ]; then
	cp "$LOOMBENCH" "$dir/loombench"
else
	go build -tags mpi -o "$dir/loombench" ./cmd/loombench
fi
iters=${ITERS:-20} warmup=${WARMUP:-5}
: >"$dir/times"
for np in ${NPS:-2 4}; do
	flags=()
	[ "$(id -u)" = 0 ] && flags+=(--allow-run-as-root)
	if [ "$np" -le "$(nproc)" ]; then
		flags+=(--bind-to core)
	else
		flags+=(--oversubscribe --bind-to none)
	fi
	for round in $(seq "${ROUNDS:-5}"); do
		mpirun "${flags[@]}" -np "$np" "$dir/rawmpi" -page "$iters" "$warmup" 1048576 67108864 |
			awk '{print "raw", $3, $4, $5}' >>"$dir/times"
		mpirun "${flags[@]}" -np "$np" "$dir/rawmpi" -page -nb "$iters" "$warmup" 1048576 67108864 |
			awk '{print "rawnb", $3, $4, $5}' >>"$dir/times"
		for mode in 0 1; do
			mpirun "${flags[@]}" -x LOOM_MPI_BLOCKING=$mode -np "$np" "$dir/loombench" -backend mpi -b 1M -e 64M -f 64 \
				-iters "$iters" -warmup "$warmup" -check=false |
				awk -v np="$np" -v k="loom$mode" '!/^#/ && NF >= 6 {print k, np, $1, $6}' >>"$dir/times"
		done
	done
done
printf '%-6s %-9s %11s %11s %9s %9s %8s %8s\n' ranks bytes rawnb_us raw_us nb_us block_us nb/rawnb blk/raw
for np in ${NPS:-2 4}; do
	for bytes in 1048576 67108864; do
		med() { awk -v k="$1" -v np="$np" -v b="$bytes" '$1 == k && $2 == np && $3 == b {print $4}' "$dir/times" | sort -g |
			awk '{a[NR] = $1} END {if (NR == 0) print "nan"; else if (NR % 2) print a[(NR + 1) / 2]; else print (a[NR / 2] + a[NR / 2 + 1]) / 2}'; }
		ratio() { awk -v l="$1" -v r="$2" 'BEGIN {printf "%.2f", l / r}'; }
		rawnb=$(med rawnb) raw=$(med raw) nb=$(med loom0) blk=$(med loom1)
		printf '%-6s %-9s %11s %11s %9s %9s %8s %8s\n' "$np" "$bytes" "$rawnb" "$raw" "$nb" "$blk" \
			"$(ratio "$nb" "$rawnb")" "$(ratio "$blk" "$raw")"
	done
done

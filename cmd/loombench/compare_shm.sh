#!/usr/bin/env bash
# Compares loom's in-process backend (loombench -backend local: ranks are
# goroutines, data moves through shared memory) with Open MPI's own
# shared-memory collectives (loombench -backend mpi under mpirun, one
# process per rank), op by op: AllReduce, AllGather, ReduceScatter and
# AllToAll, float32, out of place, at 1 MiB and 64 MiB, for 2 and 4 ranks.
# The two alternate for ROUNDS rounds so that a noisy machine affects them
# alike; the table shows the median bus bandwidth of each over the rounds
# and loom's relative to MPI's, and the closing note the lowest ratio.
#
# MPI processes are bound to cores when there are enough, as in
# compare_mpi.sh; with more processes than cores they run oversubscribed,
# unbound. loom's ranks run unbound (the default).
#
# Usage: cmd/loombench/compare_shm.sh
# Environment: NPS="2 4", OPS="allreduce allgather reducescatter alltoall",
# SIZES="1M 64M", ROUNDS=5, ITERS=20, WARMUP=5; LOOMBENCH, a loombench
# built with `go build -tags mpi`, instead of building one here.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
need=(mpirun nproc awk)
[ -n "${LOOMBENCH:-}" ] || need+=(go)
for tool in "${need[@]}"; do
	command -v "$tool" >/dev/null || { echo "compare_shm.sh: $tool not found (apt-get install -y openmpi-bin libopenmpi-dev)" >&2; exit 2; }
done
dir="$(mktemp -d)"
trap 'rm -rf "$dir"' EXIT
if [ -n "${LOOMBENCH:-}" ]; then
	cp "$LOOMBENCH" "$dir/loombench"
else
	go build -tags mpi -o "$dir/loombench" ./cmd/loombench
fi
iters=${ITERS:-20} warmup=${WARMUP:-5}
ops=${OPS:-allreduce allgather reducescatter alltoall}
sizes=${SIZES:-1M 64M}
: >"$dir/bw"
# bench KIND NP OP SIZE [mpirun flags...]: appends "KIND NP OP BYTES BUSBW".
bench() {
	local kind=$1 np=$2 op=$3 size=$4
	shift 4
	local args=(-op "$op" -b "$size" -e "$size" -iters "$iters" -warmup "$warmup" -check=false)
	if [ "$kind" = loom ]; then
		"$dir/loombench" -ranks "$np" "${args[@]}"
	else
		mpirun "$@" -np "$np" "$dir/loombench" -backend mpi "${args[@]}"
	fi | awk -v k="$kind" -v np="$np" -v op="$op" '!/^#/ && NF >= 8 {print k, np, op, $1, $8}' >>"$dir/bw"
}
for np in ${NPS:-2 4}; do
	flags=()
	[ "$(id -u)" = 0 ] && flags+=(--allow-run-as-root)
	if [ "$np" -le "$(nproc)" ]; then
		flags+=(--bind-to core)
	else
		flags+=(--oversubscribe --bind-to none)
	fi
	for round in $(seq "${ROUNDS:-5}"); do
		for op in $ops; do
			for size in $sizes; do
				bench loom "$np" "$op" "$size"
				bench mpi "$np" "$op" "$size" "${flags[@]}"
			done
		done
	done
done
printf '%-6s %-14s %10s %10s %10s %8s\n' ranks op bytes loom_GB/s mpi_GB/s loom/mpi
awk '
	{ v[$1 SUBSEP $2 SUBSEP $3 SUBSEP $4] = v[$1 SUBSEP $2 SUBSEP $3 SUBSEP $4] " " $5
	  if (!(($2 SUBSEP $3 SUBSEP $4) in seen)) { seen[$2 SUBSEP $3 SUBSEP $4] = 1; order[++n] = $2 SUBSEP $3 SUBSEP $4 } }
	function med(s,   a, k, i, j, t) {
		k = split(s, a, " ")
		if (k == 0) return "nan"
		for (i = 2; i <= k; i++) for (j = i; j > 1 && a[j-1] + 0 > a[j] + 0; j--) { t = a[j]; a[j] = a[j-1]; a[j-1] = t }
		return k % 2 ? a[(k + 1) / 2] : (a[k / 2] + a[k / 2 + 1]) / 2
	}
	END {
		lowest = ""
		for (i = 1; i <= n; i++) {
			split(order[i], key, SUBSEP)
			l = med(v["loom" SUBSEP order[i]]); m = med(v["mpi" SUBSEP order[i]])
			r = (m > 0) ? l / m : 0
			printf "%-6s %-14s %10s %10.2f %10.2f %8.2f\n", key[1], key[2], key[3], l, m, r
			if (lowest == "" || r < lowest) { lowest = r; where = key[2] " of " key[3] " B on " key[1] " ranks" }
		}
		printf "# lowest loom/mpi busbw: %.2f (%s)\n", lowest, where
	}' "$dir/bw"

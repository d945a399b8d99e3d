#!/usr/bin/env bash
# Data parallelism across processes against what the machine's two cores
# give: examples/transformer (the tiny GPT, its reference run) trained
# with -dp 2 as two processes of one rank each, on the MPI backend (mpirun,
# a binary built with -tags mpi) and on the TCP backend (loomrun, pure Go),
# against the two-core ceiling measured in the same run: two independent
# one-rank runs with one GEMM thread (-threads 1), started together, each
# pinned with taskset to a core of its own, their tokens/s summed. Two
# one-rank runs do all the compute of -dp 2 (each the whole batch) with no
# communication and no sharing of a core, so a -dp 2 run at the ceiling
# loses nothing to its processes' communication.
#
# Variants, interleaved round by round so that the noise of a shared
# machine falls on all of them alike:
#   ceiling    taskset -c C0 and -c C1, two one-rank runs, tokens/s summed
#   mpi        mpirun -np 2 --bind-to core ./transformer -dp 2 -tp 1
#              (what mpirun does by default for 2 processes)
#   mpi-unbound the same with --bind-to none: unpinned, as loomrun's
#              processes are
#   tcp        loomrun -n 2 ./transformer -dp 2 -tp 1, as a user runs it:
#              loomrun pins each rank to a core of its own (--bind core,
#              its default, like mpirun's --bind-to core); loomrun itself
#              runs under taskset -c CORES, so that its ranks get those two
#   tcp-unbound the same with --bind none: unpinned
# Each run's tokens/s is the median over its steps (the transformer's
# -json "tokens_per_s"); the script prints every round, then per variant
# the median over the rounds and the median of the per-round ratios to
# the ceiling (the acceptance goal is at least 0.9).
#
# Usage: scripts/dp_scaling.sh            (ROUNDS=5 STEPS=200 CORES=0,1)
# Needs taskset (util-linux) and two CPUs; the mpi variant needs Open MPI
# (Debian: openmpi-bin, libopenmpi-dev) and cgo, and is left out, saying
# so, without them.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

rounds=${ROUNDS:-5}
steps=${STEPS:-200}
cores=${CORES:-0,1}
c0=${cores%%,*} c1=${cores#*,}
for v in "$rounds" "$steps" "$c0" "$c1"; do
	[[ $v =~ ^[0-9]+$ ]] || { echo "dp_scaling: ROUNDS, STEPS and CORES (two CPU numbers, a,b) must be integers" >&2; exit 2; }
done
if [ "$rounds" -lt 1 ] || [ "$steps" -lt 1 ]; then
	echo "dp_scaling: ROUNDS and STEPS must be at least 1" >&2
	exit 2
fi
command -v taskset >/dev/null || { echo "dp_scaling: needs taskset (apt-get install util-linux)" >&2; exit 2; }
taskset -c "$c0,$c1" true 2>/dev/null || { echo "dp_scaling: cannot pin to CPUs $c0 and $c1 (CORES=$cores)" >&2; exit 2; }

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

echo "== building cmd/loomrun and examples/transformer"
go build -o "$tmp/loomrun" ./cmd/loomrun
variants=(ceiling)
if command -v mpirun >/dev/null && pkg-config --exists ompi-c 2>/dev/null &&
	go build -tags mpi -o "$tmp/transformer" ./examples/transformer 2>"$tmp/build.err"; then
	variants+=(mpi mpi-unbound)
else
	echo "dp_scaling: no mpi variant: it needs Open MPI and cgo (apt-get install openmpi-bin libopenmpi-dev)" >&2
	CGO_ENABLED=0 go build -o "$tmp/transformer" ./examples/transformer
fi
variants+=(tcp tcp-unbound)
mpiflags=(-np 2)
[ "$(id -u)" = 0 ] && mpiflags+=(--allow-run-as-root)

# The same run everywhere: the reference's steps, a progress line rarely,
# no GPU (loomrun's processes take the TCP backend by themselves).
export LOOM_CUDA_DRIVER=off LOOM_BACKEND=
args=(-tp 1 -steps "$steps" -every "$steps")

# tps FILE: the run's median tokens/s from its -json.
tps() { tr -d ' \n' <"$1" | grep -o '"tokens_per_s":[0-9.eE+-]*' | cut -d: -f2; }
# run VARIANT OUT: runs the variant once and prints its tokens/s.
run() {
	local v=$1 out=$2
	case $v in
	ceiling)
		taskset -c "$c0" "$tmp/transformer" -dp 1 -threads 1 "${args[@]}" -json "$out.a" >"$out.log.a" 2>&1 &
		local a=$!
		taskset -c "$c1" "$tmp/transformer" -dp 1 -threads 1 "${args[@]}" -json "$out.b" >"$out.log.b" 2>&1 || { cat "$out.log.b" >&2; return 1; }
		wait "$a" || { cat "$out.log.a" >&2; return 1; }
		awk -v a="$(tps "$out.a")" -v b="$(tps "$out.b")" 'BEGIN { printf "%.1f\n", a + b }'
		return
		;;
	mpi) mpirun "${mpiflags[@]}" --bind-to core "$tmp/transformer" -dp 2 "${args[@]}" -json "$out" >"$out.log" 2>&1 ;;
	mpi-unbound) mpirun "${mpiflags[@]}" --bind-to none "$tmp/transformer" -dp 2 "${args[@]}" -json "$out" >"$out.log" 2>&1 ;;
	tcp) taskset -c "$c0,$c1" "$tmp/loomrun" -n 2 --timeout 30m "$tmp/transformer" -dp 2 "${args[@]}" -json "$out" >"$out.log" 2>&1 ;;
	tcp-unbound) taskset -c "$c0,$c1" "$tmp/loomrun" -n 2 --bind none --timeout 30m "$tmp/transformer" -dp 2 "${args[@]}" -json "$out" >"$out.log" 2>&1 ;;
	esac || { cat "$out.log" >&2; return 1; }
	grep -q '"processes": *2' "$out" || { echo "dp_scaling: $v did not run as 2 processes:" >&2; cat "$out.log" >&2; return 1; }
	tps "$out"
}

echo "== $rounds round(s) of ${variants[*]}, $steps steps each; CPUs $c0 and $c1; $(nproc) CPU(s) online, load $(cut -d' ' -f1-3 /proc/loadavg)"
printf '%-6s' round
printf ' %12.12s' "${variants[@]}"
echo "   (tokens/s; ratio to the ceiling)"
declare -A all
for ((r = 1; r <= rounds; r++)); do
	printf '%-6s' "$r"
	declare -A got=()
	for v in "${variants[@]}"; do
		got[$v]=$(run "$v" "$tmp/r$r-$v.json")
		all[$v]+="${got[$v]} "
		if [ "$v" = ceiling ]; then
			printf ' %12s' "${got[$v]}"
		else
			printf ' %6.0f %5.3f' "${got[$v]}" "$(awk -v a="${got[$v]}" -v c="${got[ceiling]}" 'BEGIN { print a / c }')"
			all[$v/ratio]+="$(awk -v a="${got[$v]}" -v c="${got[ceiling]}" 'BEGIN { print a / c }') "
		fi
	done
	echo
	unset got
done

# median LIST: the median of the numbers in LIST.
median() { tr ' ' '\n' <<<"$1" | grep . | sort -g | awk '{ v[NR] = $1 } END { print (NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2) }'; }
echo "== medians over $rounds round(s) (load now $(cut -d' ' -f1-3 /proc/loadavg))"
printf 'dp_scaling: ceiling (2 x one-thread one-rank, pinned) %.0f tokens/s\n' "$(median "${all[ceiling]}")"
for v in "${variants[@]}"; do
	[ "$v" = ceiling ] && continue
	printf 'dp_scaling: %-11s -dp 2, 2 processes %.0f tokens/s, %.3f x the ceiling (median of the per-round ratios; ratio of the medians %.3f)\n' \
		"$v" "$(median "${all[$v]}")" "$(median "${all[$v/ratio]}")" \
		"$(awk -v a="$(median "${all[$v]}")" -v c="$(median "${all[ceiling]}")" 'BEGIN { print a / c }')"
done

#!/usr/bin/env bash
# The TCP backend (comm/tcp, pure Go; loombench -backend tcp under loomrun)
# against Open MPI's TCP transport (loombench -backend mpi under mpirun
# --mca btl tcp,self, Open MPI's own collectives over loopback TCP) and,
# where Debian's python3-torch is installed, PyTorch's gloo
# (cmd/loombench/gloo/bench.py): bus bandwidth of AllReduce, AllGather,
# ReduceScatter and AllToAll, float32, out of place (gloo's AllReduce in
# place), at 1 MiB and 64 MiB, for 2 and 4 processes of one rank each,
# all on loopback. Each is timed as loombench does (an iteration is the
# slowest rank's time, the median over iterations); the three alternate
# for ROUNDS rounds so that a noisy machine affects them alike, and the
# table shows the median over rounds and loom's bus bandwidth relative to
# each (the issue's goals: at least 1.0x Open MPI TCP and 3x gloo).
#
# Usage: cmd/loombench/compare_tcp.sh
# Environment: NPS="2 4", ROUNDS=3, ITERS=10, WARMUP=3.
# Needs go; the MPI column Open MPI and cgo (apt-get install openmpi-bin
# libopenmpi-dev), the gloo column python3-torch (apt-get install
# python3-torch); each is left out, saying so, without them.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
command -v go >/dev/null || { echo "compare_tcp.sh: go not found" >&2; exit 2; }
dir="$(mktemp -d)"
trap 'rm -rf "$dir"' EXIT

nps=${NPS:-2 4} rounds=${ROUNDS:-3} iters=${ITERS:-10} warmup=${WARMUP:-3}
sizes=(1M 64M)
ops=allreduce,allgather,reducescatter,alltoall
bytes_of() { local s=$1; case $s in *K) echo $((${s%K} << 10)) ;; *M) echo $((${s%M} << 20)) ;; *) echo "$s" ;; esac; }
sizelist=""
for s in "${sizes[@]}"; do sizelist+="${sizelist:+,}$(bytes_of "$s")"; done

go build -o "$dir/loomrun" ./cmd/loomrun
impls=(tcp)
if command -v mpirun >/dev/null && pkg-config --exists ompi-c 2>/dev/null &&
	go build -tags mpi -o "$dir/loombench" ./cmd/loombench 2>"$dir/build.err"; then
	impls+=(mpi)
else
	echo "compare_tcp.sh: no Open MPI column: it needs Open MPI and cgo (apt-get install -y openmpi-bin libopenmpi-dev)" >&2
	CGO_ENABLED=0 go build -o "$dir/loombench" ./cmd/loombench
fi
py=""
for p in /usr/bin/python3 python3; do
	if command -v "$p" >/dev/null && "$p" -c 'import torch.distributed as d; assert d.is_available() and d.is_gloo_available()' 2>/dev/null; then
		py=$p
		break
	fi
done
if [ -n "$py" ]; then
	impls+=(gloo)
else
	echo "compare_tcp.sh: no gloo column: no python3 imports torch with gloo (apt-get install -y python3-torch)" >&2
fi
mpiflags=(--mca btl "tcp,self" --mca btl_tcp_if_include lo --mca oob_tcp_if_include lo)
[ "$(id -u)" = 0 ] && mpiflags+=(--allow-run-as-root)

# free_port: a TCP port nobody listens on now (for gloo's store).
free_port() { "$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
lbflags=(-op "$ops" -b 1M -e 64M -f 64 -iters "$iters" -warmup "$warmup" -check=false)
# run IMPL NP CSV: one measurement of every op and size.
run() {
	local impl=$1 np=$2 csv=$3
	case $impl in
	tcp) LOOM_CUDA_DRIVER=off "$dir/loomrun" -n "$np" --timeout 30m "$dir/loombench" -backend tcp "${lbflags[@]}" -csv "$csv" >"$csv.log" 2>&1 ;;
	mpi)
		local bind=(--bind-to core)
		[ "$np" -le "$(nproc)" ] || bind=(--oversubscribe --bind-to none)
		mpirun "${mpiflags[@]}" "${bind[@]}" -np "$np" "$dir/loombench" -backend mpi "${lbflags[@]}" -csv "$csv" >"$csv.log" 2>&1
		;;
	gloo)
		local port r pids=() rc=0
		port=$(free_port)
		for ((r = 0; r < np; r++)); do
			RANK=$r WORLD_SIZE=$np MASTER_ADDR=127.0.0.1 MASTER_PORT=$port "$py" cmd/loombench/gloo/bench.py \
				-op "$ops" -sizes "$sizelist" -iters "$iters" -warmup "$warmup" -csv "$csv" >>"$csv.log" 2>&1 &
			pids+=($!)
		done
		for r in "${pids[@]}"; do wait "$r" || rc=$?; done
		return $rc
		;;
	esac
}

: >"$dir/all"
for np in $nps; do
	for ((round = 1; round <= rounds; round++)); do
		for impl in "${impls[@]}"; do
			csv="$dir/$impl-$np-$round.csv"
			if ! run "$impl" "$np" "$csv"; then
				echo "compare_tcp.sh: $impl, $np processes, round $round failed:" >&2
				cat "$csv.log" >&2
				exit 1
			fi
			# impl op nranks bytes busbw, out-of-place cells (gloo's
			# AllReduce: in place), unsupported ops as "nan".
			awk -F, -v impl="$impl" 'NR > 1 && $3 == "auto" && ($11 !~ /inplace/ || impl == "gloo") {
				print impl, $2, $4, $5, ($10 == "" ? "nan" : $10) }' "$csv" >>"$dir/all"
			echo "compare_tcp.sh: $impl, $np processes, round $round done" >&2
		done
	done
done

med() {
	awk -v i="$1" -v o="$2" -v n="$3" -v b="$4" '$1 == i && $2 == o && $3 == n && $4 == b { print $5 }' "$dir/all" | { grep -v nan || true; } | sort -g |
		awk '{ a[NR] = $1 } END { if (NR == 0) print "nan"; else if (NR % 2) print a[(NR + 1) / 2]; else print (a[NR / 2] + a[NR / 2 + 1]) / 2 }'
}
ratio() { awk -v l="$1" -v r="$2" 'BEGIN { if (l == "nan" || r == "nan" || r == 0) print "-"; else printf "%.2f", l / r }'; }
echo "# busbw GB/s, median of $rounds round(s) of $iters iterations; loopback; load $(cut -d' ' -f1-3 /proc/loadavg)"
printf '%-14s %5s %9s %10s %10s %10s %9s %9s\n' op ranks bytes tcp mpi-tcp gloo tcp/mpi tcp/gloo
for op in ${ops//,/ }; do
	for np in $nps; do
		for s in "${sizes[@]}"; do
			b=$(bytes_of "$s")
			t=$(med tcp "$op" "$np" "$b") m=$(med mpi "$op" "$np" "$b") g=$(med gloo "$op" "$np" "$b")
			printf '%-14s %5s %9s %10s %10s %10s %9s %9s\n' "$op" "$np" "$s" "$t" "$m" "$g" "$(ratio "$t" "$m")" "$(ratio "$t" "$g")"
		done
	done
done

#!/usr/bin/env bash
# Checks that the training programs run unchanged as one MPI process per
# rank: it builds examples/transformer and examples/moe with -tags mpi,
# trains each layout for $STEPS steps under mpirun and in one process
# (in-process ranks), and compares the two runs' losses (-json).
#
# Tolerance: TOL (default 0, bit-identical). Both runs execute the same
# code on the same data with the same GEMM (LOOM_BLAS, pinned below) and
# the same threads per rank (the host's CPUs over its ranks, alike in both),
# and every reduction in these layouts is over a group of two ranks (dp=2,
# tp=2, ep=2), where the order cannot matter: IEEE addition of two numbers
# is commutative, so MPI's reduction order and comm/local's give the same
# bits. A difference therefore means the backends computed something
# different. The pipelined layouts (-pp 2; -pp 2 -dp 2 with the
# split-backward schedule zb1; -pp 2 -fsdp 2, whose stages' all-gathers
# move bits and whose reduce-scatters add two terms) add to these only
# point-to-point sends of activations and gradients, which move bits
# unchanged, and the loss's all-reduce over the world, where the last
# stage's two data-parallel ranks add their shares and the others zeros,
# again exact in any order.
# (A layout with 3 or more ranks per group would need a bound:
# float32 sums reassociated differ by about n·2⁻²⁴ relative per reduction.)
#
# It also checks that a binary built without the tag, started by mpirun,
# fails with the message that says to rebuild it, instead of training one
# whole job in every process.
#
# Usage: examples/mpi_check.sh   (Open MPI: apt-get install -y openmpi-bin libopenmpi-dev)
# Environment: STEPS=20, TOL=0, LOOM_BLAS=openblas, TIMEOUT=600 (seconds per run).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

for tool in go mpirun pkg-config awk; do
	if ! command -v "$tool" >/dev/null 2>&1; then
		echo "mpi_check.sh: $tool not found (apt-get install -y openmpi-bin libopenmpi-dev)" >&2
		exit 2
	fi
done

steps="${STEPS:-20}"
tol="${TOL:-0}"
timeout="${TIMEOUT:-600}"
export LOOM_BLAS="${LOOM_BLAS:-openblas}" # the same GEMM in both runs, whatever the defaults per backend
export LOOM_COSTMODEL=off                 # no calibration: it measures, and nothing here needs it

mpirun_flags=(--oversubscribe)
if [ "$(id -u)" = 0 ]; then
	mpirun_flags+=(--allow-run-as-root)
fi

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

echo "== go build -tags mpi ./examples/transformer ./examples/moe"
go build -tags mpi -o "$tmp/transformer" ./examples/transformer
go build -tags mpi -o "$tmp/moe" ./examples/moe
go build -o "$tmp/transformer-notag" ./examples/transformer

# losses FILE prints the "losses" list of a -json file, one per line.
losses() {
	awk '/"losses": \[/ {on=1; next} on && /\]/ {exit} on {gsub(/[ ,]/, ""); print}' "$1"
}

fail=0
# check NAME NP BINARY ARGS...: the layout under mpirun -np NP and in one process.
check() {
	local name="$1" np="$2" bin="$3"
	shift 3
	echo "== $name: mpirun -np $np $(basename "$bin") $* -steps $steps"
	timeout "$timeout" mpirun "${mpirun_flags[@]}" -np "$np" "$bin" "$@" -steps "$steps" -every "$steps" -json "$tmp/$name.mpi.json"
	echo "== $name: in one process"
	timeout "$timeout" "$bin" "$@" -steps "$steps" -every "$steps" -backend local -json "$tmp/$name.local.json" >/dev/null
	grep -q '"backend": "mpi"' "$tmp/$name.mpi.json" || { echo "FAIL $name: the mpirun run's -json does not say backend mpi" >&2; fail=1; }
	grep -q "\"processes\": $np," "$tmp/$name.mpi.json" || { echo "FAIL $name: the mpirun run's -json does not say $np processes" >&2; fail=1; }
	if ! paste <(losses "$tmp/$name.mpi.json") <(losses "$tmp/$name.local.json") | awk -v tol="$tol" -v n="$steps" -v name="$name" '
		{ d = $1 - $2; if (d < 0) d = -d; if (d > worst) worst = d; if (d > tol || $1 == "" || $2 == "") { bad = 1; printf "FAIL %s step %d: mpi %s, in-process %s\n", name, NR, $1, $2 } }
		END { if (NR != n) { printf "FAIL %s: %d losses, want %d\n", name, NR, n; exit 1 } printf "%s: %d losses, largest difference %g (tolerance %g)\n", name, NR, worst, tol; exit bad }' >&2; then
		fail=1
	fi
}

check "transformer-dp2-tp2" 4 "$tmp/transformer" -dp 2 -tp 2
check "transformer-dp2-tp1" 2 "$tmp/transformer" -dp 2 -tp 1
check "moe-dp1-ep2" 2 "$tmp/moe" -dp 1 -ep 2
check "transformer-pp2" 2 "$tmp/transformer" -pp 2
check "transformer-pp2-dp2-zb1" 4 "$tmp/transformer" -pp 2 -dp 2 -schedule zb1
check "transformer-pp2-fsdp2" 4 "$tmp/transformer" -pp 2 -fsdp 2

# An in-process run that saves a checkpoint, resumed under mpirun: the
# resumed steps' losses are the uninterrupted in-process run's (dp=2, so
# bit for bit as above).
half=$((steps / 2))
echo "== resume: $half steps in one process with -checkpoint, then to step $steps under mpirun -np 2 with -resume"
timeout "$timeout" "$tmp/transformer" -dp 2 -tp 1 -steps "$steps" -every "$steps" -backend local -json "$tmp/straight.json" >/dev/null
timeout "$timeout" "$tmp/transformer" -dp 2 -tp 1 -steps "$half" -every "$half" -backend local -checkpoint "$tmp/ck" >/dev/null
timeout "$timeout" mpirun "${mpirun_flags[@]}" -np 2 "$tmp/transformer" -dp 2 -tp 1 -steps "$steps" -every "$steps" -checkpoint "$tmp/ck" -resume -json "$tmp/resumed.json" >/dev/null
if ! paste <(losses "$tmp/straight.json" | tail -n +"$((half + 1))") <(losses "$tmp/resumed.json") | awk -v tol="$tol" -v n="$((steps - half))" '
	{ d = $1 - $2; if (d < 0) d = -d; if (d > worst) worst = d; if (d > tol || $1 == "" || $2 == "") { bad = 1; printf "FAIL resume step %d: straight %s, resumed under mpirun %s\n", NR, $1, $2 } }
	END { if (NR != n) { printf "FAIL resume: %d losses, want %d\n", NR, n; exit 1 } printf "resume: %d losses, largest difference %g (tolerance %g)\n", NR, worst, tol; exit bad }' >&2; then
	fail=1
fi

echo "== a binary built without -tags mpi under mpirun -np 2"
if timeout "$timeout" mpirun "${mpirun_flags[@]}" -np 2 "$tmp/transformer-notag" -dp 2 -tp 1 -steps 1 >"$tmp/notag.out" 2>&1; then
	echo "FAIL: the untagged binary ran under mpirun" >&2
	fail=1
elif ! grep -q "launched by mpirun (OMPI_COMM_WORLD_SIZE=2) but built without -tags mpi: rebuild with go build -tags mpi" "$tmp/notag.out"; then
	echo "FAIL: the untagged binary failed without the rebuild message:" >&2
	cat "$tmp/notag.out" >&2
	fail=1
else
	grep -m1 "built without -tags mpi" "$tmp/notag.out"
fi

if [ "$fail" != 0 ]; then
	echo "mpi_check.sh: FAILED" >&2
	exit 1
fi
echo "mpi_check.sh: ok"

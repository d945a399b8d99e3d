#!/usr/bin/env bash
# Compares loom's single-rank training speed with PyTorch 1.13's on this
# machine, both at one thread: the tiny GPT of
# reference/TINY_GPT.md trained for its 200 steps, in tokens/s
# over the whole run. PyTorch runs pytorch/tiny_gpt.py (Debian's
# python3-torch 1.13.1, whose BLAS is the system libblas.so.3, OpenBLAS
# where installed; the script checks its loss curve against the
# reference's); loom runs tests.BenchmarkTrain200 on OpenBLAS and on its
# pure-Go GEMM. One thread means torch.set_num_threads(1) and
# OMP_NUM_THREADS=OPENBLAS_NUM_THREADS=1 for PyTorch (as the reference's
# own curve was run), GOMAXPROCS=1 and OPENBLAS_NUM_THREADS=1 for loom.
# The three alternate for ROUNDS rounds so that a noisy machine affects
# them alike; the table has each one's median over rounds and loom's
# ratio to PyTorch.
#
# Usage: cmd/loombench/compare_pytorch.sh
# Environment: ROUNDS=5, PYTHON=/usr/bin/python3. The reference is the
# repository's reference/ folder.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
python=${PYTHON:-/usr/bin/python3}
"$python" -c 'import torch' 2>/dev/null || {
	echo "compare_pytorch.sh: $python cannot import torch (apt-get install -y python3-torch)" >&2
	exit 2
}
dir="$(mktemp -d)"
trap 'rm -rf "$dir"' EXIT
go test -c -o "$dir/tests.test" ./tests
rounds=${ROUNDS:-5}

# tokens prints the tokens/s figure of a run's output.
tokens() { grep -o '[0-9.]* tokens/s' | head -1 | cut -d' ' -f1; }

one_thread=(env OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE GOMAXPROCS=1)
for round in $(seq "$rounds"); do
	"${one_thread[@]}" "$python" cmd/loombench/pytorch/tiny_gpt.py --threads 1 >"$dir/out"
	echo "pytorch $(tokens <"$dir/out")" >>"$dir/times"
	for blas in openblas go; do
		(cd tests && "${one_thread[@]}" LOOM_BLAS=$blas "$dir/tests.test" -test.run XXX -test.bench Train200 -test.benchtime 1x) >"$dir/out"
		echo "loom-$blas $(tokens <"$dir/out")" >>"$dir/times"
	done
	echo "round $round/$rounds: $(tail -3 "$dir/times" | tr '\n' ' ')" >&2
done

median() { sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
py=$(awk '$1=="pytorch"{print $2}' "$dir/times" | median)
printf '| run (1 thread, 200 steps) | median tokens/s | all rounds | x PyTorch |\n|---|---|---|---|\n'
for who in pytorch loom-openblas loom-go; do
	m=$(awk -v w=$who '$1==w{print $2}' "$dir/times" | median)
	all=$(awk -v w=$who '$1==w{printf "%s%.0f", sep, $2; sep=", "}' "$dir/times")
	printf '| %s | %.0f | %s | %.2f |\n' "$who" "$m" "$all" "$(awk -v a="$m" -v b="$py" 'BEGIN { print a / b }')"
done

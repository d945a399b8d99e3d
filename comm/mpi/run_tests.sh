#!/usr/bin/env bash
# Runs the MPI backend's tests (comm/mpi, build tag mpi) under mpirun with
# 2, 3 and 4 processes. It installs nothing: Open MPI must be there
# (Debian: apt-get install -y openmpi-bin libopenmpi-dev). Each MPI
# process runs the same test binary and is one rank.
#
# Usage: comm/mpi/run_tests.sh [extra test flags]   (default: -test.short)
# Environment: NPS="2 3 4" (process counts), TIMEOUT=600 (seconds per run).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"

for tool in go mpirun pkg-config; do
	if ! command -v "$tool" >/dev/null 2>&1; then
		echo "run_tests.sh: $tool not found (apt-get install -y openmpi-bin libopenmpi-dev)" >&2
		exit 2
	fi
done
if ! pkg-config --exists ompi-c; then
	echo "run_tests.sh: pkg-config cannot find ompi-c (apt-get install -y libopenmpi-dev)" >&2
	exit 2
fi

flags=("$@")
if [ ${#flags[@]} -eq 0 ]; then
	flags=(-test.short)
fi

bin="$(mktemp -d)/mpi.test"
trap 'rm -rf "$(dirname "$bin")"' EXIT

echo "== go vet -tags mpi ./comm/mpi"
go vet -tags mpi ./comm/mpi
echo "== go test -tags mpi -c ./comm/mpi"
go test -tags mpi -c -o "$bin" ./comm/mpi

mpirun_flags=(--oversubscribe)
if [ "$(id -u)" = 0 ]; then
	mpirun_flags+=(--allow-run-as-root)
fi

status=0
for np in ${NPS:-2 3 4}; do
	echo "== mpirun -np $np mpi.test ${flags[*]}"
	start=$(date +%s)
	if timeout "${TIMEOUT:-600}" mpirun "${mpirun_flags[@]}" -np "$np" "$bin" "${flags[@]}"; then
		echo "== np $np: ok ($(( $(date +%s) - start ))s)"
	else
		rc=$?
		echo "== np $np: FAILED (exit $rc)" >&2
		status=1
	fi
done
exit $status

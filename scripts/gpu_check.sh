#!/usr/bin/env bash
# GPU checks of loom's CUDA binding and MoE permute kernels (package
# device/cuda).
#
# Builds the package's test binary with `go test -c` and runs all of its
# tests with LOOM_CUDA_REQUIRE=1 (a missing driver, NVRTC or device fails
# instead of skipping) and LOOM_CUDA_BENCH=1:
#   - TestGPUPermuteMatchesCPU: every kernel against package kernels' CPU
#     kernels on random data, float32 and float64;
#   - TestGPUBandwidth: GB/s of each kernel next to cuMemcpyDtoD of the
#     same bytes, and the ratio;
#   - TestGPUStreamsAndCache: two streams ordered by an event, timing
#     events, MemInfo, and a compile read back from a fresh kernel cache;
#   - the tests that need no GPU (fake driver, argument packing, ...).
# Then it trains the tiny GPT for 20 steps on one GPU rank under loomrun
# (`loomrun -n 1 transformer -dp 1 -tp 1`, the NCCL backend end to end) and
# checks that the run chose NCCL and finished.
# Exits non-zero when a build, a test or the training run fails.
#
# Usage: scripts/gpu_check.sh [prebuilt-test-binary]
#   With an argument, runs that binary (built elsewhere with
#   `go test -c -o cuda.test ./device/cuda`) instead of building one, for
#   machines without a Go toolchain; then LOOMRUN and TRANSFORMER name
#   prebuilt `go build ./cmd/loomrun` and `go build ./examples/transformer`
#   binaries (without them the training run is skipped, and says so).
# Environment: LOOM_CUDA_DRIVER, LOOM_NVRTC force the libraries and
# LOOM_KERNEL_CACHE sets the kernel cache (see
# `go doc ./device/cuda`); GPU_CHECK_TIMEOUT bounds the run (default 15m).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

if [[ $# -ge 1 ]]; then
	bin=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
	[[ -x $bin ]] || { echo "gpu_check: $1 is not an executable test binary" >&2; exit 2; }
else
	command -v go >/dev/null || { echo "gpu_check: no go toolchain; pass a prebuilt test binary" >&2; exit 2; }
	bin=$work/cuda.test
	echo "gpu_check: building $bin"
	(cd "$root" && go test -c -o "$bin" ./device/cuda)
fi

if command -v nvidia-smi >/dev/null; then
	nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
fi

export LOOM_CUDA_REQUIRE=1 LOOM_CUDA_BENCH=1
# The tests read testdata/ relative to the package directory.
cd "$root/device/cuda"
set +e
"$bin" -test.v -test.count=1 -test.timeout "${GPU_CHECK_TIMEOUT:-15m}" 2>&1 | tee "$work/log"
status=${PIPESTATUS[0]}
set -e

echo
echo "gpu_check: bandwidth (kernel vs cuMemcpyDtoD of the same bytes):"
grep -E 'GB/s' "$work/log" | sed -E 's/^ *gpu_test\.go:[0-9]+: /  /' || echo "  (no bandwidth lines)"
# The training job on one GPU rank under loomrun.
lbin=${LOOMRUN:-} tbin=${TRANSFORMER:-}
if [[ -z $lbin || -z $tbin ]] && command -v go >/dev/null; then
	lbin=$work/loomrun tbin=$work/transformer
	(cd "$root" && go build -o "$lbin" ./cmd/loomrun && go build -o "$tbin" ./examples/transformer)
fi
if [[ -n $lbin && -n $tbin ]]; then
	echo
	echo "gpu_check: loomrun -n 1 transformer -dp 1 -tp 1 -steps 20"
	if ! "$lbin" -n 1 "$tbin" -dp 1 -tp 1 -steps 20 -every 10 -json "$work/run.json"; then
		echo "gpu_check: the training run failed" >&2
		status=1
	elif ! grep -q '"backend": "nccl"' "$work/run.json"; then
		echo "gpu_check: the training run did not use NCCL: $(cat "$work/run.json")" >&2
		status=1
	fi
else
	echo "gpu_check: no go toolchain and no LOOMRUN/TRANSFORMER binaries: the training run is skipped"
fi

if [[ $status -ne 0 ]]; then
	echo "gpu_check: FAILED (exit $status)"
	grep -E -- '^\s*--- FAIL' "$work/log" || true
	exit "$status"
fi
if grep -qE -- '--- SKIP: TestGPU' "$work/log"; then
	echo "gpu_check: FAILED: a GPU test skipped" >&2
	exit 1
fi
echo "gpu_check: ok"

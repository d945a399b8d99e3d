#!/usr/bin/env bash
# Runs comm/nccl's GPU tests (TestGPU*) on a machine with at least one
# NVIDIA GPU, the driver (libcuda.so.1) and NCCL (libnccl.so.2), and exits
# non-zero if anything fails or cannot run. With one GPU it checks what one
# GPU can: loading and binding both libraries, the ncclConfig_t layout and
# the by-value unique id against the real NCCL (communicators made with
# every Config field the loaded NCCL knows, blocking and nonblocking, and
# through ncclCommInitRankScalable when it exists), one-rank communicators
# made through the rendezvous store on localhost, device buffers, streams
# and events, every collective on device buffers for every dtype and
# reduce op (in place and not, blocking and async), Split, the conformance
# suite through host staging, and the error paths: an init whose second
# rank never comes (timeout, then ncclCommAbort), a pointer NCCL rejects,
# freed buffers, buffers of another device; and NVML's view of the GPUs
# (comm/nccl/topology) matched to CUDA ordinals by PCI bus id. With more
# GPUs the conformance suite also runs on 2..4 ranks, one device each.
# Then, where Go and gcc are, topology's purego reading of NVML is compared
# with go-nvml's (`go test -tags gonvml ./comm/nccl/topology`).
#
# Usage: comm/nccl/gpu_check.sh [extra test flags, e.g. -test.run TestGPUErrors]
# Environment:
#   LOOM_NCCL / LOOM_CUDA_DRIVER  the libraries, if not on the loader path
#                                 (the script also looks where pip's
#                                 nvidia-nccl-cu12/cu13 and CUDA installs put NCCL)
#   NCCL_TEST_BIN                 a test binary built elsewhere with
#                                 `go test -c -o nccl.test ./comm/nccl`
#                                 (needed where there is no Go toolchain)
#   TIMEOUT                       seconds for the whole run (default 420)
#   LOOM_NCCL_GPU_FULL=1          the full conformance matrix instead of -short's
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"

if command -v nvidia-smi >/dev/null 2>&1; then
	nvidia-smi -L || true
else
	echo "gpu_check.sh: nvidia-smi not found; trying anyway" >&2
fi

# Find NCCL when the loader does not know it.
if [ -z "${LOOM_NCCL:-}" ] && ! /sbin/ldconfig -p 2>/dev/null | grep -q 'libnccl\.so\.2 '; then
	dirs=(/usr/local/nccl/lib /usr/local/cuda/lib64 /usr/local/cuda/targets/*/lib /usr/lib/x86_64-linux-gnu /usr/lib/aarch64-linux-gnu /usr/lib64)
	if command -v python3 >/dev/null 2>&1; then
		while IFS= read -r sp; do
			dirs+=("$sp/nvidia/nccl/lib")
		done < <(python3 -c 'import site, sys; print("\n".join(site.getsitepackages() + [site.getusersitepackages()]))' 2>/dev/null || true)
	fi
	for d in "${dirs[@]}"; do
		if [ -e "$d/libnccl.so.2" ]; then
			export LOOM_NCCL="$d/libnccl.so.2"
			break
		fi
	done
fi
echo "== NCCL: ${LOOM_NCCL:-libnccl.so.2 from the loader path}; CUDA driver: ${LOOM_CUDA_DRIVER:-libcuda.so.1}"

bin="${NCCL_TEST_BIN:-}"
if [ -z "$bin" ]; then
	if ! command -v go >/dev/null 2>&1; then
		echo "gpu_check.sh: no Go toolchain; build the test binary elsewhere with" >&2
		echo "  go test -c -o nccl.test ./comm/nccl" >&2
		echo "and set NCCL_TEST_BIN to it" >&2
		exit 2
	fi
	tmp="$(mktemp -d)"
	trap 'rm -rf "$tmp"' EXIT
	bin="$tmp/nccl.test"
	echo "== go test -c ./comm/nccl"
	go test -c -o "$bin" ./comm/nccl
fi

# Fail instead of skipping when the libraries or the GPU are missing; make
# NCCL validate pointers so that the bad-pointer check is an error, not a
# fault that spoils the context.
export LOOM_NCCL_REQUIRE=1
export NCCL_CHECK_POINTERS=1
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"

flags=("$@")
cd comm/nccl
echo "== nccl.test -test.run ^TestGPU"
start=$(date +%s)
set +e
timeout "${TIMEOUT:-420}" "$bin" -test.run '^TestGPU' -test.v -test.timeout "$(( ${TIMEOUT:-420} - 10 ))s" "${flags[@]}" 2>&1 |
	grep -Ev '^=== (RUN|PAUSE|CONT|NAME)|^ +--- PASS: TestGPUConformance/'
status=${PIPESTATUS[0]}
set -e
if command -v go >/dev/null 2>&1 && command -v gcc >/dev/null 2>&1; then
	echo "== go test -tags gonvml ./comm/nccl/topology (purego's NVML reading against go-nvml's)"
	set +e
	out="$(cd "$root" && CGO_ENABLED=1 go test -tags gonvml -count=1 -run 'GoNVML' -v ./comm/nccl/topology 2>&1)"
	nv=$?
	set -e
	# go-nvml's cgo build prints C deprecation warnings; show the test's lines only.
	grep -E '^(=== RUN|--- |    [a-z_]+\.go:[0-9]+:|ok|FAIL|PASS)' <<<"$out" || true
	if [ "$nv" -ne 0 ] || grep -q -- '--- SKIP: TestDiscoverMatchesGoNVML' <<<"$out"; then
		echo "== the NVML comparison failed or could not run" >&2
		[ "$status" -ne 0 ] || status=1
	fi
else
	echo "== no go or gcc: the comparison with go-nvml is skipped"
fi
if [ "$status" -eq 0 ]; then
	echo "== gpu_check: ok ($(( $(date +%s) - start ))s)"
else
	echo "== gpu_check: FAILED (exit $status)" >&2
fi
exit "$status"

#!/usr/bin/env bash
# loom's checks on a GPU machine, as one command that fits one H200 in under
# 8 minutes (issue 27; docs/notes/gpu-plan.md §8). Each check prints one line,
#
#   gpu_check: <name> PASS|FAIL|SKIP <numbers>
#
# and a last line `gpu_check: all PASS|FAIL|SKIP ...`; the exit status is 1
# when any check failed, else 0. The checks:
#   test-<pkg>        every package with TestGPU tests (device/cuda, comm/nccl,
#                     ...): its test binary with -test.run '^TestGPU' and
#                     LOOM_CUDA_REQUIRE=1, LOOM_NCCL_REQUIRE=1 (a missing GPU
#                     or library fails instead of skipping); a skipped TestGPU
#                     fails the check
#   flash-attn        from test-device/cuda's log: TestGPUFlashAttention (the
#                     fused attention against the CPU kernels on random shapes,
#                     float32 and bf16) and its line timing the fused forward
#                     and backward against the reference path (cuBLAS + causal
#                     softmax) at T = 1024, B·H = 96, dh = 64
#   block-attn        from test-device/cuda's log: TestGPUBlockAttention
#                     (context parallelism's block attention kernels, float64
#                     within 1e-12 and float32, against the CPU's block
#                     kernels, up to a cp=2 rank's blocks at T = 1024)
#   tiny-gpt          loomrun -n 1 transformer -device cuda -dp 1 -tp 1 -steps
#                     200: its final loss within 0.05 of PyTorch's step-200 loss
#                     (the example's own verdict line), on the NCCL backend
#   tiny-gpt-allocs   the same run's driver allocations (-json "mem".device
#                     .driver_allocs) equal to those of a 1-step run: none after
#                     the first step
#   moe               loomrun -n 1 moe -device cuda -dp 1 -ep 1 -steps 50: it
#                     finishes and its loss falls
#   gpt2-small-f32    loomrun -n 1 transformer -device cuda -dp 1 -tp 1 -model
#   gpt2-small-tf32   gpt2-small -steps 30 in float32, with -tf32 and with -mp
#   gpt2-small-bf16   bf16: tokens/s and MFU (bf16's goal: 35% of the dense
#                     peak, which must be the GPU's, not the CPUs'); under
#                     loomrun because -device cuda needs NCCL's backend
# A flag the binaries lack (-device, -tf32) fails its check, naming the flag.
#
# Usage:
#   scripts/gpu_check.sh --build DIR   build the binaries here (go, with
#       -trimpath -ldflags='-s -w', gzipped: about 16 MiB) into DIR, for a GPU
#       machine without Go; DIR/MANIFEST lists them and the commit
#   scripts/gpu_check.sh --bin DIR     run the checks with DIR's binaries
#   scripts/gpu_check.sh               build into a temporary folder (needs go),
#                                      then run
#   --dry-run   print every check as SKIP and exit 0 (what happens anyway on a
#               machine without a GPU, quickly and without building)
#   --host      run the checks on the CPU (-device cpu where the binaries have
#               -device, a few-step GPT-2-shaped model), to test this script on
#               a machine without a GPU; GPU tests skip there
# The test binaries run in their package folders (for testdata/), so run
# --bin DIR from a copy of the checkout DIR was built in, e.g.
#   scripts/gpu_check.sh --build .gpu_check    # here (.gitignore has it)
#   scripts/gpu_check.sh --bin .gpu_check      # there, in the copied checkout
#
# Output: with $OUT set (a folder the caller collects afterwards),
# $OUT/gpu_check.summary (the check lines), $OUT/gpu_check.log (every
# command's output), $OUT/runs.tar.gz (each run's log and -json) and
# $OUT/kcache.tar.gz (the NVRTC kernel cache, kept in $OUT/kcache during the
# run; put it in DIR to start the next run warm); four files, so that a
# collector that takes only a few gets them all. Without $OUT they go to a
# temporary folder whose path is printed.
# Environment: LOOM_CUDA_DRIVER, LOOM_NVRTC, LOOM_CUBLAS, LOOM_CUBLASLT,
# LOOM_NCCL force the libraries (otherwise the script looks for each one the
# loader does not know in the CUDA toolkit's folders and in the nvidia-*
# Python wheels, and says what it chose); LOOM_KERNEL_CACHE the kernel cache
# (without $OUT); GPU_CHECK_BUDGET the seconds all checks may take together
# (default 450: later checks get less time when earlier ones run long).
set -uo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

usage() {
	sed -n '2,/^set -uo/{/^set -uo/d;s/^# \{0,1\}//;p;}' "${BASH_SOURCE[0]}"
}

die() {
	echo "gpu_check: $*" >&2
	exit 2
}

mode=run bindir="" dry=0 host=0
while (($#)); do
	case $1 in
	--build | --bin)
		(($# >= 2)) || die "$1 needs a folder"
		[[ $1 == --build ]] && mode=build
		bindir=$2
		shift 2
		;;
	--dry-run) dry=1 && shift ;;
	--host) host=1 && shift ;;
	-h | --help) usage && exit 0 ;;
	*) die "unknown argument $1 (see --help)" ;;
	esac
done

# Packages whose TestGPU… functions need no GPU: launch's TestGPUOf checks
# the LOCAL_RANK → ordinal mapping.
not_gpu=(launch)

# gpu_test_pkgs lists the packages (relative to root) with TestGPU tests.
gpu_test_pkgs() {
	(cd "$root" && grep -rlE --include='*_test.go' '^func TestGPU' .) |
		sed -E 's|^\./||; s|/[^/]*$||' | sort -u |
		grep -vxF -f <(printf '%s\n' "${not_gpu[@]}")
}

# build DIR [gzip]: the binaries and the test binaries, and DIR/MANIFEST
# ("commit C", "bin NAME FILE", "test PKG FILE"); gzipped when asked.
build() {
	local dir=$1 zip=${2:-} tmp pkg f c
	command -v go >/dev/null || die "no go toolchain to build with; build elsewhere with --build DIR and pass --bin DIR"
	mkdir -p "$dir" || die "cannot make $dir"
	dir=$(cd "$dir" && pwd)
	tmp=$(mktemp -d) || die "mktemp failed"
	local flags=(-trimpath "-ldflags=-s -w")
	(cd "$root" && go build "${flags[@]}" -o "$tmp/" ./cmd/loomrun ./examples/transformer ./examples/moe) ||
		die "go build failed"
	{
		if c=$(cd "$root" && git rev-parse --short HEAD 2>/dev/null); then
			(cd "$root" && git diff --quiet HEAD) || c+=" (with uncommitted changes)"
			echo "commit $c"
		else
			echo "commit unknown (not a git checkout)"
		fi
		echo "bin loomrun loomrun"
		echo "bin transformer transformer"
		echo "bin moe moe"
	} >"$tmp/MANIFEST"
	while read -r pkg; do
		f=${pkg//\//_}.test
		(cd "$root" && go test -c "${flags[@]}" -o "$tmp/$f" "./$pkg") || die "go test -c ./$pkg failed"
		echo "test $pkg $f" >>"$tmp/MANIFEST"
	done < <(gpu_test_pkgs)
	rm -f "$dir"/*.gz "$dir/MANIFEST"
	for f in "$tmp"/*; do
		if [[ -n $zip && $f != */MANIFEST ]]; then
			gzip -9n -c "$f" >"$dir/$(basename "$f").gz" || die "gzip $f failed"
		else
			cp "$f" "$dir/" || die "cp $f failed"
		fi
	done
	rm -rf "$tmp"
}

if [[ $mode == build ]]; then
	build "$bindir" zip
	echo "gpu_check: built into $bindir ($(du -sh "$bindir" | cut -f1)):"
	sed 's/^/  /' "$bindir/MANIFEST"
	exit 0
fi

# ---- the run ----

start=$SECONDS
budget=${GPU_CHECK_BUDGET:-450}
[[ $budget =~ ^[0-9]+$ ]] || die "GPU_CHECK_BUDGET=$budget is not a number of seconds"
# gpu_reason prints why this machine has no usable GPU, or nothing.
gpu_reason() {
	if command -v nvidia-smi >/dev/null; then
		# Not a pipe into grep -q: under pipefail, grep's early exit can
		# fail the writer with SIGPIPE, and so the test.
		grep -q '^GPU ' <<<"$(nvidia-smi -L 2>/dev/null)" && return
		echo "nvidia-smi lists no GPU"
	elif compgen -G '/dev/nvidia[0-9]*' >/dev/null; then
		return
	else
		echo "no nvidia-smi and no /dev/nvidia*"
	fi
}

# why: the reason nothing runs (every check is a SKIP), or "".
why=""
if ((dry)); then
	why="dry run (--dry-run)"
elif ((!host)); then
	why=$(gpu_reason)
	[[ -n $why ]] && why="no GPU: $why"
fi

work=$(mktemp -d) || die "mktemp failed"
trap 'rm -rf "$work"' EXIT
if [[ -n ${OUT:-} ]]; then
	mkdir -p "$OUT" || die "cannot make \$OUT=$OUT"
	outdir=$OUT
elif [[ -n $why ]]; then
	outdir=$work # nothing runs: no logs to keep
else
	outdir=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX") || die "mktemp failed"
fi
runs=$work/runs
mkdir -p "$runs"
summary=$outdir/gpu_check.summary
fulllog=$outdir/gpu_check.log
: >"$summary"
: >"$fulllog"
npass=0 nfail=0 nskip=0

# report NAME PASS|FAIL|SKIP NUMBERS... prints and records one check's line.
report() {
	local name=$1 verdict=$2
	shift 2
	printf 'gpu_check: %s %s %s\n' "$name" "$verdict" "$*" | tee -a "$summary" "$fulllog"
	case $verdict in
	PASS) npass=$((npass + 1)) ;;
	FAIL) nfail=$((nfail + 1)) ;;
	*) nskip=$((nskip + 1)) ;;
	esac
}

# info MESSAGE: a line about the setup, not a check.
info() {
	echo "== $*" | tee -a "$fulllog"
}

# tail_of LOG prints a failed run's last lines, indented.
tail_of() {
	[[ -s $1 ]] && tail -n "${2:-8}" "$1" | sed 's/^/      /'
}

# The checks, in order: the test packages, then the training runs.
tests=() # "PKG FILE"
if [[ -n $bindir ]]; then
	[[ -f $bindir/MANIFEST ]] || die "$bindir/MANIFEST not found: build DIR with --build DIR"
	while read -r kind a b; do
		[[ $kind == test ]] && tests+=("$a $b")
	done <"$bindir/MANIFEST"
else
	while read -r pkg; do tests+=("$pkg ${pkg//\//_}.test"); done < <(gpu_test_pkgs)
fi
train_checks=(tiny-gpt tiny-gpt-allocs moe gpt2-small-f32 gpt2-small-tf32 gpt2-small-bf16)
checks=()
for t in "${tests[@]}"; do
	checks+=("test-${t%% *}")
	[[ ${t%% *} == device/cuda ]] && checks+=(flash-attn block-attn)
done
checks+=("${train_checks[@]}")

finish() {
	local verdict=PASS
	((nfail > 0)) && verdict=FAIL
	((nfail == 0 && npass == 0)) && verdict=SKIP
	if [[ -n ${OUT:-} && -d $OUT/kcache ]]; then
		tar -czf "$OUT/kcache.tar.gz" -C "$OUT" kcache && rm -rf "$OUT/kcache"
	fi
	local where=""
	if [[ $outdir != "$work" ]]; then
		tar -czf "$outdir/runs.tar.gz" -C "$work" runs 2>/dev/null
		where=" (logs in $outdir)"
		# Again together, so that the end of the output holds every line.
		echo
		cat "$summary"
	fi
	printf 'gpu_check: all %s %d passed, %d failed, %d skipped in %ds%s\n' \
		"$verdict" "$npass" "$nfail" "$nskip" $((SECONDS - start)) "$where" | tee -a "$fulllog"
	[[ $verdict != FAIL ]]
	exit
}

if [[ -n $why ]]; then
	for c in "${checks[@]}"; do report "$c" SKIP "$why"; done
	finish
fi

bin=$work/bin
mkdir -p "$bin"
if [[ -n $bindir ]]; then
	for f in "$bindir"/*; do
		case $f in
		*/MANIFEST | */kcache.tar.gz) ;;
		*.gz) gunzip -c "$f" >"$bin/$(basename "${f%.gz}")" || die "gunzip $f failed" ;;
		*) cp "$f" "$bin/" || die "cp $f failed" ;;
		esac
	done
	chmod +x "$bin"/* 2>/dev/null
	info "binaries from $bindir: $(sed -n 's/^commit //p' "$bindir/MANIFEST")"
else
	info "building the binaries (go)"
	build "$bin"
fi

# Where the loader does not know a library, look for it in the CUDA
# toolkit's folders and the nvidia-* wheels of the Python on the PATH, and
# point its variable (and the loader) at it.
lib_dirs=(/usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/local/cuda/lib64 /usr/local/cuda/targets/*/lib
	/usr/local/cuda-*/lib64 /usr/local/nccl/lib /usr/lib/x86_64-linux-gnu /usr/lib/aarch64-linux-gnu /usr/lib64)
if command -v python3 >/dev/null; then
	while IFS= read -r sp; do
		lib_dirs+=("$sp"/nvidia/*/lib)
	done < <(python3 -c 'import site; print("\n".join(site.getsitepackages() + [site.getusersitepackages()]))' 2>/dev/null)
fi
known=$( (/sbin/ldconfig -p || ldconfig -p) 2>/dev/null)
# find_lib VAR SONAME...: keep VAR when set or when the loader knows one of
# the sonames (ldconfig's cache or LD_LIBRARY_PATH); else set VAR to the
# first file found.
find_lib() {
	local var=$1 so d
	shift
	if [[ -n ${!var:-} ]]; then
		info "$var=${!var} (set)"
		return
	fi
	for so in "$@"; do
		if awk -v so="$so" '$1 == so { f = 1 } END { exit !f }' <<<"$known"; then
			info "$var: $so from the loader's cache"
			return
		fi
		local IFS=:
		for d in ${LD_LIBRARY_PATH:-}; do
			if [[ -n $d && -e $d/$so ]]; then
				info "$var: $so from LD_LIBRARY_PATH ($d)"
				return
			fi
		done
		unset IFS
	done
	for so in "$@"; do
		for d in "${lib_dirs[@]}"; do
			if [[ -e $d/$so ]]; then
				export "$var=$d/$so"
				export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
				info "$var=$d/$so (found)"
				return
			fi
		done
	done
	info "$var: none of $* found; the default search applies"
}
if ((!host)); then
	find_lib LOOM_CUDA_DRIVER libcuda.so.1
	find_lib LOOM_NCCL libnccl.so.2
	find_lib LOOM_NVRTC libnvrtc.so.13 libnvrtc.so.12 libnvrtc.so.11.2
	find_lib LOOM_CUBLAS libcublas.so.13 libcublas.so.12 libcublas.so.11
	major=$(sed -nE 's/.*libcublas\.so\.([0-9]+).*/\1/p' <<<"${LOOM_CUBLAS:-}")
	if [[ -n $major ]]; then
		find_lib LOOM_CUBLASLT "libcublasLt.so.$major"
	else
		find_lib LOOM_CUBLASLT libcublasLt.so.13 libcublasLt.so.12 libcublasLt.so.11
	fi
	while IFS= read -r g; do info "GPU: $g"; done < <(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null)
	export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
	if [[ -n ${OUT:-} ]]; then
		export LOOM_KERNEL_CACHE=$OUT/kcache
	fi
	if [[ -n ${LOOM_KERNEL_CACHE:-} && -f $bindir/kcache.tar.gz ]]; then
		mkdir -p "$LOOM_KERNEL_CACHE" &&
			tar -xzf "$bindir/kcache.tar.gz" -C "$LOOM_KERNEL_CACHE" --strip-components=1 &&
			info "kernel cache $LOOM_KERNEL_CACHE warmed from $bindir/kcache.tar.gz"
	fi
fi

# limit DEFAULT: the seconds the next run may take: DEFAULT, or less so that
# every check after it keeps 20 s of the budget.
left_checks=${#checks[@]}
limit() {
	local left=$((budget - (SECONDS - start) - 20 * (left_checks - 1)))
	((left < $1)) && echo "$left" || echo "$1"
}

# run NAME SECONDS CMD...: runs CMD with a time limit, its output in
# $runs/NAME.log (and the full log); returns its status (124: timed out).
run() {
	local name=$1 t=$2 rc
	shift 2
	echo "== $name (limit ${t}s): $*" >>"$fulllog"
	timeout -k 10 "$t" "$@" >"$runs/$name.log" 2>&1
	rc=$?
	cat "$runs/$name.log" >>"$fulllog"
	echo "== $name: exit $rc" >>"$fulllog"
	return "$rc"
}

# why_failed NAME RC SECONDS: a failed run's reason: the program's own
# error line ("[rank R] transformer: ..." under loomrun), else its last line.
why_failed() {
	local line
	case $2 in
	124 | 137) echo "timed out after ${3}s" ;;
	*)
		line=$(grep -E '^(\[rank [0-9]+\] )?(transformer|moe): ' "$runs/$1.log" | tail -n 1)
		[[ -n $line ]] || line=$(grep -v '^\s*$' "$runs/$1.log" | tail -n 1)
		echo "exit $2: $(cut -c1-300 <<<"$line")"
		;;
	esac
}

# json FILE KEY: a number or string of -json's output (the first KEY).
json() {
	tr -d '\n' <"$1" 2>/dev/null | grep -oE "\"$2\": *(-?[0-9.eE+-]+|\"[^\"]*\")" | head -n 1 |
		sed -E 's/^[^:]*: *//; s/^"//; s/"$//'
}

# first_loss FILE: the first of -json's "losses".
first_loss() {
	tr -d ' \n' <"$1" 2>/dev/null | grep -oE '"losses":\[[^],]*' | sed 's/.*\[//'
}

# ---- test binaries ----

# names PASS|FAIL|SKIP LOG: the top-level TestGPU tests of that outcome.
names() {
	grep -oE "^--- $1: TestGPU[^ ]*" "$2" | sed "s/^--- $1: //" | paste -sd ' '
}

for t in "${tests[@]}"; do
	pkg=${t%% *} file=${t#* }
	name=test-$pkg
	lim=$(limit "$(case $pkg in device/cuda) echo 150 ;; comm/nccl) echo 100 ;; *) echo 60 ;; esac)")
	left_checks=$((left_checks - 1))
	if ((lim < 10)); then
		report "$name" FAIL "no time left in the ${budget}s budget"
		continue
	fi
	if [[ ! -x $bin/$file ]]; then
		report "$name" FAIL "no test binary $file"
		continue
	fi
	log=$runs/${name//\//_}.log
	envs=()
	((host)) || envs=(LOOM_CUDA_REQUIRE=1 LOOM_NCCL_REQUIRE=1 LOOM_CUDA_BENCH=1 NCCL_CHECK_POINTERS=1)
	t0=$SECONDS
	(cd "$root/$pkg" && run "${name//\//_}" "$lim" env "${envs[@]}" "$bin/$file" \
		-test.run '^TestGPU' -test.v -test.count=1 -test.timeout "$((lim - 5))s")
	rc=$?
	secs=$((SECONDS - t0))
	p=$(grep -cE '^--- PASS: TestGPU' "$log")
	f=$(grep -cE '^--- FAIL: TestGPU' "$log")
	s=$(grep -cE '^--- SKIP: TestGPU' "$log")
	nums="$p passed, $f failed, $s skipped in ${secs}s"
	if ((rc == 124 || rc == 137)); then
		report "$name" FAIL "timed out after ${lim}s; $nums"
	elif ((rc != 0 || f > 0)); then
		report "$name" FAIL "$nums: $(names FAIL "$log")"
		tail_of "$log"
	elif ((p + s == 0)); then
		report "$name" FAIL "no TestGPU test ran"
	elif ((s > 0 && !host)); then
		report "$name" FAIL "$nums: $(names SKIP "$log") skipped on a GPU machine"
	elif ((p == 0)); then
		report "$name" SKIP "$nums (host mode)"
	else
		report "$name" PASS "$nums"
	fi
	if [[ $pkg == device/cuda ]]; then
		# TestGPUFlashAttention's verdict (the fused attention against the
		# CPU kernels on random shapes) and its timing line against the
		# reference path at T = 1024.
		line=$(grep -oE 'flash_attn: .*' "$log" | tail -n 1)
		if grep -qE '^\s*--- FAIL: TestGPUFlashAttention' "$log"; then
			report flash-attn FAIL "TestGPUFlashAttention failed (see test-device/cuda)"
		elif grep -qE '^\s*--- PASS: TestGPUFlashAttention' "$log"; then
			if [[ -n $line ]]; then
				report flash-attn PASS "${line#flash_attn: }"
			elif ((host)); then
				report flash-attn SKIP "matches the CPU; no timing in host mode"
			else
				report flash-attn FAIL "matches the CPU, but no timing line (LOOM_CUDA_BENCH=1 was set)"
			fi
		elif ((host)); then
			report flash-attn SKIP "TestGPUFlashAttention did not run (host mode)"
		else
			report flash-attn FAIL "TestGPUFlashAttention did not run"
		fi
		# TestGPUBlockAttention's verdict: context parallelism's block
		# attention against the CPU's block kernels.
		if grep -qE '^\s*--- FAIL: TestGPUBlockAttention' "$log"; then
			report block-attn FAIL "TestGPUBlockAttention failed (see test-device/cuda)"
		elif grep -qE '^\s*--- PASS: TestGPUBlockAttention' "$log"; then
			report block-attn PASS "matches the CPU block kernels (float64 within 1e-12)"
		elif ((host)); then
			report block-attn SKIP "TestGPUBlockAttention did not run (host mode)"
		else
			report block-attn FAIL "TestGPUBlockAttention did not run"
		fi
	fi
done

# ---- training runs ----

# has_flag BIN FLAG: whether BIN's usage lists -FLAG.
has_flag() {
	grep -qE -- "^  -$2( |\$)" <<<"$("$bin/$1" -h 2>&1)" # not a pipe: see gpu_reason
}

# The device flag: -device cuda on a GPU; on the host -device cpu where it
# exists.
dev_transformer=() dev_moe=() missing_transformer="" missing_moe=""
for prog in transformer moe; do
	if has_flag "$prog" device; then
		if ((host)); then d=(-device cpu); else d=(-device cuda); fi
	elif ((host)); then
		d=()
	else
		d=() && printf -v "missing_$prog" '%s' "$prog has no -device flag (built from a commit without -device cuda)"
	fi
	if [[ $prog == transformer ]]; then dev_transformer=("${d[@]}"); else dev_moe=("${d[@]}"); fi
done

# tiny-gpt and tiny-gpt-allocs.
lim=$(limit 150)
left_checks=$((left_checks - 1))
if [[ -n $missing_transformer ]]; then
	report tiny-gpt FAIL "$missing_transformer"
elif ((lim < 10)); then
	report tiny-gpt FAIL "no time left in the ${budget}s budget"
else
	run tiny-gpt "$lim" "$bin/loomrun" -n 1 "$bin/transformer" "${dev_transformer[@]}" -dp 1 -tp 1 \
		-steps 200 -every 20 -json "$runs/tiny-gpt.json"
	rc=$?
	if ((rc != 0)); then
		report tiny-gpt FAIL "$(why_failed tiny-gpt "$rc" "$lim")"
		tail_of "$runs/tiny-gpt.log"
	else
		# "PyTorch's loss at step 200: 2.123456; |Δ| 0.0123, within the tolerance 0.05"
		v=$(sed -nE "s/.*PyTorch's loss at step 200: ([-0-9.]+); \|[^|]*\| ([0-9.]+), (within|OUTSIDE) the tolerance ([0-9.eE+-]+).*/\1 \2 \3 \4/p" "$runs/tiny-gpt.log" | tail -n 1)
		read -r want diff verdict _ <<<"$v"
		loss=$(json "$runs/tiny-gpt.json" final_loss)
		tps=$(json "$runs/tiny-gpt.json" tokens_per_s)
		backend=$(json "$runs/tiny-gpt.json" backend)
		device=$(json "$runs/tiny-gpt.json" device)
		if [[ -z $v || -z $loss ]]; then
			report tiny-gpt FAIL "no verdict line \"PyTorch's loss at step 200: ...\" in the output, or no final_loss in -json"
			tail_of "$runs/tiny-gpt.log"
		else
			nums=$(printf 'loss %.4f vs PyTorch %.4f at step 200 (|Δ| %.4f, tolerance 0.05), %.0f tokens/s, backend %s%s' \
				"$loss" "$want" "$diff" "${tps:-0}" "${backend:-?}" "${device:+, device $device}")
			if [[ $verdict != within ]] || ! awk -v d="$diff" 'BEGIN { exit !(d <= 0.05) }'; then
				report tiny-gpt FAIL "$nums"
			elif ((!host)) && [[ $backend != nccl ]]; then
				report tiny-gpt FAIL "$nums: not on NCCL"
			else
				report tiny-gpt PASS "$nums"
			fi
		fi
	fi
fi

lim=$(limit 60)
left_checks=$((left_checks - 1))
if [[ -n $missing_transformer ]]; then
	report tiny-gpt-allocs FAIL "$missing_transformer"
elif [[ ! -s $runs/tiny-gpt.json ]]; then
	report tiny-gpt-allocs FAIL "the 200-step run wrote no -json"
elif ((lim < 10)); then
	report tiny-gpt-allocs FAIL "no time left in the ${budget}s budget"
else
	run tiny-gpt-1 "$lim" "$bin/loomrun" -n 1 "$bin/transformer" "${dev_transformer[@]}" -dp 1 -tp 1 \
		-steps 1 -json "$runs/tiny-gpt-1.json"
	rc=$?
	a1=$(json "$runs/tiny-gpt-1.json" driver_allocs)
	a200=$(json "$runs/tiny-gpt.json" driver_allocs)
	if ((rc != 0)); then
		report tiny-gpt-allocs FAIL "the 1-step run: $(why_failed tiny-gpt-1 "$rc" "$lim")"
		tail_of "$runs/tiny-gpt-1.log"
	elif [[ -z $a1 || -z $a200 ]]; then
		if ((host)); then
			report tiny-gpt-allocs SKIP "no \"mem\".device in -json (host tensors)"
		else
			report tiny-gpt-allocs FAIL "no \"mem\".device.driver_allocs in -json"
		fi
	else
		nums="driver allocations: $a1 after step 1, $a200 after step 200 (segments $(json "$runs/tiny-gpt.json" segments), peak reserved $(json "$runs/tiny-gpt.json" peak_reserved) B)"
		if ((a200 == a1)); then
			report tiny-gpt-allocs PASS "$nums"
		else
			report tiny-gpt-allocs FAIL "$nums"
		fi
	fi
fi

# moe.
lim=$(limit 90)
left_checks=$((left_checks - 1))
if [[ -n $missing_moe ]]; then
	report moe FAIL "$missing_moe"
elif ((lim < 10)); then
	report moe FAIL "no time left in the ${budget}s budget"
else
	run moe "$lim" "$bin/loomrun" -n 1 "$bin/moe" "${dev_moe[@]}" -dp 1 -ep 1 -steps 50 -every 10 -json "$runs/moe.json"
	rc=$?
	if ((rc != 0)); then
		report moe FAIL "$(why_failed moe "$rc" "$lim")"
		tail_of "$runs/moe.log"
	else
		l0=$(first_loss "$runs/moe.json")
		l1=$(json "$runs/moe.json" final_loss)
		nums=$(printf 'loss %.4f at step 1, %.4f at step 50, %.0f tokens/s, MFU %.2f%%' \
			"${l0:-0}" "${l1:-0}" "$(json "$runs/moe.json" tokens_per_s)" "$(awk -v m="$(json "$runs/moe.json" mfu)" 'BEGIN { print 100 * m }')")
		if [[ -z $l0 || -z $l1 ]]; then
			report moe FAIL "no losses in -json"
		elif awk -v a="$l0" -v b="$l1" 'BEGIN { exit !(b < a) }'; then
			report moe PASS "$nums"
		else
			report moe FAIL "$nums: the loss did not fall"
		fi
	fi
fi

# gpt2-small in float32, TF32 and bf16.
gpt2=(-model gpt2-small -steps 30 -every 10)
# On the host a GPT-2-shaped model of one small block, for a few steps.
((host)) && gpt2=(-model gpt2-small -layers 1 -width 64 -heads 2 -ff 256 -seq 64 -vocab 512 -batch 2 -steps 3 -every 1)
for prec in f32 tf32 bf16; do
	name=gpt2-small-$prec
	lim=$(limit 80)
	left_checks=$((left_checks - 1))
	extra=()
	case $prec in
	tf32) extra=(-tf32) ;;
	bf16) extra=(-mp bf16) ;;
	esac
	if [[ -n $missing_transformer ]]; then
		report "$name" FAIL "$missing_transformer"
		continue
	fi
	if [[ $prec == tf32 ]] && ! has_flag transformer tf32; then
		report "$name" FAIL "transformer has no -tf32 flag"
		continue
	fi
	if ((lim < 10)); then
		report "$name" FAIL "no time left in the ${budget}s budget"
		continue
	fi
	run "$name" "$lim" "$bin/loomrun" -n 1 "$bin/transformer" "${dev_transformer[@]}" -dp 1 -tp 1 "${gpt2[@]}" "${extra[@]}" \
		-json "$runs/$name.json"
	rc=$?
	if ((rc != 0)); then
		report "$name" FAIL "$(why_failed "$name" "$rc" "$lim")"
		tail_of "$runs/$name.log"
		continue
	fi
	tps=$(json "$runs/$name.json" tokens_per_s)
	mfu=$(json "$runs/$name.json" mfu)
	peak=$(json "$runs/$name.json" peak_flops)
	if [[ -z $tps || -z $mfu ]]; then
		report "$name" FAIL "no tokens_per_s or mfu in -json"
		continue
	fi
	nums=$(awk -v t="$tps" -v m="$mfu" -v p="${peak:-0}" 'BEGIN { printf "%.0f tokens/s, MFU %.2f%% of %.4g TFLOP/s", t, 100 * m, p / 1e12 }')
	if [[ $prec == bf16 ]]; then
		if awk -v m="$mfu" 'BEGIN { exit !(m >= 0.35) }'; then nums+=" (goal 35%: met)"; else nums+=" (goal 35%: not met)"; fi
	fi
	# A GPU run's MFU must be against the GPU's peak (train.DevicePeak),
	# not the CPUs' estimate the host path uses.
	src=$(json "$runs/$name.json" peak_source)
	if ((!host)) && [[ $src == *EstimatePeak* ]]; then
		report "$name" FAIL "$nums: the MFU is against the CPUs' estimated peak, not the GPU's ($(cut -c1-120 <<<"$src"))"
	else
		report "$name" PASS "$nums"
	fi
done

finish

#!/usr/bin/env bash
# Multi-host faults on one machine: two network namespaces joined by a veth
# pair are the two hosts of a job (addresses 10.213.0.1 and 10.213.0.2,
# which exist only inside the namespaces). It checks that each fault ends
# every process of the job on both "hosts" in time, naming what failed:
#
#   loomrun, two nodes (--nnodes 2, --node-timeout 4s), the ranks being
#   cmd/loomrun's test binary in its multinode mode:
#     rank-killed      SIGKILL to a rank of node 1
#     node1-killed     SIGKILL to node 1's loomrun
#     node0-killed     SIGKILL to node 0's loomrun (the store's host)
#     link-down        the veth link taken down mid-run
#   each must end every process on both nodes within 2x --node-timeout.
#
#   mpirun across the namespaces (a plm_rsh_agent that runs `ip netns
#   exec`), examples/transformer built with -tags mpi, LOOM_TIMEOUT=8s:
#     mpi-rank-stopped SIGSTOP to node 1's rank: rank 0 times out, reports
#                      and aborts the job (MPI_Abort)
#     mpi-link-down    the link taken down mid-run
#   mpirun must exit non-zero within 2x LOOM_TIMEOUT, leaving no orted and
#   no rank behind.
#
#   loomrun, two nodes of 2 ranks each, examples/transformer (built with
#   CGO_ENABLED=0) -dp 2 -tp 2 on the TCP backend, which it picks by
#   itself (LOOM_CUDA_DRIVER=off: hosts without GPUs), LOOM_TIMEOUT=8s and
#   --node-timeout 8s (the backend's timeout and loomrun's heartbeats
#   armed alike: a stalled rank only the backend sees, a killed one both,
#   a partition whichever fires first):
#     tcp-losses       no fault: the losses of the same layout on
#                      in-process ranks, bit for bit (both LOOM_BLAS=go)
#     tcp-rank-killed  SIGKILL to a rank of node 1 mid-run
#     tcp-link-down    the veth link taken down mid-collective
#     tcp-rank-stopped SIGSTOP to a rank of node 1
#   each must end every process on both nodes within 2x LOOM_TIMEOUT, node
#   0's loomrun reporting the failure and the nodes' output naming the
#   rank at fault by its world rank (for the partition: a rank of node 1,
#   or node 1).
#
#   loomrun, two nodes of 2 ranks each, a user's program in a module of
#   its own (tests/testdata/usertrain, built with CGO_ENABLED=0 against
#   this clone through a replace directive; it picks its ranks with
#   launch.Auto), no fault, LOOM_BLAS=go:
#     ext-dp2-tp2, ext-fsdp4, ext-ep2-dp2
#                      the layout's 8 losses on 2+2 processes match one
#                      in-process rank's to 1e-6 relative (the layouts
#                      differ only in the order of float32 sums), with the
#                      TCP backend's own algorithms and with
#                      LOOM_ALGO=direct; with direct they also equal the
#                      same layout's on in-process ranks bit for bit.
#
# Each case prints one line: "netns: PASS|FAIL <case>: ended in <s> (bound
# <s>) ...". Needs root and `ip netns`; without them it says so and exits
# 0. It cleans up the namespaces on exit and removes leftovers of an
# earlier run first.
#
# Usage: scripts/netns_check.sh [loomrun|mpi|tcp|external ...]   (the case groups to
# run, default all; Debian: iproute2, openmpi-bin, libopenmpi-dev)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

ns0=loomnet0 ns1=loomnet1
veth0=loomveth0 veth1=loomveth1
addr0=10.213.0.1 addr1=10.213.0.2
port=29513
node_timeout=4 # seconds
loom_timeout=8 # seconds
tcp_timeout=8  # seconds
groups=" ${*:-loomrun mpi tcp external} "

if [ "$(id -u)" != 0 ]; then
	echo "netns: skipped: needs root to make network namespaces (ip netns)"
	exit 0
fi
if ! command -v ip >/dev/null || ! ip netns add loomnet-probe 2>/dev/null; then
	echo "netns: skipped: ip netns add does not work here (iproute2 missing, or no CAP_SYS_ADMIN)"
	exit 0
fi
ip netns del loomnet-probe

tmp="$(mktemp -d)"
cleanup() {
	# Only what this run started: every process of the job carries $tmp
	# in its argv (the binaries, the rsh agent in orted's).
	for pid in $(pgrep -f "$tmp/" || true); do
		kill -9 "$pid" 2>/dev/null || true
	done
	ip netns del "$ns0" 2>/dev/null || true
	ip netns del "$ns1" 2>/dev/null || true
	rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 1' INT TERM

# net makes (again) the two namespaces and the link between them.
net() {
	ip netns del "$ns0" 2>/dev/null || true
	ip netns del "$ns1" 2>/dev/null || true
	ip netns add "$ns0"
	ip netns add "$ns1"
	ip link add "$veth0" netns "$ns0" type veth peer name "$veth1" netns "$ns1"
	ip -n "$ns0" addr add "$addr0/24" dev "$veth0"
	ip -n "$ns1" addr add "$addr1/24" dev "$veth1"
	for n in "$ns0:$veth0" "$ns1:$veth1"; do
		ip -n "${n%%:*}" link set lo up
		ip -n "${n%%:*}" link set "${n#*:}" up
	done
}
net

echo "== go build ./cmd/loomrun, go test -c ./cmd/loomrun, go build [-tags mpi] ./examples/transformer"
go build -o "$tmp/loomrun" ./cmd/loomrun
go test -c -o "$tmp/loomrun.test" ./cmd/loomrun
CGO_ENABLED=0 go build -o "$tmp/transformer-tcp" ./examples/transformer
# The user's program: a module of its own beside the clone, offline.
mkdir "$tmp/usermod"
cp tests/testdata/usertrain/main.go go.sum "$tmp/usermod/"
printf 'module example.com/user\n\ngo 1.26\n\nrequire github.com/b7ea7098/loom v0.0.0\n\nreplace github.com/b7ea7098/loom => %s\n' "$root" >"$tmp/usermod/go.mod"
(cd "$tmp/usermod" && GOFLAGS=-mod=mod GOPROXY=off GOWORK=off CGO_ENABLED=0 go build -o "$tmp/user" .)
mpi=1
if command -v mpirun >/dev/null && pkg-config --exists ompi-c 2>/dev/null; then
	go build -tags mpi -o "$tmp/transformer" ./examples/transformer
else
	mpi=0
	echo "netns: the mpirun cases need Open MPI (apt-get install -y openmpi-bin libopenmpi-dev)" >&2
fi

now() { date +%s.%N; }
# elapsed T0: seconds since T0, two decimals.
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.2f", b - a }'; }
# alive PATTERN: whether a live (not zombie) process's argv matches.
alive() {
	local pid
	for pid in $(pgrep -f "$1" || true); do
		if [ "$(ps -o stat= -p "$pid" 2>/dev/null | cut -c1)" != Z ] && [ -n "$(ps -o stat= -p "$pid" 2>/dev/null)" ]; then
			return 0
		fi
	done
	return 1
}
# await_end PATTERN LIMIT: waits until no process matching PATTERN lives,
# at most LIMIT seconds.
await_end() {
	local deadline
	deadline=$(awk -v a="$(now)" -v d="$2" 'BEGIN { printf "%.3f", a + d }')
	while alive "$1"; do
		if awk -v a="$(now)" -v d="$deadline" 'BEGIN { exit !(a > d) }'; then
			return 1
		fi
		sleep 0.05
	done
}
# until_in FILE TEXT LIMIT: waits until FILE contains TEXT.
until_in() {
	local i
	for ((i = 0; i < $3 * 20; i++)); do
		grep -qF -- "$2" "$1" 2>/dev/null && return 0
		sleep 0.05
	done
	return 1
}

fails=0
# verdict CASE TOOK BOUND PROBLEMS...: one summary line; TOOK is the time
# the job took to end after the fault, in seconds.
verdict() {
	local name=$1 took=$2 bound=$3
	shift 3
	if [ $# -eq 0 ]; then
		echo "netns: PASS $name: ended in ${took}s (bound ${bound}s)"
	else
		echo "netns: FAIL $name: ${took}s (bound ${bound}s): $*"
		fails=$((fails + 1))
	fi
}

# pkill_job PATTERN: SIGKILL what is left of a failed case.
pkill_job() {
	local pid
	for pid in $(pgrep -f "$1" || true); do kill -9 "$pid" 2>/dev/null || true; done
}
# loomrun_case NAME FAULT WANT0 WANT1: two nodes, the fault, the checks.
# WANTn is a line node n must print ("" to skip: a killed node prints
# nothing more).
loomrun_case() {
	local name=$1 fault=$2 want0=$3 want1=$4
	local m="$tmp/job-$name" # in every argv of the job: the ranks' marker
	local flags=(--nnodes 2 -n 2 --master-addr "$addr0" --master-port "$port" --node-timeout "${node_timeout}s" --grace 1s --timeout 60s)
	net
	ip netns exec "$ns0" "$tmp/loomrun" --node-rank 0 "${flags[@]}" -- "$tmp/loomrun.test" -loomrun-test-child multinode 0 hold 4 "$m" >"$tmp/$name.0" 2>&1 &
	ip netns exec "$ns1" "$tmp/loomrun" --node-rank 1 "${flags[@]}" -- "$tmp/loomrun.test" -loomrun-test-child multinode 1 hold 4 "$m" >"$tmp/$name.1" 2>&1 &
	if ! until_in "$tmp/$name.1" "[rank 3] verified" 15 || ! until_in "$tmp/$name.0" "[rank 0] verified" 5; then
		verdict "$name" - 0 "the job did not start: $(cat "$tmp/$name.0" "$tmp/$name.1")"
		pkill_job "$m"
		wait 2>/dev/null || true
		return
	fi
	sleep 0.5
	local t0
	t0=$(now)
	case $fault in
	rank) kill -9 "$(pgrep -f "^$tmp/loomrun.test -loomrun-test-child multinode 1 hold 4 $m" | head -1)" ;;
	node1) kill -9 "$(pgrep -f "^$tmp/loomrun --node-rank 1 .*$m")" ;;
	node0) kill -9 "$(pgrep -f "^$tmp/loomrun --node-rank 0 .*$m")" ;;
	link) ip -n "$ns1" link set "$veth1" down ;;
	esac
	local problems=()
	local took
	if ! await_end "$m" $((2 * node_timeout)); then
		took=">$((2 * node_timeout))"
		problems+=("still running after $((2 * node_timeout))s: $(pgrep -af "$m" | cut -c1-120 | tr '\n' ';')")
		pkill_job "$m"
	else
		took=$(elapsed "$t0")
	fi
	wait 2>/dev/null || true
	[ -n "$want0" ] && ! grep -qF -- "$want0" "$tmp/$name.0" && problems+=("node 0 did not print \"$want0\"")
	[ -n "$want1" ] && ! grep -qF -- "$want1" "$tmp/$name.1" && problems+=("node 1 did not print \"$want1\"")
	if [ ${#problems[@]} -gt 0 ]; then
		printf '%s\n' "--- node 0:" "$(cat "$tmp/$name.0")" "--- node 1:" "$(cat "$tmp/$name.1")" >&2
	fi
	verdict "$name" "$took" $((2 * node_timeout)) "${problems[@]}"
}

if [[ $groups == *" loomrun "* ]]; then
echo "== loomrun, 2 nodes x 2 ranks, --node-timeout ${node_timeout}s"
loomrun_case rank-killed rank \
	"loomrun[node 0]: job failed: rank " "loomrun[node 1]: job failed: rank "
grep -qE "job failed: rank [23] \(node 1\) was killed by signal SIGKILL" "$tmp/rank-killed.0" ||
	{ echo "netns: FAIL rank-killed: node 0 does not name the killed rank of node 1"; fails=$((fails + 1)); }
loomrun_case node1-killed node1 \
	"loomrun[node 0]: job failed: node 1's loomrun stopped responding (no heartbeat for ${node_timeout}s)" ""
loomrun_case node0-killed node0 \
	"" "loomrun[node 1]: job failed: lost node 0's rendezvous server at $addr0:$port"
loomrun_case link-down link \
	"loomrun[node 0]: job failed: node 1's loomrun stopped responding (no heartbeat for ${node_timeout}s)" \
	"loomrun[node 1]: job failed: node 0's loomrun stopped responding (its rendezvous server at $addr0:$port did not answer for ${node_timeout}s)"
fi

# mpi_case NAME FAULT WANT: mpirun in ns0, one rank on each "host".
mpi_case() {
	local name=$1 fault=$2 want=$3
	net
	cat >"$tmp/agent.sh" <<EOF
#!/bin/sh
# plm_rsh_agent: "ssh" to a namespace. \$1 is the host, the rest the command.
host=\$1
shift
case \$host in
$addr0) ns=$ns0 ;;
$addr1) ns=$ns1 ;;
*) echo "agent.sh: unknown host \$host" >&2; exit 1 ;;
esac
exec ip netns exec "\$ns" sh -c "\$*"
EOF
	chmod +x "$tmp/agent.sh"
	# Open MPI's runtime learns of a lost daemon (mpirun <-> orted) only
	# through TCP keepalive on its own connections; its default (300 s
	# idle) would keep mpirun and orted up for minutes after a partition.
	ip netns exec "$ns0" mpirun --allow-run-as-root --oversubscribe \
		--mca plm_rsh_agent "$tmp/agent.sh" --host "$addr0:1,$addr1:1" -np 2 \
		--mca btl tcp,self --mca btl_tcp_if_include 10.213.0.0/24 --mca oob_tcp_if_include 10.213.0.0/24 \
		--mca oob_tcp_keepalive_time 1 --mca oob_tcp_keepalive_intvl 1 --mca oob_tcp_keepalive_probes 3 \
		-x LOOM_TIMEOUT=${loom_timeout}s -x LOOM_COSTMODEL=off \
		"$tmp/transformer" -dp 2 -tp 1 -steps 100000 -every 20 >"$tmp/$name" 2>&1 &
	local mpirun=$!
	if ! until_in "$tmp/$name" "step   20" 30; then
		verdict "$name" - 0 "the job did not start: $(cat "$tmp/$name")"
		pkill_job "$tmp/"
		return
	fi
	local t0
	t0=$(now)
	case $fault in
	stop) kill -STOP "$(pgrep -f "^$tmp/transformer" | while read -r p; do [ "$(ip netns identify "$p")" = "$ns1" ] && echo "$p"; done | head -1)" ;;
	link) ip -n "$ns1" link set "$veth1" down ;;
	esac
	local problems=() rc=0 took
	if ! await_end "$tmp/" $((2 * loom_timeout)); then
		took=">$((2 * loom_timeout))"
		problems+=("still running after $((2 * loom_timeout))s: $(pgrep -af "$tmp/" | cut -c1-100 | tr '\n' ';')")
		pkill_job "$tmp/"
	else
		took=$(elapsed "$t0")
	fi
	wait "$mpirun" 2>/dev/null || rc=$?
	[ "$rc" = 0 ] && problems+=("mpirun exited 0")
	[ -n "$want" ] && ! grep -qF -- "$want" "$tmp/$name" && problems+=("the output lacks \"$want\"")
	if [ ${#problems[@]} -gt 0 ]; then
		cat "$tmp/$name" >&2
	fi
	verdict "$name" "$took" $((2 * loom_timeout)) "${problems[@]}"
	echo "netns:      $name: mpirun exit $rc"
}

if [ "$mpi" = 1 ] && [[ $groups == *" mpi "* ]]; then
	echo "== mpirun across the namespaces, 1 rank on each, LOOM_TIMEOUT=${loom_timeout}s"
	mpi_case mpi-rank-stopped stop "rank 0 failed on a communication error; ending the MPI job (MPI_Abort)"
	mpi_case mpi-link-down link ""
fi

# tcp_start NAME STEPS: two loomruns, one in each namespace, running the
# transformer -dp 2 -tp 2 on 2+2 processes (-json on node 0's rank 0).
tcp_start() {
	local name=$1 steps=$2
	tcp_pids=()
	local flags=(--nnodes 2 -n 2 --master-addr "$addr0" --master-port "$port" --node-timeout "${tcp_timeout}s" --grace 1s --timeout 120s)
	net
	for k in 0 1; do
		ip netns exec "$([ $k = 0 ] && echo "$ns0" || echo "$ns1")" env LOOM_BLAS=go LOOM_CUDA_DRIVER=off LOOM_TIMEOUT=${tcp_timeout}s \
			"$tmp/loomrun" --node-rank $k "${flags[@]}" -- "$tmp/transformer-tcp" -dp 2 -tp 2 -steps "$steps" -every 5 \
			-json "$tmp/$name.json" >"$tmp/$name.$k" 2>&1 &
		tcp_pids+=($!)
	done
}

# tcp_case NAME FAULT WANT: a fault on the running job, the checks; WANT
# is a regular expression that the two nodes' output must match, in which
# R stands for the world rank of the process at fault.
tcp_case() {
	local name=$1 fault=$2 want=$3
	tcp_start "$name" 100000
	if ! until_in "$tmp/$name.0" "step   10" 60; then
		verdict "$name" - 0 "the job did not start: $(cat "$tmp/$name.0" "$tmp/$name.1")"
		pkill_job "$tmp/"
		wait 2>/dev/null || true
		return
	fi
	local t0 pid
	t0=$(now)
	# A rank of node 1: a transformer process in ns1 (not a supervisor,
	# which carries the same arguments after loomrun's own).
	pid=$(pgrep -f "^$tmp/transformer-tcp" | while read -r p; do [ "$(ip netns identify "$p")" = "$ns1" ] && echo "$p"; done | head -1) || true
	if [ -z "$pid" ] && [ "$fault" != link ]; then
		verdict "$name" - 0 "no rank of node 1 found: $(pgrep -af "$tmp/" | tr '\n' ';')"
		pkill_job "$tmp/"
		wait 2>/dev/null || true
		return
	fi
	local rank
	rank=$(tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | sed -n 's/^RANK=//p') || true
	want=${want//R/${rank:-[23]}}
	case $fault in
	kill) kill -9 "$pid" ;;
	stop) kill -STOP "$pid" ;;
	link) ip -n "$ns1" link set "$veth1" down ;;
	esac
	local problems=() took bound=$((2 * tcp_timeout))
	if ! await_end "$tmp/" "$bound"; then
		took=">$bound"
		problems+=("still running after ${bound}s: $(pgrep -af "$tmp/" | cut -c1-120 | tr '\n' ';')")
		pkill_job "$tmp/"
	else
		took=$(elapsed "$t0")
	fi
	wait 2>/dev/null || true
	cat "$tmp/$name.0" "$tmp/$name.1" | grep -qE -- "$want" || problems+=("the output does not match \"$want\"")
	grep -qF "loomrun[node 0]: job failed" "$tmp/$name.0" || problems+=("node 0's loomrun did not report the failure")
	if [ ${#problems[@]} -gt 0 ]; then
		printf '%s\n' "--- node 0:" "$(cat "$tmp/$name.0")" "--- node 1:" "$(cat "$tmp/$name.1")" >&2
	fi
	verdict "$name" "$took" "$bound" "${problems[@]}"
}

if [[ $groups == *" tcp "* ]]; then
	echo "== loomrun, 2 nodes x 2 ranks, transformer -dp 2 -tp 2 on the tcp backend, LOOM_TIMEOUT=${tcp_timeout}s"
	# The losses: in-process ranks (outside the namespaces), then 2+2
	# processes across them.
	LOOM_BLAS=go "$tmp/transformer-tcp" -dp 2 -tp 2 -steps 10 -every 5 -json "$tmp/inproc.json" >"$tmp/inproc" 2>&1
	t0=$(now)
	tcp_start tcp-losses 10
	rc=0
	for p in "${tcp_pids[@]}"; do wait "$p" || rc=$?; done
	problems=()
	[ "$rc" = 0 ] || problems+=("a loomrun exited $rc")
	grep -qF "4 tcp processes of one rank each (2 on this host)" "$tmp/tcp-losses.0" || problems+=("node 0 does not say it runs 4 tcp processes")
	losses() { tr -d ' \n' <"$1" | grep -o '"losses":\[[^]]*\]'; }
	[ -f "$tmp/tcp-losses.json" ] && [ "$(losses "$tmp/tcp-losses.json")" = "$(losses "$tmp/inproc.json")" ] ||
		problems+=("losses across the hosts $(losses "$tmp/tcp-losses.json" 2>&1), in-process $(losses "$tmp/inproc.json")")
	if [ ${#problems[@]} -gt 0 ]; then
		printf '%s\n' "--- node 0:" "$(cat "$tmp/tcp-losses.0")" "--- node 1:" "$(cat "$tmp/tcp-losses.1")" >&2
	fi
	verdict tcp-losses "$(elapsed "$t0")" 120 "${problems[@]}"
	# Node 1 holds ranks 2 and 3.
	tcp_case tcp-rank-killed kill "rank R: connection closed"
	tcp_case tcp-link-down link "waiting for rank ([23]|[0-9]+ \(world rank [23]\))|node 1's loomrun stopped responding"
	tcp_case tcp-rank-stopped stop "waiting for rank (R|[0-9]+ \(world rank R\))"
fi

# ext_losses FILE: the losses world rank 0 printed (one per line), loomrun's
# prefix taken off.
ext_losses() { sed -n 's/^\[rank 0\] \([-0-9.eE+]*\)$/\1/p' "$1"; }
# ext_close A B: whether the loss files A and B have the same number of
# lines and agree to 1e-6 relative (at least 1e-6), line by line.
ext_close() {
	[ "$(wc -l <"$1")" = "$(wc -l <"$2")" ] && [ -s "$1" ] &&
		paste "$1" "$2" | awk '{ d = $1 - $2; if (d < 0) d = -d; m = $2 < 0 ? -$2 : $2; if (m < 1) m = 1; if (d > 1e-6 * m) exit 1 }'
}
# ext_case NAME ALGO LAYOUT...: the user's program on 2+2 processes across
# the namespaces (LOOM_ALGO=ALGO), against one in-process rank and against
# the same layout on in-process ranks.
ext_case() {
	local name=$1 algo=$2
	shift 2
	local flags=(--nnodes 2 -n 2 --master-addr "$addr0" --master-port "$port" --node-timeout "${tcp_timeout}s" --grace 1s --timeout 120s)
	local env=(env LOOM_BLAS=go LOOM_CUDA_DRIVER=off LOOM_BACKEND= "LOOM_TIMEOUT=${tcp_timeout}s" LOOM_ALGO="$algo")
	"${env[@]}" "$tmp/user" "$@" >"$tmp/$name.inproc" 2>"$tmp/$name.inproc.err" || true
	net
	local t0 pids=() k rc=0 problems=()
	t0=$(now)
	for k in 0 1; do
		ip netns exec "$([ $k = 0 ] && echo "$ns0" || echo "$ns1")" "${env[@]}" \
			"$tmp/loomrun" --node-rank $k "${flags[@]}" -- "$tmp/user" "$@" >"$tmp/$name.$k" 2>&1 &
		pids+=($!)
	done
	for k in "${pids[@]}"; do wait "$k" || rc=$?; done
	ext_losses "$tmp/$name.0" >"$tmp/$name.losses"
	[ "$rc" = 0 ] || problems+=("a loomrun exited $rc")
	grep -qF "[rank 0] 4 tcp processes of one rank each (2 on this host)" "$tmp/$name.0" || problems+=("node 0 does not say it runs 4 tcp processes")
	ext_close "$tmp/$name.losses" "$tmp/ext-one" ||
		problems+=("losses across the hosts $(tr '\n' ' ' <"$tmp/$name.losses"); one rank $(tr '\n' ' ' <"$tmp/ext-one"); want them within 1e-6 relative")
	local same=no
	cmp -s "$tmp/$name.losses" "$tmp/$name.inproc" && same=yes
	[ "$algo" = direct ] && [ $same = no ] &&
		problems+=("losses across the hosts $(tr '\n' ' ' <"$tmp/$name.losses"); in-process $(tr '\n' ' ' <"$tmp/$name.inproc"); want them bit for bit")
	if [ ${#problems[@]} -gt 0 ]; then
		printf '%s\n' "--- node 0:" "$(cat "$tmp/$name.0")" "--- node 1:" "$(cat "$tmp/$name.1")" >&2
	fi
	verdict "$name" "$(elapsed "$t0")" 120 "${problems[@]}"
	echo "netns:      $name: largest difference from one rank $(paste "$tmp/$name.losses" "$tmp/ext-one" | awk '{ d = $1 - $2; if (d < 0) d = -d; if (d > m) m = d } END { printf "%.3g", m }'), in-process losses bit for bit: $same"
}

if [[ $groups == *" external "* ]]; then
	echo "== loomrun, 2 nodes x 2 ranks, a user's program (tests/testdata/usertrain) on the tcp backend"
	LOOM_BLAS=go LOOM_BACKEND='' LOOM_ALGO='' "$tmp/user" >"$tmp/ext-one" 2>"$tmp/ext-one.err" ||
		{ echo "netns: FAIL ext: the one-rank run failed: $(cat "$tmp/ext-one.err")"; fails=$((fails + 1)); }
	for algo in "" direct; do
		sfx=${algo:+-$algo}
		ext_case "ext-dp2-tp2$sfx" "$algo" -dp 2 -tp 2
		ext_case "ext-fsdp4$sfx" "$algo" -fsdp 4
		ext_case "ext-ep2-dp2$sfx" "$algo" -ep 2 -dp 2
	done
fi

if [ "$fails" -gt 0 ]; then
	echo "netns: $fails case(s) failed"
	exit 1
fi
echo "netns: all cases passed"

#!/usr/bin/env bash
# two_hosts.sh: two "hosts" on this machine, for MPI ranks that talk over TCP as between hosts.
#
#   two_hosts.sh setup                 two network namespaces joined by a veth pair
#   two_hosts.sh shape RATE [DELAY]    shape both directions: tc tbf at RATE (e.g. 10gbit), or
#                                      tc netem with RATE and DELAY one way (e.g. 10gbit 25us)
#   two_hosts.sh unshape               remove the shaping
#   two_hosts.sh run CMD [ARGS...]     mpirun -np 2 CMD: rank 0 on host a, rank 1 on host b;
#                                      prints the bytes that crossed the veth on stderr
#   two_hosts.sh teardown              remove the namespaces (also when half made)
#   two_hosts.sh bench [OUT_DIR]       setup, the whole measurement (docs/distributed.md,
#                                      "Two hosts on one machine"), teardown
#
# Host a is namespace ${prefix}-a with veth ${prefix}va at $net.1, host b is ${prefix}-b with
# ${prefix}vb at $net.2 (prefix: $MS2H_PREFIX, default ms2h; net: $MS2H_NET, default 10.213.7).
# Each host also gets its own UTS namespace (hostname ${prefix}-a / ${prefix}-b), so OpenMPI and
# metashard see two nodes: no shared-memory transport, and metashard's MPI world treats the peer
# as remote (no /proc liveness polling across hosts).
#
# How mpirun reaches host b: mpirun runs inside namespace a and launches its daemon on host b
# through `--mca plm_rsh_agent`, a small agent written at setup that maps the host address to
# `ip netns exec ${prefix}-b` (OpenMPI's rsh launcher calls `AGENT HOST COMMAND...`, as it would
# call ssh). Traffic is restricted to the veth subnet with btl_tcp_if_include and
# oob_tcp_if_include, and the transports to `self,tcp`. `--bind-to none`: each host's daemon
# sees the whole machine as its own and would bind its one rank to core 0, so both ranks would
# share one core (measured: ~500 us per 4 KiB all-reduce instead of ~15 us).
#
# Needs root, `ip` and `unshare` (iproute2, util-linux), `tc` for `shape`, OpenMPI's mpirun.
# Exit status: 0 success, 1 failure, 77 the machine cannot do it here (not root, no `ip`, no
# permission to create a network namespace or a veth pair): a caller may treat 77 as "skip".

set -euo pipefail

prefix="${MS2H_PREFIX:-ms2h}"
net="${MS2H_NET:-10.213.7}"
script_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo_dir="$(cd "$script_dir/.." && pwd)"

die() { echo "two_hosts: error: $*" >&2; exit 1; }
cannot() { echo "two_hosts: cannot run here: $*" >&2; exit 77; }

[[ "$prefix" =~ ^[a-z][a-z0-9]{0,10}$ ]] \
    || die "MS2H_PREFIX '$prefix' must be 1-11 lower-case letters and digits, starting with a letter (it names interfaces of at most 15 characters)"
[[ "$net" =~ ^[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}$ ]] \
    || die "MS2H_NET '$net' must be the first three octets of an IPv4 /24, e.g. 10.213.7"

ns_a="${prefix}-a"
ns_b="${prefix}-b"
veth_a="${prefix}va"
veth_b="${prefix}vb"
ip_a="$net.1"
ip_b="$net.2"
state="${TMPDIR:-/tmp}/metashard-two-hosts-$prefix"

need_tools() {
    [[ "$(id -u)" == 0 ]] || cannot "needs root (network namespaces and veth pairs); run as root"
    command -v ip >/dev/null 2>&1 || cannot "\`ip\` is missing (apt-get install iproute2)"
    command -v unshare >/dev/null 2>&1 || cannot "\`unshare\` is missing (apt-get install util-linux)"
}

exists() { ip netns list 2>/dev/null | awk '{print $1}' | grep -qx "$1"; }

teardown() {
    # Deleting a namespace deletes the veth end inside it, and with it the pair.
    local ns
    for ns in "$ns_a" "$ns_b"; do
        if exists "$ns"; then
            ip netns delete "$ns" || echo "two_hosts: warning: could not delete namespace $ns" >&2
        fi
    done
    ip link delete "$veth_a" >/dev/null 2>&1 || true
    rm -rf -- "$state"
}

setup() {
    need_tools
    if exists "$ns_a" || exists "$ns_b"; then
        die "namespace $ns_a or $ns_b already exists: run \`$0 teardown\` first (or set MS2H_PREFIX)"
    fi
    # From here on, a failure removes what was made.
    trap 'teardown; trap - EXIT' EXIT
    if ! ip netns add "$ns_a" 2>"$state.err"; then
        local why
        why="$(cat "$state.err")"
        rm -f -- "$state.err"
        cannot "\`ip netns add\` failed ($why): no permission for network namespaces here"
    fi
    rm -f -- "$state.err"
    ip netns add "$ns_b"
    ip link add "$veth_a" type veth peer name "$veth_b" \
        || cannot "\`ip link add ... type veth\` failed: no veth pairs here"
    ip link set "$veth_a" netns "$ns_a"
    ip link set "$veth_b" netns "$ns_b"
    ip -n "$ns_a" addr add "$ip_a/24" dev "$veth_a"
    ip -n "$ns_b" addr add "$ip_b/24" dev "$veth_b"
    local ns
    for ns in "$ns_a" "$ns_b"; do
        ip -n "$ns" link set lo up
    done
    ip -n "$ns_a" link set "$veth_a" up
    ip -n "$ns_b" link set "$veth_b" up
    mkdir -p -- "$state"
    # The launch agent mpirun calls as it would call ssh: AGENT HOST COMMAND... (one string
    # for the remote shell, as ssh joins its arguments).
    cat >"$state/agent" <<EOF
#!/bin/sh
host="\$1"; shift
case "\$host" in
    $ip_a) ns=$ns_a ;;
    $ip_b) ns=$ns_b ;;
    *) echo "two_hosts agent: unknown host \$host (expected $ip_a or $ip_b)" >&2; exit 1 ;;
esac
exec ip netns exec "\$ns" unshare --uts sh -c 'hostname "\$0" && eval "\$1"' "\$ns" "\$*"
EOF
    chmod +x "$state/agent"
    if ! ip netns exec "$ns_a" ping -c 1 -W 2 "$ip_b" >/dev/null 2>&1; then
        if command -v ping >/dev/null 2>&1; then
            die "host a ($ip_a) cannot reach host b ($ip_b) over $veth_a"
        fi
    fi
    trap - EXIT
    echo "two_hosts: $ns_a ($veth_a $ip_a) <-> $ns_b ($veth_b $ip_b) ready"
}

need_setup() {
    need_tools
    exists "$ns_a" && exists "$ns_b" && [[ -x "$state/agent" ]] \
        || die "the namespaces are not set up: run \`$0 setup\` first"
}

# Bits per second of a tc rate with a kbit, mbit or gbit suffix (whole numbers).
bits_per_s() {
    local r="${1,,}"
    [[ "$r" =~ ^[0-9]+[kmg]bit$ ]] || return 1
    case "$r" in
        *gbit) echo $(( ${r%gbit} * 1000000000 )) ;;
        *mbit) echo $(( ${r%mbit} * 1000000 )) ;;
        *kbit) echo $(( ${r%kbit} * 1000 )) ;;
        *) return 1 ;;
    esac
}

shape() {
    need_setup
    command -v tc >/dev/null 2>&1 || die "\`tc\` is missing (apt-get install iproute2)"
    local rate="$1" delay="${2:-}" dev ns qdisc
    if [[ -n "$delay" ]]; then
        # netem on each end's egress: RATE per direction, DELAY one way (round trip 2 x
        # DELAY); the queue limit is raised from 1000 packets so a 16 MiB burst is delayed,
        # not dropped.
        qdisc=(netem rate "$rate" delay "$delay" limit 100000)
    else
        # tbf: RATE per direction, 50 ms of queue. The bucket holds 1 ms of RATE: tc-tbf(8)
        # asks for at least rate/HZ, and at least 128 KiB, more than one 64 KiB GSO packet of
        # the veth. (With 128 KiB at 10gbit, TCP reached only 0.25 GB/s of the 1.25 here: the
        # timer that refills the bucket competes with the spinning ranks for the 2 cores.)
        local bits
        bits="$(bits_per_s "$rate")" || die "RATE '$rate' is not a whole number with kbit, mbit or gbit"
        qdisc=(tbf rate "$rate" burst "$(( bits / 8 / 1000 > 131072 ? bits / 8 / 1000 : 131072 ))" latency 50ms)
    fi
    for dev in "$veth_a" "$veth_b"; do
        ns="${prefix}-${dev: -1}"
        if ! tc -n "$ns" qdisc replace dev "$dev" root "${qdisc[@]}" 2>"$state/tc.err"; then
            if [[ -n "$delay" ]] && grep -q "unknown" "$state/tc.err"; then
                die "this kernel has no netem qdisc (sch_netem): added latency cannot be emulated here; shape without DELAY (tbf, rate only)"
            fi
            die "tc qdisc replace dev $dev root ${qdisc[*]}: $(cat "$state/tc.err")"
        fi
    done
    echo "two_hosts: $veth_a and $veth_b shaped with ${qdisc[*]}"
}

unshape() {
    need_setup
    tc -n "$ns_a" qdisc del dev "$veth_a" root >/dev/null 2>&1 || true
    tc -n "$ns_b" qdisc del dev "$veth_b" root >/dev/null 2>&1 || true
}

counter() { ip netns exec "$1" cat "/sys/class/net/$2/statistics/$3"; }

# mpirun -np 2 "$@", rank 0 on host a, rank 1 on host b; stdout and stderr are the job's.
run() {
    need_setup
    command -v mpirun >/dev/null 2>&1 || die "mpirun is missing (apt-get install openmpi-bin)"
    [[ $# -gt 0 ]] || die "usage: $0 run COMMAND [ARGS...]"
    local tx0 rx0 tx1 rx1 rc=0
    tx0="$(counter "$ns_a" "$veth_a" tx_bytes)"
    rx0="$(counter "$ns_a" "$veth_a" rx_bytes)"
    OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
        ip netns exec "$ns_a" unshare --uts sh -c 'hostname "$0" && exec "$@"' "$ns_a" \
        mpirun -np 2 --host "$ip_a,$ip_b" --map-by node --bind-to none \
        --mca plm_rsh_agent "$state/agent" --mca plm_rsh_no_tree_spawn 1 \
        --mca pml ob1 --mca btl self,tcp \
        --mca btl_tcp_if_include "$net.0/24" --mca oob_tcp_if_include "$net.0/24" \
        "$@" || rc=$?
    tx1="$(counter "$ns_a" "$veth_a" tx_bytes)"
    rx1="$(counter "$ns_a" "$veth_a" rx_bytes)"
    echo "two_hosts: over $veth_a: $((tx1 - tx0)) bytes a->b, $((rx1 - rx0)) bytes b->a" >&2
    return "$rc"
}

case "${1:-}" in
    setup) setup ;;
    teardown) need_tools; teardown; echo "two_hosts: $ns_a and $ns_b removed" ;;
    shape)
        [[ $# -eq 2 || $# -eq 3 ]] \
            || die "usage: $0 shape RATE [DELAY] (tc units, e.g. 10gbit, or 10gbit 25us for netem)"
        shape "$2" "${3:-}"
        ;;
    unshape) unshape ;;
    run) shift; run "$@" ;;
    bench) shift; exec bash "$script_dir/two_hosts_bench.sh" "$@" ;;
    *)
        sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//' >&2
        exit 1
        ;;
esac

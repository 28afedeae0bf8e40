# ci/routed.sh, sourced (by ci/loss.sh, ci/windows.sh) inside the soft-RoCE
# VM: two "hosts", A (10.0.1.1 on vethA, soft-RoCE device rxeA) and B
# (10.0.2.1 on vethB, rxeB), whose traffic crosses a router namespace where
# netem can drop packets both ways. (rxe on one interface delivers to
# itself without touching the network, and a kernel delivers traffic
# between its own addresses locally: policy routing sends A<->B out
# through the router.) The sourcing script sets `bench` (a collbench) and
# `out` (a directory for the ranks' logs).
#
#   setup            makes the hosts, the router and the devices
#   loss PERCENT     drops that share of packets in the router (0: none)
#   pair JSON ARGS   runs `collbench ARGS` as rank 0 on A (writing JSON)
#                    and rank 1 on B; fails, showing their logs, unless
#                    both succeed. Variables set before it reach both.

setup() {
  ip netns add router
  ip -n router link set lo up
  ip netns exec router sysctl -qw net.ipv4.ip_forward=1
  local h n
  for h in A:1 B:2; do
    n=${h#*:} h=${h%:*}
    ip link add "veth$h" type veth peer name "r$h"
    ip link set "r$h" netns router
    ip addr add "10.0.$n.1/24" dev "veth$h"
    ip link set "veth$h" up
    ip -n router addr add "10.0.$n.254/24" dev "r$h"
    ip -n router link set "r$h" up
    # What this host sends to the other leaves through the router.
    ip route add "10.0.$((3 - n)).1" via "10.0.$n.254" dev "veth$h" table 100
    ip rule add pref "$((9 + n))" iif lo to "10.0.$((3 - n)).1" lookup 100
  done
  # Those rules before local delivery; packets from "the other host" with
  # a local source address accepted.
  ip rule add pref 100 lookup local
  ip rule del pref 0
  for k in all default vethA vethB; do
    sysctl -qw "net.ipv4.conf.$k.accept_local=1" "net.ipv4.conf.$k.rp_filter=0"
  done
  rdma link add rxeA type rxe netdev vethA
  rdma link add rxeB type rxe netdev vethB
}

loss() {
  local d
  for d in rA rB; do
    ip netns exec router tc qdisc del dev $d root 2>/dev/null || true
    [ "$1" = 0 ] || ip netns exec router tc qdisc add dev $d root netem loss "$1%"
  done
}

# pair JSON ARGS...: rank 0 on host A (writing JSON), rank 1 on host B.
port=29600
pair() {
  local json=$1
  shift
  port=$((port + 1))
  local env=(MASTER_ADDR=10.0.1.1 MASTER_PORT=$port WORLD_SIZE=2)
  env "${env[@]}" RANK=1 COLL_SOCKET_IFNAME=vethB "$bench" "$@" >/dev/null 2>"$out/rank1.log" &
  local one=$! status=0
  env "${env[@]}" RANK=0 COLL_SOCKET_IFNAME=vethA "$bench" "$@" --json "$json" >/dev/null 2>"$out/rank0.log" || status=$?
  wait $one || status=$?
  [ $status = 0 ] || { tail -n 5 "$out"/rank*.log; echo "$(basename "$0"): failed: $*" >&2; return 1; }
}

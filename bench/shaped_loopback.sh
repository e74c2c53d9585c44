#!/usr/bin/env bash
# Run a command with its loopback limited to a link rate, as between two machines on that link:
# in a network namespace of its own (so nothing else on this machine is slowed), whose `lo` gets a
# token-bucket filter at RATE. Everything the command sends over TCP to 127.0.0.1 (gloo, gRPC over
# TCP) goes through it; Unix sockets and shared memory do not.
#
#   sudo bench/shaped_loopback.sh RATE COMMAND...     # RATE as tc writes it: 1gbit, 10gbit, 200mbit
#
# Needs CAP_NET_ADMIN and CAP_SYS_ADMIN (root, or a container that grants them).
# Example (issue 38, deltas against FULL on a 1 Gb/s link):
#   bench/shaped_loopback.sh 1gbit .venv/bin/python bench/bench_delta_step.py --transports transfer_group --out DIR
set -euo pipefail
if [[ $# -lt 2 ]]; then
  echo "usage: $0 RATE COMMAND..." >&2
  exit 2
fi
rate="$1"
shift
exec unshare --net -- bash -c '
  set -euo pipefail
  ip link set lo up
  # burst: a few 64 KiB loopback frames; latency: how long a packet may wait in the bucket
  tc qdisc add dev lo root tbf rate "$0" burst 1mb latency 50ms
  echo "loopback limited to $0 ($(tc qdisc show dev lo))" >&2
  exec "$@"
' "$rate" "$@"

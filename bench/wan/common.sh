# SPDX-License-Identifier: Apache-2.0
# Sourced by the WAN scripts of this folder (root, wan-emu and the congestion control set).
#   wan_preflight WHAT   exits 0 with "WHAT: skipped: why" unless root, wan-emu
#                        ($WAN_EMU, default ../shared/tools/wan-emu beside the checkout), ip,
#                        tc, unshare, python3 and network namespaces are all there
#   wan_mbit RATE        a tc rate (100mbit, 1gbit) in Mbit/s
#   wan_test_options [--enforce] [BUILD_DIR]
#                        the WAN tests' command line and settings: sets enforce (0/1), build
#                        (default build/ci), rate (WAN_RATE, 100mbit), delay (WAN_DELAY_MS, 10
#                        one way) and target (WAN_TARGET, 0.85)
# Sets: root (the checkout), wan_emu, cc (WAN_CC, default reno) and cc_args (wan-emu's --cc,
# none for WAN_CC=host: the host's default congestion control).
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
wan_emu=${WAN_EMU:-$root/../shared/tools/wan-emu}
cc=${WAN_CC:-reno}
cc_args=()
if [ "$cc" != host ]; then cc_args=(--cc "$cc"); fi

wan_preflight() {
  local what=$1 tool probe
  skip() { echo "$what: skipped: $*"; exit 0; }
  [ -f "$wan_emu" ] || skip "wan-emu not found at $wan_emu (set WAN_EMU)"
  [ "$(id -u)" = 0 ] || skip "needs root (network namespaces)"
  for tool in ip tc unshare python3; do
    command -v "$tool" >/dev/null 2>&1 || skip "needs $tool"
  done
  probe="stprobe$$"
  ip netns add "$probe" 2>/dev/null || skip "network namespaces do not work here (ip netns add failed)"
  ip netns del "$probe"
}

wan_mbit() {
  python3 -c "import re,sys; r=sys.argv[1]; n=re.match(r'[0-9.]+', r).group(); print(float(n)*{'kbit':1e-3,'mbit':1,'gbit':1e3}[r[len(n):]])" "$1"
}

wan_test_options() {
  enforce=0
  if [ "${1:-}" = --enforce ]; then
    enforce=1
    shift
  fi
  build=${1:-$root/build/ci}
  rate=${WAN_RATE:-100mbit}
  delay=${WAN_DELAY_MS:-10}
  target=${WAN_TARGET:-0.85}
}

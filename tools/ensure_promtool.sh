#!/bin/sh
# Makes `promtool` and `prometheus` available for the deploy tests (alert rule unit tests,
# PromQL parsing, the real Prometheus that scrapes a short local run). Debian's
# `prometheus` package provides both; it installs in seconds as root. Prints the
# directory holding the binaries; exits 1 (with the reason on stderr) when it cannot.
set -eu

if command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1; then
  dirname "$(command -v promtool)"
  exit 0
fi
if [ "$(id -u)" != "0" ]; then
  echo "ensure_promtool: promtool is missing and installing Debian's prometheus needs root" >&2
  exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "ensure_promtool: promtool is missing and apt-get is not available" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
# The package's maintainer scripts try to start a daemon; in a container without an init
# system policy-rc.d keeps them from doing so.
policy=/usr/sbin/policy-rc.d
created_policy=0
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod +x "$policy" && created_policy=1
fi
{ apt-get install -y -qq --no-install-recommends prometheus >/dev/null 2>&1 \
  || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq --no-install-recommends prometheus >/dev/null 2>&1; }; } \
  || { [ "$created_policy" = 1 ] && rm -f "$policy"; echo "ensure_promtool: apt-get install prometheus failed" >&2; exit 1; }
[ "$created_policy" = 1 ] && rm -f "$policy"
command -v promtool >/dev/null 2>&1 || { echo "ensure_promtool: promtool still missing after install" >&2; exit 1; }
dirname "$(command -v promtool)"

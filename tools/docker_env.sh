#!/usr/bin/env bash
# A Docker engine and Compose v2 for `make test-compose`, on the machine as it is.
#
#   tools/docker_env.sh            # check, and on Debian as root install/start what is missing
#
# - A running engine is used as it is. Otherwise, on Debian as root: Debian's `docker.io`
#   (dockerd 20.10) is installed when absent and `dockerd` is started in the background
#   (log: $FLYWHEEL_DOCKER_STATE/dockerd.log).
# - `docker compose` (v2) is used when the CLI has it. Otherwise the plugin binary is taken
#   from Debian's `docker-compose` package of the next release (bookworm ships only Compose
#   v1): `apt-get download` with a temporary sources list made from the machine's own apt
#   sources, so nothing of the system's apt setup changes, and the binary is unpacked into
#   $FLYWHEEL_DOCKER_STATE/cli-plugins. The docker CLI that runs it is printed last
#   (`DOCKER=...`, `DOCKER_CONFIG=...` lines for the caller to eval).
# - `debootstrap` (for tools/offline_images.sh) is installed when absent.
#
# Nothing here prompts: apt runs with DEBIAN_FRONTEND=noninteractive.
set -euo pipefail

STATE="${FLYWHEEL_DOCKER_STATE:-/var/tmp/flywheel-docker}"
COMPOSE_SUITE="${FLYWHEEL_COMPOSE_SUITE:-trixie}"
mkdir -p "$STATE"
export DEBIAN_FRONTEND=noninteractive

say() { echo "docker_env: $*" >&2; }
is_root() { [ "$(id -u)" = 0 ]; }
have_apt() { command -v apt-get >/dev/null 2>&1; }
apt_install() {
  is_root && have_apt || { say "cannot install $*: not root on a Debian-like system"; exit 1; }
  if [ ! -f "$STATE/apt-updated" ]; then
    apt-get -o DPkg::Lock::Timeout=600 update -q >&2
    touch "$STATE/apt-updated"
  fi
  apt-get -o DPkg::Lock::Timeout=600 install -y -q --no-install-recommends "$@" >&2
}

# --- the engine ------------------------------------------------------------------------------
# The CLI from docker.io speaks to a 20.10 engine and builds without buildx; a newer CLI found
# first on PATH may need buildx for `docker build`, which compose does not use.
DOCKER="$(command -v docker || true)"
if [ -x /usr/bin/docker ]; then DOCKER=/usr/bin/docker; fi
if ! { [ -n "$DOCKER" ] && "$DOCKER" info >/dev/null 2>&1; } && ! command -v dockerd >/dev/null 2>&1; then
  apt_install docker.io
  DOCKER=/usr/bin/docker
fi
if ! "$DOCKER" info >/dev/null 2>&1; then
  is_root || { say "no Docker engine answers and this is not root: start one"; exit 1; }
  say "starting dockerd (log: $STATE/dockerd.log)"
  nohup dockerd >"$STATE/dockerd.log" 2>&1 &
  echo $! >"$STATE/dockerd.pid"
  for _ in $(seq 1 60); do
    "$DOCKER" info >/dev/null 2>&1 && break
    sleep 1
  done
  "$DOCKER" info >/dev/null 2>&1 || { say "dockerd did not start:"; tail -20 "$STATE/dockerd.log" >&2; exit 1; }
fi

# --- compose v2 --------------------------------------------------------------------------------
compose_ok() { "$DOCKER" compose version 2>/dev/null | grep -q 'version v\?2'; }
if ! compose_ok; then
  export DOCKER_CONFIG="$STATE/docker-config"
  mkdir -p "$DOCKER_CONFIG/cli-plugins"
  if ! compose_ok; then
    have_apt && is_root || { say "no docker compose v2 and no way to fetch it"; exit 1; }
    tmp="$STATE/apt-$COMPOSE_SUITE"
    mkdir -p "$tmp/lists/partial" "$tmp/archives/partial" "$tmp/deb"
    # The machine's own Debian URIs (deb822 or one-line sources), with the suite swapped.
    uris="$(
      { grep -hs '^URIs:' /etc/apt/sources.list.d/*.sources | awk '{print $2}'
        grep -hs '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list | awk '{print $2}'
      } | grep -v security | grep -i debian | sort -u | head -1
    )" || true
    [ -n "$uris" ] || uris=http://deb.debian.org/debian
    echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $uris $COMPOSE_SUITE main" \
      >"$tmp/sources.list"
    opts=(-o "Dir::Etc::SourceList=$tmp/sources.list" -o "Dir::Etc::SourceParts=-"
          -o "Dir::State::Lists=$tmp/lists" -o "Dir::Cache::Archives=$tmp/archives"
          -o "Dir::Cache::pkgcache=" -o "Dir::Cache::srcpkgcache=" -o "APT::Get::List-Cleanup=0")
    say "fetching Compose v2 from $COMPOSE_SUITE's docker-compose package"
    apt-get "${opts[@]}" update -q >&2
    (cd "$tmp/deb" && apt-get "${opts[@]}" download docker-compose >&2)
    rm -rf "$tmp/x" && mkdir -p "$tmp/x"
    dpkg-deb -x "$tmp"/deb/docker-compose_*.deb "$tmp/x"
    bin="$(find "$tmp/x" -type f -name docker-compose -path '*cli-plugins*' | head -1)"
    [ -n "$bin" ] || bin="$(find "$tmp/x" -type f -name docker-compose | head -1)"
    install -m 0755 "$bin" "$DOCKER_CONFIG/cli-plugins/docker-compose"
  fi
  compose_ok || { say "docker compose v2 still missing"; exit 1; }
  echo "DOCKER_CONFIG=$DOCKER_CONFIG"
fi

command -v debootstrap >/dev/null 2>&1 || apt_install debootstrap
echo "DOCKER=$DOCKER"

#!/usr/bin/env bash
# Base, Redis and Prometheus images from Debian's packages, for a Docker engine that can
# reach no container registry (air-gapped, or a registry that is blocked). Root only.
#
#   tools/offline_images.sh [MIRROR]
#
# Makes three local images (nothing is pushed):
#   flywheel-base:bookworm        Debian bookworm minbase + python3, python3-venv and
#                                 ca-certificates: the PYTHON_IMAGE of deploy/docker/Dockerfile.*
#                                 (debootstrap into a folder, then `docker import`)
#   flywheel-redis:bookworm       that base + Debian's redis-server (7.0)
#   flywheel-prometheus:bookworm  that base + Debian's prometheus (2.42) and wget (health check)
# deploy/docker/compose.offline.yml names them. MIRROR defaults to the machine's own Debian
# mirror (its apt sources), else deb.debian.org. An image that exists already is kept
# (FLYWHEEL_REBUILD=1 makes them again). DOCKER names the docker CLI (default: docker).
set -euo pipefail

DOCKER="${DOCKER:-docker}"
SUITE="${FLYWHEEL_DEBIAN_SUITE:-bookworm}"
BASE="flywheel-base:$SUITE"
REDIS="flywheel-redis:$SUITE"
PROMETHEUS="flywheel-prometheus:$SUITE"

say() { echo "offline_images: $*" >&2; }
have() { [ "${FLYWHEEL_REBUILD:-0}" != 1 ] && "$DOCKER" image inspect "$1" >/dev/null 2>&1; }

mirror="${1:-}"
if [ -z "$mirror" ]; then
  mirror="$(
    { grep -hs '^URIs:' /etc/apt/sources.list.d/*.sources | awk '{print $2}'
      grep -hs '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list | awk '{print $2}'
    } | grep -v security | grep -i debian | sort -u | head -1
  )" || true
fi
mirror="${mirror:-http://deb.debian.org/debian}"

if ! have "$BASE"; then
  command -v debootstrap >/dev/null 2>&1 || { say "debootstrap is needed (apt-get install debootstrap)"; exit 1; }
  root="$(mktemp -d /var/tmp/flywheel-rootfs.XXXXXX)"
  trap 'rm -rf "$root"' EXIT
  say "debootstrap $SUITE from $mirror into $root"
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    "$SUITE" "$root" "$mirror" >&2
  # Apt in derived images: no recommends, no docs, caches cleaned by each install.
  printf 'APT::Install-Recommends "false";\nAPT::Install-Suggests "false";\n' \
    >"$root/etc/apt/apt.conf.d/90flywheel"
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  say "docker import -> $BASE"
  tar -C "$root" -c . | "$DOCKER" import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["/bin/bash"]' \
    - "$BASE" >/dev/null
  rm -rf "$root"
  trap - EXIT
fi

# The two service images are layers on the base, installed with the base's own apt (plain
# HTTP to the Debian mirror), built with the engine's built-in Dockerfile frontend.
build_from_base() {
  local tag="$1"
  if have "$tag"; then return; fi
  say "building $tag"
  local ctx
  ctx="$(mktemp -d)"
  cat >"$ctx/Dockerfile"
  DOCKER_BUILDKIT=1 "$DOCKER" build --network host -q -t "$tag" "$ctx" >/dev/null
  rm -rf "$ctx"
}

build_from_base "$REDIS" <<EOF
FROM $BASE
RUN apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server \\
 && rm -rf /var/lib/apt/lists/* \\
 && mkdir -p /data && chown redis:redis /data
WORKDIR /data
EXPOSE 6379
CMD ["redis-server"]
EOF

build_from_base "$PROMETHEUS" <<EOF
FROM $BASE
RUN apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q prometheus wget \\
 && rm -rf /var/lib/apt/lists/* \\
 && mkdir -p /prometheus && chown prometheus:prometheus /prometheus
USER prometheus
WORKDIR /prometheus
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
EOF

say "ready: $BASE $REDIS $PROMETHEUS"

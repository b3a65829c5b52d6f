#!/bin/sh
# Starts one Flywheel service in a container: `entrypoint.sh <service> [extra args]`;
# `entrypoint.sh prepare --out FILE [...]` runs the one-shot preparation (prepare.py).
#
# Why a script and not a bare `python -m`: the same image serves four services, and each
# is configured the same way everywhere (compose, Helm, a plain `docker run`):
#   FLYWHEEL_CONFIG     a mounted YAML file (default /etc/flywheel/flywheel.yaml); when the
#                       file is absent the service runs on its embedded defaults.
#   FLYWHEEL_OVERRIDES  whitespace-separated dotted overrides (`buffer.redis_url=...`),
#                       applied after the file, so an environment can change one key
#                       without a new config file.
# The trainer with trainer.n_ranks > 1 is its own supervisor (services/trainer/launch.py),
# not torchrun: pass `--grace S` (and on several nodes `--nnodes/--node-rank`) as arguments.
set -eu

service="${1:-${FLYWHEEL_SERVICE:-}}"
[ "$#" -gt 0 ] && shift
case "$service" in
  buffer|reward|rollout|trainer|prepare) ;;
  *)
    echo "entrypoint: unknown service '${service}'; expected one of: buffer reward rollout trainer prepare" >&2
    exit 64
    ;;
esac

config="${FLYWHEEL_CONFIG:-/etc/flywheel/flywheel.yaml}"
if [ -f "$config" ]; then
  set -- --config "$config" "$@"
fi

# Word splitting of FLYWHEEL_OVERRIDES is intended: one override per word.
# shellcheck disable=SC2086
if [ "$service" = "prepare" ]; then
  exec python "${FLYWHEEL_PREPARE:-/opt/flywheel/prepare.py}" "$@" ${FLYWHEEL_OVERRIDES:-}
fi
exec python -m "services.${service}" "$@" ${FLYWHEEL_OVERRIDES:-}

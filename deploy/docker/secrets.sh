#!/bin/sh
# The secrets of the compose stack, printed as a `.env` file that `docker compose` reads
# from the repository's root:
#
#   (umask 077; sh deploy/docker/secrets.sh > .env)
#
# One token per caller role (the scheme the local launcher and the chart use):
#   FLYWHEEL_TOKEN           the operator's admin token (export it too for `flywheel status`)
#   FLYWHEEL_TRAINER_TOKEN   the token the trainer sends
#   FLYWHEEL_ROLLOUT_TOKEN   the token the rollout sends
#   FLYWHEEL_CREDENTIALS     what the servers accept: the sha256 digests of the three, so
#                            no server holds a token it could call with
#   REDIS_PASSWORD           Redis and the buffer only
#   SGLANG_API_KEY           SGLang (gpu profile) and the rollout that calls it
#   GRAFANA_ADMIN_PASSWORD   Grafana's admin user
set -eu

new() { od -An -N32 -tx1 /dev/urandom | tr -d ' \n'; }
if command -v sha256sum >/dev/null 2>&1; then
  sha() { sha256sum | cut -d' ' -f1; }
else
  sha() { shasum -a 256 | cut -d' ' -f1; }
fi
digest() { printf 'sha256:%s' "$(printf '%s' "$1" | sha)"; }

admin=$(new)
trainer=$(new)
rollout=$(new)
echo "FLYWHEEL_TOKEN=$admin"
echo "FLYWHEEL_TRAINER_TOKEN=$trainer"
echo "FLYWHEEL_ROLLOUT_TOKEN=$rollout"
echo "FLYWHEEL_CREDENTIALS=admin=$(digest "$admin"),trainer=$(digest "$trainer"),rollout=$(digest "$rollout")"
echo "REDIS_PASSWORD=$(new)"
echo "SGLANG_API_KEY=$(new)"
echo "GRAFANA_ADMIN_PASSWORD=$(new)"

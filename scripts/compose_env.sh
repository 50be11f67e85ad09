#!/usr/bin/env bash
# Writes .env for docker compose with freshly generated keys (never overwrites an existing one):
#   POLYSERVE_API_KEYS    inference and reads on /v1/*
#   POLYSERVE_ADMIN_KEYS  task registration/deletion and job cancellation
#   REDIS_PASSWORD        Redis' requirepass (the replicas' POLYSERVE_REDIS_URL carries it)
#   POSTGRES_PASSWORD     the fleet's PostgreSQL store (`--profile replicas`: in its POLYSERVE_STORE DSN)
#   GRAFANA_ADMIN_PASSWORD  Grafana's admin login (anonymous access is off)
# Both replicas read the same .env, so one key works against either of them.
#   scripts/compose_env.sh [FILE]   (default: .env at the repository root)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-.env}"
if [ -e "$out" ]; then
  echo "$out exists; leaving it as it is" >&2
  exit 0
fi
key() { python3 -c 'import secrets; print(secrets.token_urlsafe(32))'; }
umask 077
{
  echo "POLYSERVE_API_KEYS=$(key)"
  echo "POLYSERVE_ADMIN_KEYS=$(key)"
  echo "REDIS_PASSWORD=$(key)"
  echo "POSTGRES_PASSWORD=$(key)"
  echo "GRAFANA_ADMIN_PASSWORD=$(key)"
  echo "# POLYSERVE_BIND=0.0.0.0   # expose the ports beyond this machine (default 127.0.0.1)"
} > "$out"
echo "wrote $out (mode 600): use POLYSERVE_API_KEYS as the bearer key, POLYSERVE_ADMIN_KEYS for task/job changes"

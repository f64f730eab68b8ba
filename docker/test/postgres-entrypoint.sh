#!/bin/sh
# The part of the official postgres image's entry point that compose.yaml uses: on an empty $PGDATA,
# initdb with POSTGRES_USER / POSTGRES_PASSWORD, create POSTGRES_DB, run /docker-entrypoint-initdb.d/*.sh
# and *.sql; then (and on every later start) run the server, reachable over the network with a password.
set -eu
: "${POSTGRES_USER:=postgres}" "${POSTGRES_DB:=$POSTGRES_USER}"
if [ "${1:-}" = postgres ] && [ ! -s "$PGDATA/PG_VERSION" ]; then
  password_file=$(mktemp)
  printf '%s\n' "${POSTGRES_PASSWORD:?POSTGRES_PASSWORD must be set}" > "$password_file"
  initdb --pgdata="$PGDATA" --username="$POSTGRES_USER" --pwfile="$password_file" \
    --auth-local=trust --auth-host=scram-sha-256 --encoding=UTF8 --locale=C.UTF-8
  rm -f "$password_file"
  echo "listen_addresses = '*'" >> "$PGDATA/postgresql.conf"
  echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
  pg_ctl --pgdata="$PGDATA" --options="-c listen_addresses=''" --wait start
  if [ "$POSTGRES_DB" != postgres ]; then
    echo 'CREATE DATABASE :"db"' | psql -v ON_ERROR_STOP=1 --username="$POSTGRES_USER" --dbname=postgres --set=db="$POSTGRES_DB"
  fi
  for script in /docker-entrypoint-initdb.d/*; do
    case "$script" in
      *.sh) sh "$script" ;;
      *.sql) psql -v ON_ERROR_STOP=1 --username="$POSTGRES_USER" --dbname="$POSTGRES_DB" --file="$script" ;;
      *) ;;
    esac
  done
  pg_ctl --pgdata="$PGDATA" --mode=fast --wait stop
fi
exec "$@"

#!/bin/sh
# Runs once, when Postgres initializes an empty volume (/docker-entrypoint-initdb.d): creates the
# read-only role Grafana's PostgreSQL data source logs in as. The tables do not exist yet (the
# migration creates them later, as POSTGRES_USER), so the grant is a default privilege on them.
set -eu
psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --dbname "$POSTGRES_DB" \
  --set=reader="$GRAFANA_DB_USER" --set=password="$GRAFANA_DB_PASSWORD" --set=db="$POSTGRES_DB" <<'SQL'
CREATE ROLE :"reader" LOGIN PASSWORD :'password';
GRANT CONNECT ON DATABASE :"db" TO :"reader";
GRANT USAGE ON SCHEMA public TO :"reader";
ALTER DEFAULT PRIVILEGES IN SCHEMA public GRANT SELECT ON TABLES TO :"reader";
SQL

/**
 * `edgepg-proxy setup-auth <database-url>`: what a database needs for tokens, installed
 * idempotently by a role that may (the database's owner, or a superuser).
 *
 * The schema `edgepg` holds, per backend the proxy uses for tokens, its key and its claims, in a
 * table no other role may read or write. Three SECURITY DEFINER functions, each with a pinned
 * search_path (so that nothing a session creates, temp objects included, can stand in for what they
 * call), are its only doors:
 * - edgepg.init(key): gives the calling backend its key, once: Postgres refuses it while the
 *   backend lives (a backend is known by its pid and start time: pids are reused);
 * - edgepg.set_claims(n, claims, mac): stores claims if mac = HMAC-SHA256(key, "n:claims") and n
 *   is one more than the last: only the proxy knows the key, and no call can be replayed;
 * - edgepg.claims(): the calling backend's claims (NULL without a token), for policies.
 * Reading a backend's start time takes pg_read_all_stats (or superuser) from the owner.
 */
import pg from 'pg'

/** The SQL, with pgcrypto's schema (where its hmac() is). */
export function setupSql(pgcrypto: string, neonCompat: boolean): string {
  const hmac = `${pg.escapeIdentifier(pgcrypto)}.hmac`
  const definer = 'LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp'
  return `
CREATE SCHEMA IF NOT EXISTS edgepg;
REVOKE ALL ON SCHEMA edgepg FROM PUBLIC;
GRANT USAGE ON SCHEMA edgepg TO PUBLIC;

CREATE UNLOGGED TABLE IF NOT EXISTS edgepg.backends (
  pid int PRIMARY KEY,
  started timestamptz NOT NULL,
  key bytea NOT NULL,
  n bigint NOT NULL DEFAULT 0,
  claims jsonb
) WITH (fillfactor = 50);
REVOKE ALL ON edgepg.backends FROM PUBLIC;

CREATE OR REPLACE FUNCTION edgepg.started() RETURNS timestamptz
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $f$
  SELECT a.backend_start FROM pg_catalog.pg_stat_get_activity(pg_catalog.pg_backend_pid()) a
$f$;
REVOKE ALL ON FUNCTION edgepg.started() FROM PUBLIC;

CREATE OR REPLACE FUNCTION edgepg.init(new_key bytea) RETURNS void ${definer} AS $f$
DECLARE
  me int := pg_catalog.pg_backend_pid();
  since timestamptz := edgepg.started();
BEGIN
  IF since IS NULL THEN
    RAISE EXCEPTION 'edgepg.init: cannot read this backend''s start time (the owner of edgepg needs pg_read_all_stats)';
  END IF;
  IF new_key IS NULL OR pg_catalog.length(new_key) < 32 THEN
    RAISE EXCEPTION 'edgepg.init: the key must be at least 32 bytes';
  END IF;
  IF EXISTS (SELECT 1 FROM edgepg.backends b WHERE b.pid = me AND b.started = since) THEN
    RAISE EXCEPTION 'edgepg.init: this backend has its key already' USING ERRCODE = '42501';
  END IF;
  -- Rows of backends that are gone (their pid may come back).
  DELETE FROM edgepg.backends b WHERE NOT EXISTS (SELECT 1 FROM pg_catalog.pg_stat_get_activity(b.pid));
  INSERT INTO edgepg.backends (pid, started, key) VALUES (me, since, new_key)
  ON CONFLICT (pid) DO UPDATE SET started = EXCLUDED.started, key = EXCLUDED.key, n = 0, claims = NULL;
END
$f$;

CREATE OR REPLACE FUNCTION edgepg.set_claims(want bigint, new_claims text, mac bytea) RETURNS void ${definer} AS $f$
DECLARE
  me int := pg_catalog.pg_backend_pid();
  b edgepg.backends;
BEGIN
  SELECT * INTO b FROM edgepg.backends r WHERE r.pid = me AND r.started = edgepg.started() FOR UPDATE;
  IF NOT FOUND THEN
    RAISE EXCEPTION 'edgepg.set_claims: this backend has no key' USING ERRCODE = '42501';
  END IF;
  IF want IS DISTINCT FROM b.n + 1
     OR mac IS DISTINCT FROM ${hmac}(pg_catalog.convert_to(want::text || ':' || coalesce(new_claims, ''), 'UTF8'), b.key, 'sha256'::text) THEN
    RAISE EXCEPTION 'edgepg.set_claims: refused' USING ERRCODE = '42501';
  END IF;
  UPDATE edgepg.backends r SET n = want, claims = new_claims::jsonb WHERE r.pid = me;
END
$f$;

CREATE OR REPLACE FUNCTION edgepg.claims() RETURNS jsonb
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $f$
  SELECT b.claims FROM edgepg.backends b WHERE b.pid = pg_catalog.pg_backend_pid() AND b.started = edgepg.started()
$f$;

GRANT EXECUTE ON FUNCTION edgepg.init(bytea), edgepg.set_claims(bigint, text, bytea), edgepg.claims() TO PUBLIC;
${
  neonCompat
    ? `
CREATE SCHEMA IF NOT EXISTS auth;
GRANT USAGE ON SCHEMA auth TO PUBLIC;
CREATE OR REPLACE FUNCTION auth.jwt() RETURNS jsonb LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $f$ SELECT edgepg.claims() $f$;
CREATE OR REPLACE FUNCTION auth.user_id() RETURNS text LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $f$ SELECT edgepg.claims() ->> 'sub' $f$;
GRANT EXECUTE ON FUNCTION auth.jwt(), auth.user_id() TO PUBLIC;`
    : ''
}`
}

/** Installs it all on the database `url` names, in one transaction; says what it did. */
export async function setupAuth(url: string, { neonCompat = false } = {}): Promise<string> {
  const client = new pg.Client({ connectionString: url })
  await client.connect()
  try {
    const { rows } = await client.query(
      `SELECT current_user AS owner, (SELECT rolsuper FROM pg_catalog.pg_roles WHERE rolname = current_user) OR pg_catalog.pg_has_role('pg_read_all_stats', 'USAGE') AS reads_stats`
    )
    const { owner, reads_stats } = rows[0]
    if (!reads_stats) throw new Error(`${owner} may not read other sessions' start times: GRANT pg_read_all_stats TO ${pg.escapeIdentifier(owner)} (as a superuser), or run setup-auth as a superuser`)
    await client.query('BEGIN')
    await client.query('CREATE EXTENSION IF NOT EXISTS pgcrypto')
    const schema = (await client.query(`SELECT n.nspname FROM pg_catalog.pg_extension e JOIN pg_catalog.pg_namespace n ON n.oid = e.extnamespace WHERE e.extname = 'pgcrypto'`)).rows[0].nspname
    await client.query(setupSql(schema, neonCompat))
    await client.query('COMMIT')
    return `edgepg: installed the schema edgepg (claims(), init(), set_claims(), owned by ${owner}) with pgcrypto from ${schema}${neonCompat ? ', and auth.jwt(), auth.user_id()' : ''}`
  } catch (err) {
    await client.query('ROLLBACK').catch(() => {})
    throw err
  } finally {
    await client.end()
  }
}

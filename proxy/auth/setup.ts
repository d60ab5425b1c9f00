/**
 * `edgepg-proxy setup-auth <database-url>`: what a database needs for tokens, installed
 * idempotently by a role that may (the database's owner, or a superuser).
 *
 * The schema `edgepg` holds, per backend the proxy uses for tokens, its key and its claims, in a
 * table no other role may read or write. SECURITY DEFINER functions, each with a pinned
 * search_path (so that nothing a session creates, temp objects included, can stand in for what they
 * call), are its only doors:
 * - edgepg.init(key): gives the calling backend its key, once: Postgres refuses it while the
 *   backend lives (a backend is known by its pid and start time: pids are reused);
 * - edgepg.set_claims(n, claims, mac): stores claims if mac = HMAC-SHA256(key, "n:claims") and n
 *   is one more than the last: only the proxy knows the key, and no call can be replayed;
 * - edgepg.claims(): the calling backend's claims (NULL without a token), for policies.
 * A hot standby can keep nothing in a table, so there claims live in the backend's settings, bound
 * to it by a MAC under the replica key (a replicated table only the owner reads, made here):
 * - edgepg.replica_key(n, mac): the replica key, for the proxy, asked as set_claims is (mac over
 *   "n:replica-key"), so that no session can ask it;
 * - edgepg.set_replica_claims(claims, ticket): on a standby, stores claims if ticket =
 *   HMAC-SHA256(replica key, "replica:claims") and their exp has not passed, beside a MAC over the
 *   backend's pid and start and the claims, which edgepg.claims() checks there: a session can change
 *   its settings, but make no MAC, and its own holds on no other backend.
 * Reading a backend's start time takes pg_read_all_stats (or superuser) from the owner.
 */
import pg from 'pg'

/** The SQL, with pgcrypto's schema (where its hmac() is). */
export function setupSql(pgcrypto: string, neonCompat: boolean): string {
  const hmac = `${pg.escapeIdentifier(pgcrypto)}.hmac`
  const random = `${pg.escapeIdentifier(pgcrypto)}.gen_random_bytes`
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

-- Hot standbys: the key that vouches for claims there, replicated with the rest (a logged table no
-- other role may read), made once; the proxy asks it through a backend's own key, as set_claims.
CREATE TABLE IF NOT EXISTS edgepg.replica_key (one boolean PRIMARY KEY DEFAULT true CHECK (one), key bytea NOT NULL);
REVOKE ALL ON edgepg.replica_key FROM PUBLIC;
INSERT INTO edgepg.replica_key (key) SELECT ${random}(32) WHERE NOT EXISTS (SELECT FROM edgepg.replica_key);

CREATE OR REPLACE FUNCTION edgepg.replica_key(want bigint, mac bytea) RETURNS text ${definer} AS $f$
DECLARE
  me int := pg_catalog.pg_backend_pid();
  b edgepg.backends;
BEGIN
  SELECT * INTO b FROM edgepg.backends r WHERE r.pid = me AND r.started = edgepg.started() FOR UPDATE;
  IF NOT FOUND OR want IS DISTINCT FROM b.n + 1 OR mac IS DISTINCT FROM ${hmac}(pg_catalog.convert_to(want::text || ':replica-key', 'UTF8'), b.key, 'sha256'::text) THEN
    RAISE EXCEPTION 'edgepg.replica_key: refused' USING ERRCODE = '42501';
  END IF;
  UPDATE edgepg.backends r SET n = want WHERE r.pid = me;
  RETURN pg_catalog.encode((SELECT k.key FROM edgepg.replica_key k), 'hex'); -- (as text: bytea_output is a setting a session may have left)
END
$f$;

-- What binds claims kept in a standby backend's settings to that backend: its pid and start, and the claims.
CREATE OR REPLACE FUNCTION edgepg.replica_mac(claims text) RETURNS text
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $f$
  SELECT pg_catalog.encode(${hmac}(pg_catalog.convert_to(pg_catalog.pg_backend_pid()::text || ':' || EXTRACT(epoch FROM edgepg.started())::text || ':' || claims, 'UTF8'),
    (SELECT k.key FROM edgepg.replica_key k), 'sha256'::text), 'hex')
$f$;
REVOKE ALL ON FUNCTION edgepg.replica_mac(text) FROM PUBLIC;

-- On a standby: claims the proxy's ticket (HMAC-SHA256(replica key, "replica:claims")) vouches for, before their exp,
-- kept in this backend's settings beside a MAC only this function makes.
CREATE OR REPLACE FUNCTION edgepg.set_replica_claims(new_claims text, ticket bytea) RETURNS void ${definer} AS $f$
BEGIN
  IF ticket IS DISTINCT FROM ${hmac}(pg_catalog.convert_to('replica:' || coalesce(new_claims, ''), 'UTF8'), (SELECT k.key FROM edgepg.replica_key k), 'sha256'::text) THEN
    RAISE EXCEPTION 'edgepg.set_replica_claims: refused' USING ERRCODE = '42501';
  END IF;
  IF NOT coalesce((new_claims::jsonb ->> 'exp')::numeric OPERATOR(pg_catalog.>) (EXTRACT(epoch FROM pg_catalog.clock_timestamp()) OPERATOR(pg_catalog.-) 60), false) THEN
    RAISE EXCEPTION 'edgepg.set_replica_claims: expired' USING ERRCODE = '42501';
  END IF;
  PERFORM pg_catalog.set_config('edgepg.claims', new_claims, false), pg_catalog.set_config('edgepg.claims_mac', edgepg.replica_mac(new_claims), false);
END
$f$;

-- The calling backend's claims: on the primary, its row; on a standby, its settings, if their MAC holds.
CREATE OR REPLACE FUNCTION edgepg.claims() RETURNS jsonb
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $f$
DECLARE
  kept text;
BEGIN
  IF NOT pg_catalog.pg_is_in_recovery() THEN
    RETURN (SELECT b.claims FROM edgepg.backends b WHERE b.pid = pg_catalog.pg_backend_pid() AND b.started = edgepg.started());
  END IF;
  kept := pg_catalog.current_setting('edgepg.claims', true);
  IF kept IS NULL OR kept = '' THEN
    RETURN NULL;
  END IF;
  IF pg_catalog.current_setting('edgepg.claims_mac', true) IS DISTINCT FROM edgepg.replica_mac(kept) THEN
    RAISE EXCEPTION 'edgepg.claims: this backend''s claims were changed' USING ERRCODE = '42501';
  END IF;
  RETURN kept::jsonb;
END
$f$;

GRANT EXECUTE ON FUNCTION edgepg.init(bytea), edgepg.set_claims(bigint, text, bytea), edgepg.replica_key(bigint, bytea), edgepg.set_replica_claims(text, bytea), edgepg.claims() TO PUBLIC;
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

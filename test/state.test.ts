/**
 * What a statement may leave behind on its backend, read from its text (proxy/pool/state.ts): the
 * forms in plain sight are caught, the hidden ones (code the proxy cannot read) are flagged, and
 * the everyday statements of an ORM are harmless. Literals, comments and dollar-quoted bodies never
 * count, whatever they spell.
 */
import { test } from 'node:test'
import assert from 'node:assert/strict'
import { effects, type StatementEffects } from '../proxy/pool/state'

const verdict = (sql: string) => {
  const e = effects(sql)
  return (Object.keys(e) as Array<keyof StatementEffects>).filter((k) => e[k]).join(' ') || 'nothing'
}

const cases: Array<[string, string]> = [
  // Harmless.
  ['SELECT 1', 'nothing'],
  ['begin', 'nothing'],
  ['COMMIT', 'nothing'],
  ['ROLLBACK; SAVEPOINT a; RELEASE a', 'nothing'],
  ['SET LOCAL statement_timeout = 100', 'nothing'],
  ['SET TRANSACTION ISOLATION LEVEL SERIALIZABLE', 'nothing'],
  ["SELECT set_config('app.user_id', $1, true)", 'nothing'],
  ['SELECT * FROM users WHERE id = $1', 'reads'],
  ['select "id", "name" from "public"."users" where "id" = $1 limit $2', 'reads'],
  ['INSERT INTO t (a, b) VALUES ($1, $2) RETURNING id', 'reads sequences'],
  ['UPDATE t SET a = lower($1), b = now() WHERE id = $2', 'reads sequences'],
  ['INSERT INTO t AS x (a) VALUES (1) ON CONFLICT (id) DO UPDATE SET a = EXCLUDED.a', 'reads sequences'],
  ['SELECT count(*), max(created_at), coalesce(sum(n), 0) FROM t GROUP BY k HAVING count(*) > 1', 'reads'],
  ['WITH c (x) AS (SELECT 1), d AS (SELECT 2) SELECT x FROM c, d', 'reads'],
  ['SELECT x::varchar(10), CAST(y AS numeric(10, 2)) FROM t', 'reads'],
  ['SELECT pg_catalog.lower(name) FROM t', 'reads'],
  ['SELECT json_build_object(\'a\', 1), jsonb_agg(t) FROM t', 'reads'],
  ["SELECT 'set_config(''x'', ''y'', false)' AS text", 'nothing'],
  ["SELECT E'it\\'s set_config(' AS text", 'nothing'],
  ["SELECT 1 -- SET search_path = evil; SELECT my_code()", 'nothing'],
  ['SELECT /* set_config( /* nested */ LISTEN */ 1', 'nothing'],
  ['SELECT $$ DO $$, $tag$ set_config( $tag$', 'nothing'],
  // Session state, in plain sight.
  ['SET search_path = other', 'sets'],
  ['SET SESSION statement_timeout = 1', 'sets'],
  ['set role other', 'sets'],
  ['SET SESSION AUTHORIZATION other', 'sets'],
  ['RESET ALL', 'sets'],
  ["SELECT set_config('app.user_id', '42', false)", 'sets'],
  ["SELECT set_config('app.user_id', $1, $2)", 'sets'],
  ['SELECT pg_advisory_lock(1)', 'sets'],
  ['SELECT pg_try_advisory_lock_shared(1)', 'sets'],
  ['PREPARE p AS SELECT 1', 'sets'],
  ['DEALLOCATE p', 'sets'],
  ['LISTEN ch', 'sets'],
  ['DISCARD ALL', 'sets'],
  ['DECLARE c CURSOR WITH HOLD FOR SELECT 1', 'sets reads'],
  ['DECLARE c CURSOR FOR SELECT 1', 'reads'],
  ['CREATE TEMP TABLE t (x int)', 'sets runs'],
  ['create table pg_temp.t (x int)', 'sets runs'],
  ['SELECT 1; SET TimeZone = UTC', 'sets'],
  // Code the proxy cannot read.
  ['DO $$ BEGIN CREATE TEMP TABLE t (x int); END $$', 'runs'],
  ['CALL refresh_all()', 'runs'],
  ['SELECT my_function(1)', 'runs'],
  ['SELECT "Lower"(x)', 'runs'],
  ['SELECT public.lower(x) FROM t', 'runs reads'],
  ['SELECT * FROM generate_series(1, 3) g, my_srf() f', 'runs reads'],
  ['EXPLAIN ANALYZE SELECT 1', 'runs reads'],
  ['CREATE TABLE t (x int DEFAULT f())', 'runs ddl'],
  ['VACUUM t', 'runs ddl'],
  ['SOMETHING NEW', 'runs'],
  // currval() and lastval() answer after nextval().
  ["SELECT nextval('s')", 'sequences'],
]

for (const [sql, expected] of cases) {
  test(`${sql} → ${expected}`, () => assert.equal(verdict(sql), expected))
}

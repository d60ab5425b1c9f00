/**
 * What a statement may leave behind, read with Postgres's own grammar (proxy/isolation/reader.ts):
 * the everyday statements of an ORM are plain, and what leaves state is not, however it is written:
 * the lexing tricks that fooled a tokenizer of ours (a comment ended by a carriage return, non-ASCII
 * dollar tags, calls in odd places) read as Postgres reads them.
 */
import { test, before } from 'node:test'
import assert from 'node:assert/strict'
import { loadReader, plainTag, read, type Reading } from '../proxy/isolation/reader'

before(() => loadReader())

/** What decides isolation (the routing fields are read below). */
const FLAGS = ['plain', 'code', 'unseen', 'control'] as const
const verdict = (sql: string) => {
  const r = read(sql)
  return FLAGS.filter((k) => r[k]).join(' ') || 'nothing'
}

const cases: Array<[string, string]> = [
  // Plain.
  ['SELECT 1', 'plain'],
  // (Transaction control and COPY: nothing of the proxy's may ride right behind them.)
  ['begin', 'plain control'],
  ['ROLLBACK; SAVEPOINT a; RELEASE a', 'plain control'],
  ['COPY t (a) FROM STDIN', 'plain code control'],
  ['SET LOCAL statement_timeout = 100', 'plain'],
  ['SET TRANSACTION ISOLATION LEVEL SERIALIZABLE', 'plain'],
  ["SELECT set_config('app.user_id', $1, true)", 'plain code'],
  ['SELECT * FROM users WHERE id = $1', 'plain code'],
  ['INSERT INTO t (a, b) VALUES ($1, $2) RETURNING id', 'plain code'],
  ['INSERT INTO t AS x (a) VALUES (1) ON CONFLICT (id) DO UPDATE SET a = EXCLUDED.a', 'plain code'],
  ["SELECT nextval('s')", 'plain code'],
  ['DECLARE c CURSOR FOR SELECT 1', 'plain'],
  ["SELECT col_description(c.oid, 0), pg_get_serial_sequence('t', 'id'), has_schema_privilege('public', 'USAGE') FROM pg_class c", 'plain code'],
  ['SELECT $é$ SET x = 1 $é$', 'plain'],
  ["SELECT 'a'';SET x = 1;'", 'plain'],
  ['SELECT 1 /* nested /* SET x = 1 */ still a comment */', 'plain'],
  // Not plain: state the backend can show, or code of the database's.
  ['SET statement_timeout = 5', 'nothing'],
  ['RESET ALL', 'nothing'],
  ['SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY', 'nothing'],
  ["SELECT set_config('statement_timeout', '5', false)", 'code'],
  ['SELECT pg_advisory_lock(1)', 'code'],
  ['SELECT (array[1,2])[1:pg_try_advisory_lock(43)::int]', 'code'],
  ['SELECT CASE WHEN true THEN pg_advisory_lock(2) END', 'code'],
  ['WITH x AS (SELECT pg_advisory_lock(3)) SELECT * FROM x', 'code'],
  ['VALUES (pg_advisory_lock(4))', 'code'],
  ['SELECT 1 -- a comment\r; SET statement_timeout = 5', 'nothing'],
  ['SELECT 1 -- a comment\r\nSELECT pg_advisory_lock(5)', 'code control'],
  ['DECLARE hold CURSOR WITH HOLD FOR SELECT 1', 'nothing'],
  ['DECLARE "hold" CURSOR WITHOUT HOLD FOR SELECT 1', 'plain'],
  ['SELECT 1 INTO TEMP notes', 'nothing'],
  ['SELECT 1 INTO TEMP notes UNION SELECT 2', 'nothing'],
  ['CREATE TEMP VIEW notes AS SELECT 1', 'nothing'],
  ['CREATE TABLE t (a int)', 'nothing'],
  // Lexing changed: what follows cannot be read, custom settings among it.
  ['SET LOCAL standard_conforming_strings = off', 'unseen'],
  ["SELECT set_config('standard_conforming_strings', 'off', true)", 'code unseen'],
  ['SET LOCAL client_encoding = \'GBK\'', 'unseen'],
  ['PREPARE p AS SELECT 1', 'nothing'],
  ['LISTEN ch', 'nothing'],
  ['DO $$ BEGIN PERFORM 1; END $$', 'code'],
  ['CALL p()', 'code'],
  ['SELECT public.f()', 'code'],
  ['SELECT f()', 'code'],
  ["SELECT U&'d\\0061t\\+000061' UESCAPE '\\', pg_advisory_lock(6)", 'code'],
  ['SELECT 1; this is not SQL', 'code control'],
  // What no catalog shows: the backend stays the session's.
  ['SET app.user_id = 1', 'unseen'],
  ["SELECT set_config('app.user', '1', false)", 'code unseen'],
  ["SELECT set_config($1, '1', true)", 'code'],
  ['SELECT setseed(0.5)', 'code unseen'],
  ["LOAD 'auto_explain'", 'unseen'],
]

test('every statement reads as Postgres parses it', () => {
  const wrong = cases.filter(([sql, want]) => verdict(sql) !== want).map(([sql, want]) => `${JSON.stringify(sql)}: ${verdict(sql)}, not ${want}`)
  assert.deepEqual(wrong, [])
})

test('command tags: plain reads and writes, and transaction control are plain; anything else is not', () => {
  for (const tag of ['SELECT 3', 'INSERT 0 1', 'UPDATE 2', 'DELETE 0', 'MERGE 1', 'COPY 5', 'BEGIN', 'COMMIT', 'ROLLBACK', 'FETCH 1', 'SHOW']) assert.ok(plainTag(tag), tag)
  for (const tag of ['SET', 'CREATE TABLE', 'DECLARE CURSOR', 'LISTEN', 'PREPARE', 'DO', 'CALL', 'DISCARD ALL', 'RESET', 'LOAD', 'SELECTED']) assert.ok(!plainTag(tag), tag)
})

/** What routing to replicas reads (proxy/ws/lent-session.ts routeOf): a standby may run it, a transaction it opens, where it leaves the block, a COPY FROM STDIN. */
test('what a standby may run, and the transaction blocks statements open and close', () => {
  const routing = (sql: string) => {
    const { writes, begins, block, copyIn } = read(sql)
    return [writes ? 'writes' : 'reads', begins, block, copyIn && 'copy-in'].filter(Boolean).join(' ')
  }
  const expected: Array<[string, string]> = [
    ['SELECT * FROM t WHERE id = $1', 'reads'],
    ['SHOW search_path', 'reads'],
    ['TABLE t', 'reads'],
    ['VALUES (1), (2)', 'reads'],
    ["SELECT nextval('s')", 'reads'], // (the standby refuses it: 25006, and it runs on the primary)
    ['SELECT * FROM t FOR UPDATE', 'writes'],
    ['SELECT * FROM t FOR SHARE SKIP LOCKED', 'writes'],
    ['SELECT 1 INTO t2', 'writes'],
    ['INSERT INTO t VALUES (1)', 'writes'],
    ['SET x = 1', 'writes'],
    ['SELECT 1; UPDATE t SET a = 1', 'writes'],
    ['BEGIN READ ONLY', 'writes read-only open'],
    ['START TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY', 'writes read-only open'],
    ['BEGIN ISOLATION LEVEL SERIALIZABLE READ ONLY', 'writes other open'],
    ['BEGIN READ WRITE', 'writes other open'],
    ['BEGIN', 'writes other open'],
    ['SELECT 1; BEGIN READ ONLY', 'writes open'], // (only a first statement that opens the block says how)
    ['COMMIT', 'writes closed'],
    ['BEGIN; SELECT 1; COMMIT', 'writes other closed'],
    ['COMMIT AND CHAIN', 'writes open'],
    ['END; BEGIN', 'writes open'],
    ['ROLLBACK', 'writes closed'],
    ["PREPARE TRANSACTION 'x'", 'writes closed'],
    ['SAVEPOINT a', 'writes'],
    // (Postgres waits for the client's data: the proxy's position query goes after it, not behind it.)
    ['COPY t FROM STDIN', 'writes copy-in'],
    ['SELECT 1; COPY t (a) FROM stdin WITH (FORMAT csv); COMMIT', 'writes closed copy-in'],
    ["COPY t FROM '/tmp/t.csv'", 'writes'],
    ['COPY t TO STDOUT', 'writes'],
    ['not sql at all', 'writes copy-in'], // (what the parser cannot read may be anything)
  ]
  assert.deepEqual(expected.map(([sql]) => [sql, routing(sql)]), expected)
})

/**
 * Isolation under transaction pooling decided by the backend itself (proxy/isolation/verify.ts):
 * with a reader that is wrong on purpose, the catalogs alone catch what a transaction left; a session
 * is pinned only while it holds state; an attacker's plants never reach another session; and code
 * made at Postgres behind the proxy's back is seen. Against the real proxy and Postgres, --pool-size 1:
 * a session that may see another's backend while it holds state would see it.
 */
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { httpSql, type Client } from '../src/index'
import { NOTHING } from '../proxy/isolation/reader'
import { startProxy, edgeClient, scratchTable, testPostgres, within } from './support/helpers'
import { PASSWORD } from './support/stack'

let scratch: Awaited<ReturnType<typeof scratchTable>>
before(async () => (scratch = await scratchTable('isolation', 'note text')))
after(() => scratch?.drop())

type Proxy = Awaited<ReturnType<typeof startProxy>>
const proxy = (reader?: () => typeof NOTHING, codeRecheckMs?: number) => startProxy({ pool: { mode: 'transaction', size: 1, timeoutMs: 400, codeRecheckMs, ...(reader && { reader }) } })

async function session(p: Proxy): Promise<Client> {
  const client = edgeClient(p.port, 'scram_user')
  client.on('error', () => {})
  await client.connect()
  return client
}

async function counter(p: Proxy, name: string): Promise<number> {
  const m = await p.metrics.registry.getSingleMetric(`edgepg_proxy_${name}`)!.get()
  return m.values.reduce((n, v) => n + v.value, 0)
}

/** What another session gets: its pid and answer, or the SQLSTATE it fails with (53300: the backend is held). */
const attempt = (c: Client, sql: string) =>
  c.query(sql).then(
    (r) => ({ rows: r.rows }),
    (err) => ({ code: err.code as string })
  )

const LOOK = `SELECT current_setting('statement_timeout') AS st, current_setting('search_path') AS sp, current_user::text AS who,
  (SELECT count(*)::int FROM pg_class WHERE relnamespace = pg_my_temp_schema()) AS temps, (SELECT count(*)::int FROM pg_prepared_statements) AS prepared,
  (SELECT count(*)::int FROM pg_cursors) AS cursors, (SELECT count(*)::int FROM pg_listening_channels()) AS listens,
  (SELECT count(*)::int FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()) AS locks`

// Each of these has a command tag other than plain reads' and writes': with a reader that calls
// everything plain, only the tags and the backend's own account stand between it and the next session.
const forms = [
  'SET statement_timeout = 4321',
  'SET search_path = pg_temp, public',
  'SET ROLE trust_user',
  'CREATE TEMP TABLE left_behind (x int)',
  'CREATE TEMP VIEW left_view AS SELECT 1 AS x',
  'PREPARE left_p AS SELECT 1',
  'DECLARE left_c CURSOR WITH HOLD FOR SELECT 1',
  'LISTEN left_channel',
]

test('a reader that calls everything plain is caught by the backend: each form pins its session, and the next session finds a clean backend', async () => {
  const p = await proxy(() => NOTHING)
  try {
    const probe = await session(p)
    const fresh = (await probe.query(LOOK)).rows[0]
    for (const form of forms) {
      const a = await session(p)
      await a.query(form)
      assert.deepEqual(await attempt(probe, 'SELECT 1 AS one'), { code: '53300' }, `${form}: the backend stays the session's`)
      await a.end()
      assert.deepEqual((await within(3000, 'a clean backend', probe.query(LOOK))).rows[0], fresh, `${form}: nothing left for the next session`)
    }
    assert.equal(await counter(p, 'pinned_sessions_total'), forms.length)
    // And the verification is not everything: with nothing left, the backend goes on at once.
    const plain = await session(p)
    await plain.query("SELECT 'plain' AS x")
    assert.deepEqual(await attempt(probe, 'SELECT 1 AS one'), { rows: [{ one: 1 }] })
    await plain.end()
    await probe.end()
  } finally {
    await p.close()
  }
})

test('a session is pinned only while it holds state: once its advisory lock is released, its backend serves others', async () => {
  const p = await proxy()
  try {
    const [a, b] = [await session(p), await session(p)]
    const pid = (await a.query('SELECT pg_backend_pid() AS pid')).rows[0].pid
    await a.query('SELECT pg_advisory_lock(7331)')
    assert.deepEqual(await attempt(b, 'SELECT 1 AS one'), { code: '53300' }, 'held while the lock is')
    await a.query('SELECT pg_advisory_unlock(7331)')
    assert.deepEqual(await attempt(b, 'SELECT pg_backend_pid() AS pid'), { rows: [{ pid }] }, 'the same backend, lent on')
    await Promise.all([a.end(), b.end()])
  } finally {
    await p.close()
  }
})

test("an attacker's temporary view, function and rule never reach another session of the same role", async () => {
  const p = await proxy()
  const captured = `${scratch.name}_captured`
  await scratch.tcp.query(`CREATE TABLE ${captured} (note text); GRANT ALL ON ${captured} TO PUBLIC`)
  try {
    const mallory = await session(p)
    await mallory.query(`CREATE TEMP VIEW ${scratch.name} AS SELECT 'planted'::text AS note`)
    await mallory.query(`CREATE FUNCTION pg_temp.grab(t text) RETURNS text LANGUAGE sql AS $$ INSERT INTO ${captured} VALUES (t) RETURNING t $$`)
    await mallory.query(`CREATE RULE steal AS ON INSERT TO ${scratch.name} DO INSTEAD SELECT pg_temp.grab(NEW.note)`)
    const alice = await session(p)
    assert.deepEqual(await attempt(alice, `SELECT note FROM ${scratch.name}`), { code: '53300' }, 'the planted backend is not lent')
    await mallory.end()
    await within(3000, 'a clean backend', alice.query(`INSERT INTO ${scratch.name} VALUES ('alice')`))
    assert.deepEqual((await alice.query(`SELECT note FROM ${scratch.name}`)).rows, [{ note: 'alice' }])
    assert.deepEqual((await scratch.tcp.query(`SELECT note FROM ${captured}`)).rows, [], 'nothing captured')
    await alice.end()
  } finally {
    await p.close()
    await scratch.tcp.query(`DROP TABLE ${captured}; DELETE FROM ${scratch.name}`)
  }
})

/** A trigger that sets statement_timeout for the session, made behind the proxy on `table`, in `made` (at Postgres directly, or through a session of the proxy). */
async function settingTrigger(table: string, made: (sql: string) => Promise<unknown>) {
  await made(`CREATE FUNCTION ${table}_f() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN PERFORM set_config('statement_timeout', '4321', false); RETURN NEW; END $$`)
  await made(`CREATE TRIGGER t BEFORE INSERT ON ${table} FOR EACH ROW EXECUTE FUNCTION ${table}_f()`)
}

/** a and b share the one backend; `make` adds a trigger that sets a setting while a writes, and a's next write must pin a. */
async function lateTrigger(name: string, codeRecheckMs: number | undefined, make: (table: string, a: Client, p: Proxy) => Promise<void>) {
  const p = await proxy(undefined, codeRecheckMs)
  const table = `${scratch.name}_${name}`
  await scratch.tcp.query(`CREATE TABLE ${table} (x int); GRANT ALL ON ${table} TO PUBLIC`)
  try {
    const [a, b] = [await session(p), await session(p)]
    await a.query(`INSERT INTO ${table} VALUES (1)`)
    assert.deepEqual(await attempt(b, 'SELECT 1 AS one'), { rows: [{ one: 1 }] }, 'no code yet: plain writes go on')
    await make(table, a, p)
    await a.query(`INSERT INTO ${table} VALUES (2)`)
    assert.deepEqual(await attempt(b, "SELECT current_setting('statement_timeout') AS st"), { code: '53300' }, "the trigger's setting stays a's")
    assert.deepEqual((await a.query("SELECT current_setting('statement_timeout') AS st")).rows, [{ st: '4321ms' }])
    await a.end()
    assert.notDeepEqual((await within(3000, 'a clean backend', b.query("SELECT current_setting('statement_timeout') AS st"))).rows, [{ st: '4321ms' }])
    await b.end()
  } finally {
    await p.close()
    await scratch.tcp.query(`DROP TABLE ${table}; DROP FUNCTION ${table}_f()`)
  }
}

test('a trigger made at Postgres behind the proxy, after it started, is seen once --code-recheck (1 s) has passed: what it sets pins the session that ran it', () =>
  lateTrigger('late', undefined, async (table) => {
    await settingTrigger(table, (sql) => scratch.tcp.query(sql))
    await new Promise((resolve) => setTimeout(resolve, 1100))
  }))

test('with --code-recheck 0, a trigger made at Postgres behind the proxy is seen by the very next transaction', () =>
  lateTrigger('strict', 0, (table) => settingTrigger(table, (sql) => scratch.tcp.query(sql))))

test('a trigger made through the proxy is seen by the very next transaction, whatever --code-recheck says', () =>
  lateTrigger('made', 60_000, (table, a) => settingTrigger(table, (sql) => a.query(sql))))

test('a trigger made over /sql is seen by the very next transaction of a WebSocket session, another pool key of the database', () =>
  lateTrigger('over_sql', 60_000, (table, _, p) => {
    const info = testPostgres()
    const sql = httpSql(`postgresql://scram_user:${encodeURIComponent(PASSWORD)}@${info.host}:${info.port}/${info.database}?application_name=maker`, { fetchEndpoint: `http://127.0.0.1:${p.port}/sql` })
    return settingTrigger(table, (text) => sql.query(text))
  }))

test("once the database's word on its code is --code-recheck old, plain transactions ending at once wait for one question, not a verification each", async () => {
  const database = `isolation_word_${process.pid}`
  await scratch.tcp.query(`CREATE DATABASE ${database}`) // (no code of its own, whatever other tests leave elsewhere)
  const p = await startProxy({ pool: { mode: 'transaction', size: 4, timeoutMs: 3000, codeRecheckMs: 200 } })
  const verifications = async () => Number((await p.metrics!.registry.metrics()).match(/^edgepg_proxy_verifications_total (\d+)/m)![1])
  const sessions = await Promise.all(Array.from({ length: 12 }, () => edgeClient(p.port, 'scram_user', { database })).map(async (c) => (await c.connect(), c)))
  try {
    await Promise.all(sessions.map((c) => c.query('SELECT 1')))
    await new Promise((resolve) => setTimeout(resolve, 300))
    const before = await verifications()
    // A cast may call a function of the database's own: each of these may run code.
    const answers = await Promise.all(sessions.map((c, i) => c.query('SELECT $1::int AS i', [i])))
    assert.deepEqual(answers.map((r) => r.rows[0].i), sessions.map((_, i) => i))
    assert.equal((await verifications()) - before, 1, 'one verification asked the database; the rest waited for its word')
  } finally {
    await Promise.all(sessions.map((c) => c.end().catch(() => {})))
    await p.close()
    await scratch.tcp.query(`DROP DATABASE ${database}`)
  }
})

test("a plain transaction decided on another's question keeps what it did to sequences: the next session sees no currval()", async () => {
  const database = `isolation_seq_${process.pid}`
  await scratch.tcp.query(`CREATE DATABASE ${database}`)
  const p = await startProxy({ pool: { mode: 'transaction', size: 4, timeoutMs: 3000, codeRecheckMs: 200 } })
  // One session per backend, so that each backend's last transaction is one that waited for the question.
  const sessions = await Promise.all(Array.from({ length: 4 }, () => edgeClient(p.port, 'scram_user', { database })).map(async (c) => (await c.connect(), c)))
  const next = await Promise.all(Array.from({ length: 4 }, () => edgeClient(p.port, 'scram_user', { database })).map(async (c) => (await c.connect(), c)))
  try {
    await sessions[0].query('CREATE SEQUENCE s')
    await Promise.all(sessions.map((c) => c.query('SELECT 1')))
    await new Promise((resolve) => setTimeout(resolve, 300)) // (the word on code is stale: one asks, the rest wait for it)
    await Promise.all(sessions.map((c) => c.query("SELECT nextval('s')")))
    // Each of the four backends, held at once by a new session: none shows another's currval().
    for (const c of next) await c.query('BEGIN')
    const seen = await Promise.all(next.map((c) => c.query("SELECT currval('s')").then((r) => `currval ${r.rows[0].currval}`, (err) => err.code)))
    assert.deepEqual(seen, ['55000', '55000', '55000', '55000'])
  } finally {
    await Promise.all([...sessions, ...next].map((c) => c.end().catch(() => {})))
    await p.close()
    await scratch.tcp.query(`DROP DATABASE ${database}`)
  }
})

test('a trigger made through a session pinned for good (it changed how Postgres lexes) is seen by the very next transaction of another', async () => {
  const p = await startProxy({ pool: { mode: 'transaction', size: 2, maxPinned: 2, timeoutMs: 400, codeRecheckMs: 60_000 } })
  const table = `${scratch.name}_pinned_maker`
  await scratch.tcp.query(`CREATE TABLE ${table} (x int); GRANT ALL ON ${table} TO PUBLIC`)
  const [a, b, c] = [await session(p), await session(p), await session(p)]
  try {
    await c.query(`INSERT INTO ${table} VALUES (1)`) // (the database's word: no code)
    await a.query('SET standard_conforming_strings = off') // a keeps its backend to its end
    await settingTrigger(table, (sql) => a.query(sql))
    await c.query(`INSERT INTO ${table} VALUES (2)`) // the trigger sets statement_timeout on c's backend
    assert.deepEqual(await attempt(b, "SELECT current_setting('statement_timeout') AS st"), { code: '53300' }, "the trigger's setting stays c's")
    assert.deepEqual((await c.query("SELECT current_setting('statement_timeout') AS st")).rows, [{ st: '4321ms' }])
  } finally {
    await Promise.all([a, b, c].map((x) => x.end().catch(() => {})))
    await p.close()
    await scratch.tcp.query(`DROP TABLE ${table}; DROP FUNCTION ${table}_f()`)
  }
})

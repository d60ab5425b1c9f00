/**
 * Isolation under transaction pooling decided by the backend itself (proxy/isolation/verify.ts):
 * with a reader that is wrong on purpose, the catalogs alone catch what a transaction left; a session
 * is pinned only while it holds state; an attacker's plants never reach another session; and what
 * code made at Postgres behind the proxy's back leaves is caught, even once the code is gone. Against the real proxy and Postgres, --pool-size 1:
 * a session that may see another's backend while it holds state would see it.
 */
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import type { Client } from '../src/index'
import { NOTHING } from '../proxy/isolation/reader'
import { startProxy, edgeClient, scratchTable, testPostgres, within } from './support/helpers'
import { startDelayRelay, startHoldingRelay } from './support/delay-relay'

let scratch: Awaited<ReturnType<typeof scratchTable>>
before(async () => (scratch = await scratchTable('isolation', 'note text')))
after(() => scratch?.drop())

type Proxy = Awaited<ReturnType<typeof startProxy>>
const proxy = (reader?: () => typeof NOTHING) => startProxy({ pool: { mode: 'transaction', size: 1, timeoutMs: 400, ...(reader && { reader }) } })

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

/**
 * Code an attacker makes at Postgres directly, behind the proxy, and takes away again before the
 * next session's turn: `body` runs (in plpgsql) when `a` reads the view, and what it leaves must
 * never reach `b`, the next session on the one backend.
 */
async function hiddenCode(name: string, body: (table: string) => string, check: (a: Client, b: Client, table: string) => Promise<void>) {
  const p = await proxy()
  const table = `${scratch.name}_${name}`
  const made = (sql: string) => scratch.tcp.query(sql)
  await made(`CREATE SEQUENCE ${table}_s; GRANT ALL ON ${table}_s TO PUBLIC`)
  try {
    const [a, b] = [await session(p), await session(p)]
    await a.query('SELECT 1') // (the proxy has served the key: what follows is made after it started)
    await made(`CREATE FUNCTION ${table}_f() RETURNS int LANGUAGE plpgsql AS $f$ BEGIN ${body(table)}; RETURN 1; END $f$`)
    await made(`CREATE VIEW ${table} AS SELECT ${table}_f() AS one; GRANT SELECT ON ${table} TO PUBLIC`)
    assert.deepEqual((await a.query(`SELECT one FROM ${table}`)).rows, [{ one: 1 }])
    await made(`DROP VIEW ${table}; DROP FUNCTION ${table}_f()`) // (gone before anyone decides anything)
    await check(a, b, table)
    await Promise.all([a.end(), b.end()])
  } finally {
    await p.close()
    await made(`DROP VIEW IF EXISTS ${table}; DROP FUNCTION IF EXISTS ${table}_f(); DROP SEQUENCE ${table}_s`)
  }
}

test("code made behind the proxy's back, run by a plain read and gone at once: the settings, advisory lock and currval() it left never reach the next session", () =>
  hiddenCode('reset', (table) => `PERFORM set_config('statement_timeout', '4321', false), pg_advisory_lock(4242), nextval('${table}_s')`, async (a, b, table) => {
    const pid = (await a.query('SELECT pg_backend_pid() AS pid')).rows[0].pid
    const look = `SELECT pg_backend_pid() AS pid, current_setting('statement_timeout') AS st,
      (SELECT count(*)::int FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()) AS locks`
    assert.deepEqual((await attempt(b, look)), { rows: [{ pid, st: '0', locks: 0 }] }, 'the same backend, its setting and lock reset')
    assert.deepEqual(await attempt(b, `SELECT currval('${table}_s')`), { code: '55000' }, 'no currval() of the other session')
  }))

test("code made behind the proxy's back, run by a plain read and gone at once: the temporary table it made pins the session that ran it", () =>
  hiddenCode('temp', () => 'CREATE TEMP TABLE planted (x int)', async (a, b) => {
    assert.deepEqual(await attempt(b, 'SELECT 1 AS one'), { code: '53300' }, "the backend stays a's")
    assert.deepEqual((await a.query('SELECT count(*)::int AS n FROM planted')).rows, [{ n: 0 }], 'a keeps what it made')
    await a.end()
    const temps = 'SELECT count(*)::int AS n FROM pg_class WHERE relnamespace = pg_my_temp_schema()'
    assert.deepEqual((await within(3000, 'a clean backend', b.query(temps))).rows, [{ n: 0 }])
  }))

test('a plain read that ran nothing of the database\'s own (no relation, cast or operator) is not verified; one that may have is, lightly', async () => {
  const p = await proxy()
  try {
    const a = await session(p)
    const verifications = async (kind: string) => Number((await p.metrics.registry.metrics()).match(new RegExp(`^edgepg_proxy_verifications_total\\{kind="${kind}"\\} (\\d+)`, 'm'))?.[1] ?? 0)
    await a.query("SELECT 'x' AS x")
    assert.deepEqual([await verifications('light'), await verifications('full')], [0, 0])
    await a.query(`SELECT count(*) FROM ${scratch.name}`)
    assert.deepEqual([await verifications('light'), await verifications('full')], [1, 0])
    await a.query('CREATE TEMP TABLE t (x int)')
    assert.deepEqual([await verifications('light'), await verifications('full')], [1, 1])
    await a.end()
  } finally {
    await p.close()
  }
})

test('the light verification rides in the write of the transaction it checks: the next session waits no round trip to Postgres for it', async () => {
  const pg = testPostgres()
  const relay = await startDelayRelay({ host: pg.host, port: pg.port }, 100) // (a round trip to Postgres: 200 ms)
  const p = await startProxy({ upstream: `127.0.0.1:${relay.port}`, pool: { mode: 'transaction', size: 1, timeoutMs: 5000 } })
  try {
    const [a, b] = [await session(p), await session(p)]
    await a.query('SELECT 1')
    await b.query('SELECT 1') // (both warm; the one backend parked with b)
    const verifications = await counter(p, 'verifications_total')
    const start = performance.now()
    const read = `SELECT count(*)::int AS n FROM ${scratch.name}`
    const elapsed = (c: Client) => c.query(read).then(() => performance.now() - start)
    const [ta, tb] = await Promise.all([elapsed(a), elapsed(b)])
    assert.equal((await counter(p, 'verifications_total')) - verifications, 2, 'each transaction was verified')
    // a: one round trip to Postgres, its verification in the same; b: one more, after a's backend came back.
    assert.ok(ta >= 200 && ta < 300, `a took ${ta.toFixed(0)} ms`)
    assert.ok(tb >= 400 && tb < 500, `b took ${tb.toFixed(0)} ms (600 if a's verification had a round trip of its own)`)
    await Promise.all([a.end(), b.end()])
  } finally {
    await p.close()
    await relay.close()
  }
})

test("a light verification never rides while a full one is unanswered: the session's next read does not wipe the setting and lock it keeps", async () => {
  const pg = testPostgres()
  // Postgres's answers to verifications (DISCARD SEQUENCES leads them) reach the proxy 300 ms late.
  const relay = await startHoldingRelay({ host: pg.host, port: pg.port }, (type, body) => (type === 'C' && body.includes('DISCARD SEQUENCES') ? 300 : 0))
  const p = await startProxy({ upstream: `127.0.0.1:${relay.port}`, pool: { mode: 'transaction', size: 1, timeoutMs: 400 } })
  try {
    const a = await session(p)
    await a.query('SET statement_timeout = 4321; SELECT pg_advisory_lock(4242)') // (verified fully, its answer held)
    await a.query(`SELECT count(*) FROM ${scratch.name}`) // (a read that may run the database's code: verified lightly)
    const look = (await a.query(LOOK)).rows[0]
    assert.deepEqual([look.st, look.locks], ['4321ms', 1], 'the setting and the lock survived the read')
    const probe = await session(p)
    assert.deepEqual(await attempt(probe, 'SELECT 1 AS one'), { code: '53300' }, 'the backend stays the session\'s')
    await Promise.all([a.end(), probe.end()])
  } finally {
    await p.close()
    await relay.close()
  }
})

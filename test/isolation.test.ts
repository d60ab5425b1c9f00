/**
 * Isolation under transaction pooling decided by Postgres itself (proxy/isolation/verify.ts): with a
 * reader that is wrong on purpose, the backend's own account and the reset at each handover catch what
 * a transaction left; a session is pinned only while it holds state; an attacker's plants never reach
 * another session; and what code made at Postgres behind the proxy's back leaves is reset, even once
 * the code is gone. Against the real proxy and Postgres, --pool-size 1: a session that may see
 * another's backend while it holds state would see it.
 */
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import type { Client } from '../src/index'
import { NOTHING } from '../proxy/isolation/reader'
import pg from 'pg'
import { startProxy, edgeClient, eventually, pgConfig, scratchTable, testPostgres, within } from './support/helpers'
import { isAccount, startDelayRelay, startHoldingRelay } from './support/delay-relay'

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
  'CREATE TEMP TABLE left_behind (x int)',
  'CREATE TEMP VIEW left_view AS SELECT 1 AS x',
  'DECLARE left_c CURSOR WITH HOLD FOR SELECT 1',
]

test("a reader that calls everything plain is caught by the backend: settings, role, SQL prepared statements and LISTEN channels follow their session (the next session on the backend finds none of them), the rest pin it", async () => {
  const p = await proxy(() => NOTHING)
  try {
    const probe = await session(p)
    const fresh = (await probe.query(LOOK)).rows[0]
    const a = await session(p)
    await a.query('SET statement_timeout = 4321')
    await a.query("SELECT set_config('search_path', 'pg_temp, public', false)")
    await a.query('SET ROLE trust_user')
    await a.query("PREPARE left_p AS SELECT 'mine' AS x")
    await a.query('LISTEN left_channel')
    for (let round = 0; round < 3; round++) {
      assert.deepEqual((await within(3000, 'the probe', probe.query(LOOK))).rows[0], fresh, 'the backend is lent on, without the settings')
      const mine = (await a.query(LOOK)).rows[0]
      assert.deepEqual([mine.st, mine.sp, mine.who, mine.prepared, mine.listens], ['4321ms', 'pg_temp, public', 'trust_user', 1, 1], 'the session keeps its state, backend after backend')
      assert.deepEqual((await a.query('EXECUTE left_p')).rows, [{ x: 'mine' }])
    }
    assert.equal(await counter(p, 'pinned_sessions_total'), 0)
    await Promise.all([a.end(), probe.end()])
  } finally {
    await p.close()
  }
})

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

test("code made behind the proxy's back, run by a plain read and gone at once: the temporary table it made is gone before the next session runs anything there", () =>
  hiddenCode('temp', () => 'CREATE TEMP TABLE planted (x int)', async (a, b) => {
    const pid = (await a.query('SELECT pg_backend_pid() AS pid')).rows[0].pid
    assert.deepEqual((await a.query('SELECT count(*)::int AS n FROM planted')).rows, [{ n: 0 }], 'a has it while its backend stays with it')
    const temps = 'SELECT pg_backend_pid() AS pid, count(*)::int AS n FROM pg_class WHERE relnamespace = pg_my_temp_schema()'
    assert.deepEqual((await within(3000, 'the backend', b.query(temps))).rows, [{ pid, n: 0 }], "b runs on a's backend, which holds nothing of a's")
  }))

/** The first draws random() makes after setseed(0.42), on a connection of its own. */
async function seeded(): Promise<number[]> {
  const c = new pg.Client(pgConfig())
  await c.connect()
  try {
    await c.query('SELECT setseed(0.42)')
    return [(await c.query('SELECT random() AS r')).rows[0].r, (await c.query('SELECT random() AS r')).rows[0].r]
  } finally {
    await c.end()
  }
}

test("code made behind the proxy's back, run by a plain read and gone at once: the seed it gave random() is not the next session's", () =>
  hiddenCode('seed', () => 'PERFORM setseed(0.42)', async (a, b) => {
    const known = await seeded()
    assert.equal((await a.query(`SELECT 'pg_catalog.setseed(float8)'::regprocedure::oid::int AS oid`)).rows[0].oid, 1599, 'the function the proxy calls by its OID')
    const pid = (await a.query('SELECT pg_backend_pid() AS pid')).rows[0].pid
    const draw = 'SELECT pg_backend_pid() AS pid, random() AS r'
    const drawn = [(await b.query(draw)).rows[0], (await b.query(draw)).rows[0]]
    assert.deepEqual(drawn.map((d) => d.pid), [pid, pid], "b runs on a's backend")
    assert.notDeepEqual(drawn.map((d) => d.r), known, 'b draws from a fresh seed, not the one a chose')
    // (The same seed set by the session itself is its own: it draws the sequence it chose.)
    await b.query('SELECT setseed(0.42)')
    assert.deepEqual([(await b.query('SELECT random() AS r')).rows[0].r, (await b.query('SELECT random() AS r')).rows[0].r], known)
  }))

/** Handovers counted by the proxy's metrics, by outcome. */
const handovers = async (p: Proxy) => Number((await p.metrics.registry.metrics()).match(/^edgepg_proxy_handovers_total\{outcome="reset"\} (\d+)/m)?.[1] ?? 0)

test('nothing is asked after a plain transaction, whatever code it may run; a backend is reset when it changes hands, and not when it goes back to the session that used it last', async () => {
  const p = await proxy()
  try {
    const [a, b] = [await session(p), await session(p)]
    const verifications = () => counter(p, 'verifications_total')
    await a.query("SELECT 'x' AS x")
    await a.query(`SELECT count(*) FROM ${scratch.name}`)
    assert.deepEqual([await verifications(), await handovers(p)], [0, 0], "a's own backend, twice: no question, no reset")
    await b.query(`SELECT count(*) FROM ${scratch.name}`)
    assert.deepEqual([await verifications(), await handovers(p)], [0, 1], "b takes a's backend: reset")
    await b.query("SELECT 'x' AS x")
    assert.equal(await handovers(p), 1, "b's again: no reset")
    await a.query('CREATE TEMP TABLE t (x int)')
    assert.deepEqual([await verifications(), await handovers(p)], [1, 2], 'a takes it back from b (reset), and its temporary table is asked about')
    await Promise.all([a.end(), b.end()])
  } finally {
    await p.close()
  }
})

test("the reset rides in the next session's first write: a backend that changes hands costs it no round trip to Postgres", async () => {
  const pg = testPostgres()
  const relay = await startDelayRelay({ host: pg.host, port: pg.port }, 100) // (a round trip to Postgres: 200 ms)
  const p = await startProxy({ upstream: `127.0.0.1:${relay.port}`, pool: { mode: 'transaction', size: 1, timeoutMs: 5000 } })
  try {
    const [a, b] = [await session(p), await session(p)]
    await a.query('SELECT 1')
    await b.query('SELECT 1') // (both warm; the one backend parked with b)
    const before = await handovers(p)
    const start = performance.now()
    const read = `SELECT count(*)::int AS n FROM ${scratch.name}`
    const elapsed = (c: Client) => c.query(read).then(() => performance.now() - start)
    const [ta, tb] = await Promise.all([elapsed(a), elapsed(b)])
    assert.equal((await handovers(p)) - before, 2, 'the backend changed hands twice: b to a, a to b')
    // a: one round trip to Postgres, its reset in the same; b: one more, after a's transaction ended.
    assert.ok(ta >= 200 && ta < 300, `a took ${ta.toFixed(0)} ms`)
    assert.ok(tb >= 400 && tb < 500, `b took ${tb.toFixed(0)} ms (600 if a reset had a round trip of its own)`)
    await Promise.all([a.end(), b.end()])
  } finally {
    await p.close()
    await relay.close()
  }
})

test("a session's next read, while the account of what it keeps is unanswered, does not lose the setting and lock it keeps", async () => {
  const pg = testPostgres()
  // Postgres's answers to the account reach the proxy 300 ms late.
  const relay = await startHoldingRelay({ host: pg.host, port: pg.port }, (type, body) => (isAccount(type, body) ? 300 : 0))
  const p = await startProxy({ upstream: `127.0.0.1:${relay.port}`, pool: { mode: 'transaction', size: 1, timeoutMs: 400 } })
  try {
    const a = await session(p)
    await a.query('SET statement_timeout = 4321; SELECT pg_advisory_lock(4242)') // (asked about, its answer held)
    await a.query(`SELECT count(*) FROM ${scratch.name}`)
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

/**
 * The forging attack on a question the proxy used to prepare on each backend, tried every way a
 * session can: it reads what is prepared (nothing of the proxy's is), drops and makes statements by
 * protocol, by SQL and by a DO block's dynamic SQL, plants temporary look-alikes of the catalog's
 * functions and operators, and leaves state a next session would trip on. With a reader that calls
 * everything plain, the next session on that backend must find, by Postgres's own account, none of it.
 */
test('forging the proxy\'s question by protocol, SQL or a DO block: nothing to forge, and the next session on the backend finds nothing left', async () => {
  const p = await proxy(() => NOTHING)
  const plant = `EXECUTE 'DEALLOCATE ALL'; EXECUTE 'PREPARE edgepg_verify_forged AS SELECT ''statements 0'''; PERFORM set_config('search_path', 'pg_temp, public', false);
    EXECUTE 'CREATE TEMP TABLE ${scratch.name} (note text)'; EXECUTE 'INSERT INTO ${scratch.name} VALUES (''planted'')';
    EXECUTE 'CREATE FUNCTION pg_temp.pg_backend_pid() RETURNS int LANGUAGE sql AS $q$ SELECT 0 $q$';
    EXECUTE 'LISTEN forged'; PERFORM pg_advisory_lock(4343)`
  await scratch.tcp.query(`CREATE FUNCTION ${scratch.name}_plant() RETURNS int LANGUAGE plpgsql AS $f$ BEGIN ${plant}; RETURN 1; END $f$`)
  const ways: Array<[string, (a: Client) => Promise<unknown>]> = [
    ['protocol', async (a) => {
      await a.query({ text: 'SELECT 1', name: 'edgepg_verify_light' }) // (a protocol-level statement under a name the proxy once used)
      await a.query({ text: `SELECT ${scratch.name}_plant()`, values: [] })
    }],
    ['SQL', (a) => a.query(`SELECT ${scratch.name}_plant()`)],
    ['a DO block', (a) => a.query(`DO $d$ BEGIN ${plant}; END $d$`)],
  ]
  try {
    const victim = await session(p)
    const fresh = (await victim.query(LOOK)).rows[0]
    for (const [way, attack] of ways) {
      const mallory = await session(p)
      const seen = (await mallory.query('SELECT name FROM pg_prepared_statements')).rows
      assert.deepEqual(seen, [], `${way}: nothing of the proxy's to read`)
      const pid = (await mallory.query('SELECT pg_backend_pid() AS pid')).rows[0].pid
      await attack(mallory)
      // (A DO block reads as more than plain to Postgres's tags: its session keeps the backend while it holds state.)
      if (way === 'a DO block') await mallory.end()
      const look = (await within(3000, `${way}: the backend`, victim.query(`SELECT pg_backend_pid() AS pid, ${LOOK.slice('SELECT '.length)}`))).rows[0]
      assert.deepEqual({ ...look, pid: undefined }, { ...fresh, pid: undefined }, `${way}: nothing of mallory's`)
      if (way !== 'a DO block') assert.equal(look.pid, pid, `${way}: the victim ran on mallory's backend`)
      const mine = (await victim.query(`INSERT INTO ${scratch.name} VALUES ('victim') RETURNING note`)).rows
      assert.deepEqual(mine, [{ note: 'victim' }])
      assert.deepEqual((await victim.query(`SELECT note FROM ${scratch.name}`)).rows, [{ note: 'victim' }], `${way}: the victim reads its own table`)
      assert.deepEqual((await scratch.tcp.query(`DELETE FROM ${scratch.name} RETURNING note`)).rows, [{ note: 'victim' }], `${way}: its row is in the real table`)
      await mallory.end()
    }
    await victim.end()
  } finally {
    await p.close()
    await scratch.tcp.query(`DROP FUNCTION ${scratch.name}_plant()`)
  }
})

/**
 * Postgres refuses the reset of a backend that changes hands (here: DISCARD ALL must drop a
 * temporary table that another connection holds a lock on, and the login's lock_timeout runs out):
 * it skips the next session's statement, and the proxy runs it on another backend, unseen. Shown
 * from Postgres: the statement records the backend it ran on, once.
 */
test('a reset Postgres refuses: the next session\'s statements never run on that backend, and run once on another', async () => {
  const p = await proxy(() => NOTHING)
  const log = `${scratch.name}_ran`
  await scratch.tcp.query(`CREATE TABLE ${log} (pid int); GRANT ALL ON ${log} TO PUBLIC`)
  await scratch.tcp.query(`CREATE FUNCTION ${log}_temp() RETURNS text LANGUAGE plpgsql AS $f$ BEGIN CREATE TEMP TABLE held (x int); RETURN pg_my_temp_schema()::regnamespace::text; END $f$`)
  const locker = new pg.Client(pgConfig('scram_user'))
  try {
    const options = { options: '-c lock_timeout=300' }
    const [a, b] = [edgeClient(p.port, 'scram_user', options), edgeClient(p.port, 'scram_user', options)]
    for (const c of [a, b]) c.on('error', () => {}), await c.connect()
    const pid = (await a.query('SELECT pg_backend_pid() AS pid')).rows[0].pid
    const schema = (await a.query(`SELECT ${log}_temp() AS s`)).rows[0].s // (code: a keeps nothing, its backend goes on as it is)
    await locker.connect()
    await locker.query(`BEGIN; LOCK TABLE ${schema}.held IN ACCESS SHARE MODE`)
    const refused = await counter(p, 'handovers_total')
    // Two statements in one write, each in a Sync group of its own: the second must not run behind the first's Sync on that backend either.
    const insert = (n: number) => b.query(`INSERT INTO ${log} VALUES (pg_backend_pid() + $1::int - $1::int) RETURNING pid`, [n])
    const ran = (await within(5000, "b's inserts", Promise.all([insert(1), insert(2)]))).flatMap((r) => r.rows)
    assert.notEqual(ran[0].pid, pid, 'they ran on another backend')
    assert.deepEqual((await scratch.tcp.query(`SELECT pid FROM ${log}`)).rows, ran, 'each once, and never on the backend whose reset was refused')
    assert.equal((await counter(p, 'handovers_total')) - refused, 1)
    assert.equal(Number((await p.metrics.registry.metrics()).match(/^edgepg_proxy_handovers_total\{outcome="refused"\} (\d+)/m)?.[1]), 1)
    await locker.query('ROLLBACK') // (the closed backend drops its temporary table as it exits: it waits for the lock)
    await eventually(async () => (await scratch.tcp.query('SELECT count(*)::int AS n FROM pg_stat_activity WHERE pid = $1', [pid])).rows[0].n === 0, 'the refused backend closed')
    await Promise.all([a.end(), b.end()])
  } finally {
    await locker.query('ROLLBACK').catch(() => {})
    await locker.end().catch(() => {})
    await p.close()
    await scratch.tcp.query(`DROP TABLE ${log}; DROP FUNCTION ${log}_temp()`)
  }
})

/**
 * Transaction pooling (`--pool-mode transaction`): sessions share a few backends one transaction at
 * a time, and no session ever sees another's state. Against the real proxy and Postgres; what
 * Postgres holds is read over TCP. With --pool-size 1, a session that may have left state behind
 * keeps its backend (pinned): another session then waits, and times out with 53300, rather than
 * see it; once the first ends, the backend is reset and the other runs on a clean one.
 */
import { test, before, after } from 'node:test'
import net from 'node:net'
import assert from 'node:assert/strict'
import { Client } from '../src/index'
import { startProxy, edgeClient, edgeConfig, eventually, within, scratchTable, testPostgres } from './support/helpers'
import { PASSWORD, type Role } from './support/stack'
import { startDelayRelay } from './support/delay-relay'

const PG = testPostgres()

let scratch: Awaited<ReturnType<typeof scratchTable>>
before(async () => (scratch = await scratchTable('txpool', 'name text NOT NULL')))
after(() => scratch?.drop())

const APP = 'edgepg-txpool'
/** A transaction-mode proxy with `size` backends per key, all of which one client may hold (every session here comes from 127.0.0.1: test/shares.test.ts covers the cap). */
const txProxy = (size: number, timeoutMs = 400) => startProxy({ pool: { mode: 'transaction', size, timeoutMs, maxPerClient: size } })

async function session(port: number, user: Role = 'scram_user'): Promise<Client> {
  const client = edgeClient(port, user, { application_name: APP })
  client.on('error', () => {})
  await client.connect()
  return client
}

/** A metric's value on the proxy's registry. */
async function metric(p: Awaited<ReturnType<typeof txProxy>>, name: string, labels: Record<string, string> = {}): Promise<number> {
  const m = await p.metrics.registry.getSingleMetric(`edgepg_proxy_${name}`)!.get()
  return m.values.find((v) => Object.entries(labels).every(([k, x]) => v.labels[k] === x) && !('le' in v.labels))?.value ?? 0
}

/** Sessions pinned, whatever the reason. */
async function pinned(p: Awaited<ReturnType<typeof txProxy>>): Promise<number> {
  const m = await p.metrics.registry.getSingleMetric('edgepg_proxy_pinned_sessions_total')!.get()
  return m.values.reduce((n, v) => n + v.value, 0)
}

/** Until one of this test's sessions runs pg_sleep, seen from outside. */
const sleeping = () =>
  eventually(async () => (await scratch.tcp.query("SELECT count(*)::int AS n FROM pg_stat_activity WHERE application_name = $1 AND query LIKE 'SELECT pg_sleep%' AND state = 'active'", [APP])).rows[0].n === 1, 'the statement to run')

/** Backends Postgres holds for this test's sessions. */
async function backendsHeld(): Promise<number> {
  const { rows } = await scratch.tcp.query('SELECT count(*)::int AS n FROM pg_stat_activity WHERE application_name = $1', [APP])
  return rows[0].n
}

test('many sessions on one backend: each runs its queries and transactions, one at a time', async () => {
  const p = await txProxy(1)
  const clients = await Promise.all(Array.from({ length: 8 }, () => session(p.port)))
  try {
    // (Logins made at once before the key had a lender each made a backend: all but one are closed.)
    await eventually(async () => (await backendsHeld()) === 1, 'eight sessions logged in, one backend')
    const pids = new Set<number>()
    for (let round = 0; round < 3; round++) {
      await Promise.all(
        clients.map(async (c, i) => {
          pids.add((await c.query('SELECT pg_backend_pid() AS pid')).rows[0].pid)
          await c.query('BEGIN')
          await c.query(`INSERT INTO ${scratch.name} VALUES ($1)`, [`s${i}r${round}`])
          await c.query('COMMIT')
        })
      )
    }
    assert.equal(pids.size, 1, 'all on the one backend')
    assert.equal((await scratch.tcp.query(`SELECT count(*)::int AS n FROM ${scratch.name}`)).rows[0].n, 24)
    assert.equal(await backendsHeld(), 1)
  } finally {
    await Promise.all(clients.map((c) => c.end()))
    await p.close()
  }
})

/** A form of session state: made by one session, looked for by another (null: not seen). */
interface Form {
  name: string
  make: string[]
  look: string
  /** What `look` shows to the session that made it. */
  made: unknown
  /** The role both sessions log in as (default scram_user). */
  login?: Role
}

const forms: Form[] = [
  { name: 'set_config(…, false) inside a SELECT', make: ["SELECT set_config('app.user_id', '42', false)"], look: "SELECT current_setting('app.user_id', true) AS v", made: '42' },
  // (Carried to each backend, a timeout that ends backends would end one per statement: it stays where it was set.)
  { name: 'SET idle_session_timeout', make: ["SET idle_session_timeout = '1h'"], look: "SELECT current_setting('idle_session_timeout') AS v", made: '1h' },
  { name: 'a temp table made in a DO block', make: ['DO $$ BEGIN CREATE TEMP TABLE hidden (x int); END $$'], look: "SELECT to_regclass('pg_temp.hidden')::text AS v", made: 'hidden' },
  { name: 'SET SESSION AUTHORIZATION', make: ['SET SESSION AUTHORIZATION scram_user'], look: 'SELECT session_user::text AS v', made: 'scram_user', login: 'trust_user' as const },
  { name: 'settings past what follow a session (64 KiB)', make: ["SELECT set_config('search_path', repeat('a, ', 25000) || 'public', false)"], look: "SELECT length(current_setting('search_path')) AS v", made: 75006 },
  { name: 'more SQL prepared statements than follow a session', make: [Array.from({ length: 101 }, (_, i) => `PREPARE many_${i} AS SELECT ${i}`).join('; ')], look: "SELECT count(*)::int AS v FROM pg_prepared_statements WHERE name LIKE 'many%'", made: 101 },
  { name: 'a cursor WITH HOLD', make: ['DECLARE c CURSOR WITH HOLD FOR SELECT 1'], look: 'SELECT count(*)::int AS v FROM pg_cursors', made: 1 },
  { name: 'a session advisory lock', make: ['SELECT pg_advisory_lock(4343)'], look: "SELECT count(*)::int AS v FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()", made: 1 },
  { name: 'a state-setting call in a function of its own', make: ["CREATE OR REPLACE FUNCTION pg_temp.sneak() RETURNS void LANGUAGE sql AS $$ SELECT set_config('app.sneak', 'x', false) $$", 'SELECT pg_temp.sneak()'], look: "SELECT current_setting('app.sneak', true) AS v", made: 'x' },
]

for (const form of forms) {
  test(`isolation: ${form.name} is the session's alone, and it keeps it`, async () => {
    const p = await txProxy(1)
    const [a, b] = [await session(p.port, form.login), await session(p.port, form.login)]
    try {
      const fresh = (await b.query(form.look)).rows[0].v // (what a backend of its own says)
      for (const sql of form.make) await a.query(sql)
      // The other session cannot have the backend while it may hold a's state: it waits, then 53300.
      const other = await b.query(form.look).then(
        (r) => ({ seen: r.rows[0].v }),
        (err) => ({ code: err.code })
      )
      assert.deepEqual(other, { code: '53300' }, `the other session ${JSON.stringify(other)}`)
      assert.deepEqual((await a.query(form.look)).rows[0].v, form.made, 'the session keeps its state across transactions')
      assert.equal(await pinned(p), 1, 'one pinned session, counted')
      assert.equal(await metric(p, 'lend_timeouts_total'), 1)
      await a.end()
      // Once it has ended, its backend is reset: the other session runs on it and finds it clean.
      assert.deepEqual((await within(3000, 'the backend after a reset', b.query(form.look))).rows[0].v, fresh)
    } finally {
      await a.end().catch(() => {})
      await b.end()
      await p.close()
    }
  })
}

test('DDL does not pin: the backend says what it left (nothing), and reads go on on both backends', async () => {
  const p = await txProxy(2)
  const [ddl, ...readers] = await Promise.all(Array.from({ length: 5 }, () => session(p.port)))
  try {
    await ddl.query('CREATE TABLE IF NOT EXISTS txpool_ddl (x int)')
    for (let round = 0; round < 3; round++) {
      for (const r of readers) assert.equal((await r.query(`SELECT count(*)::int AS n FROM ${scratch.name}`)).rows.length, 1)
    }
    assert.equal(await pinned(p), 0, 'no session is pinned')
    assert.ok((await metric(p, 'verifications_total')) >= 1, 'the DDL was verified')
  } finally {
    await Promise.all([ddl, ...readers].map((c) => c.end()))
    await p.close()
    await scratch.tcp.query('DROP TABLE IF EXISTS txpool_ddl')
  }
})

test("settings, role and SQL prepared statements follow their session: made again on each backend it borrows (no pin), over 100 transactions each; the other sessions there see none of them; RESET, DEALLOCATE and code count, by Postgres's account", async () => {
  const p = await txProxy(2, 3000)
  const LOOK = "SELECT current_setting('application_name') AS app, current_setting('search_path') AS path, current_setting('statement_timeout') AS st, current_setting('DateStyle') AS ds, current_user::text AS who, (SELECT string_agg(name, ',' ORDER BY name) FROM pg_prepared_statements) AS prepared"
  await scratch.tcp.query(`CREATE OR REPLACE FUNCTION ${scratch.name}_tz() RETURNS void LANGUAGE sql AS $$ SELECT set_config('DateStyle', 'SQL, DMY', false) $$`)
  const sessions = await Promise.all(Array.from({ length: 12 }, () => session(p.port)))
  const probe = await session(p.port)
  try {
    const fresh = (await probe.query(LOOK)).rows[0]
    await Promise.all(sessions.map(async (c, i) => {
      await c.query(`SET application_name = 'app ${i}'`)
      await c.query(`SET search_path = "schema ${i}", public`)
      await c.query(`SELECT set_config('statement_timeout', '${1000 + i}', false)`)
      if (i % 2) await c.query(`SELECT ${scratch.name}_tz()`) // (made by the database's code)
      if (i % 3 === 0) await c.query('SET ROLE trust_user')
      // (Two in one query string with another statement: each made again alone.)
      await c.query(`SELECT 1; PREPARE plus_${i} (int) AS SELECT $1 + ${i} AS v; PREPARE "Named ${i}" AS SELECT 'é ${i}' AS v`)
    }))
    await sessions[0].query('RESET statement_timeout')
    await sessions[1].query('DEALLOCATE "Named 1"')
    for (let round = 0; round < 100; round++) {
      await Promise.all(sessions.map(async (c, i) => {
        const seen = (await c.query(LOOK)).rows[0]
        const prepared = i === 1 ? `plus_${i}` : `Named ${i},plus_${i}`
        const want = { app: `app ${i}`, path: `"schema ${i}", public`, st: i === 0 ? fresh.st : `${1000 + i}ms`, ds: i % 2 ? 'SQL, DMY' : fresh.ds, who: i % 3 === 0 ? 'trust_user' : 'scram_user', prepared }
        assert.deepEqual(seen, want, `session ${i}, round ${round}`)
        assert.deepEqual((await c.query(`EXECUTE plus_${i}(${round})`)).rows, [{ v: round + i }], `session ${i}, round ${round}`)
        if (i !== 1) assert.deepEqual((await c.query(`EXECUTE "Named ${i}"`)).rows, [{ v: `é ${i}` }])
      }))
      assert.deepEqual((await probe.query(LOOK)).rows[0], fresh, `round ${round}: another session sees none of them`)
    }
    assert.equal(await pinned(p), 0, 'no session is pinned')
    assert.ok((await metric(p, 'handovers_total')) > 12, 'the sessions shared the backends')
  } finally {
    await Promise.all([...sessions, probe].map((c) => c.end()))
    await p.close()
    await scratch.tcp.query(`DROP FUNCTION ${scratch.name}_tz()`)
  }
})

test("a session's role Postgres will no longer set (its membership revoked): what it sends behind is never run, on any backend; the session is closed with 55000, saying why", async () => {
  const [login, role] = [`txpool_carrier_${process.pid}`, `txpool_carried_${process.pid}`]
  await scratch.tcp.query(`CREATE ROLE ${login} LOGIN PASSWORD '${PASSWORD}'; CREATE ROLE ${role}; GRANT ${role} TO ${login}; GRANT INSERT ON ${scratch.name} TO ${role}`)
  const p = await txProxy(1, 3000)
  const as = async () => {
    const c = new Client({ ...edgeConfig(p.port, 'scram_user', { application_name: APP }), user: login, password: PASSWORD })
    c.on('error', () => {})
    await c.connect()
    return c
  }
  const [a, b] = [await as(), await as()]
  try {
    await a.query(`SET ROLE ${role}`)
    await a.query(`INSERT INTO ${scratch.name} VALUES ('carried, as ' || current_user)`)
    await b.query('SELECT 1') // (the backend changes hands: a's role is set again for its next statement)
    await scratch.tcp.query(`REVOKE ${role} FROM ${login}`)
    await b.query('SELECT 1')
    const err = await a.query(`INSERT INTO ${scratch.name} VALUES ('never')`).then(() => assert.fail('its role could not be set'), (e) => e)
    assert.equal(err.code, '55000')
    assert.match(err.message, /session's settings and prepared statements \(role\) could not be made again on another backend/)
    const rows = (await scratch.tcp.query(`SELECT name FROM ${scratch.name} WHERE name LIKE 'carried%' OR name = 'never'`)).rows
    assert.deepEqual(rows, [{ name: `carried, as ${role}` }], 'the statement behind the refused role ran nowhere')
    assert.equal((await b.query('SELECT current_user::text AS who')).rows[0].who, login, 'the other session goes on')
  } finally {
    await Promise.all([a.end().catch(() => {}), b.end()])
    await p.close()
    await scratch.tcp.query(`DELETE FROM ${scratch.name} WHERE name LIKE 'carried%'; REVOKE ALL ON ${scratch.name} FROM ${role}`)
    await eventually(async () => (await scratch.tcp.query(`DROP ROLE IF EXISTS ${role}; DROP ROLE IF EXISTS ${login}`).then(() => true, () => false)), 'the roles dropped')
  }
})

test('SET TRANSACTION does not pin: Postgres marks its settings as the session\'s, yet every transaction starts them afresh', async () => {
  const p = await txProxy(2)
  const c = await session(p.port)
  try {
    await c.query('BEGIN')
    await c.query('SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY DEFERRABLE')
    await c.query('COMMIT')
    assert.equal((await c.query('SHOW transaction_isolation')).rows[0].transaction_isolation, 'read committed')
    assert.equal(await pinned(p), 0, 'the session is not pinned')
    assert.ok((await metric(p, 'verifications_total')) >= 1, 'the transaction was verified')
  } finally {
    await c.end()
    await p.close()
  }
})

test("a session that ends while the proxy asks the database on its backend: the next session's answers are its own", async () => {
  const { default: QueryStream } = await import('pg-query-stream')
  const p = await txProxy(1, 3000)
  try {
    const ddl = await session(p.port)
    await ddl.query(`CREATE TABLE IF NOT EXISTS ${scratch.name}_asked (x int)`) // pins ddl's backend until it ends
    await ddl.end()
    // Its transaction read after DDL: the proxy asks the database on its backend, and it ends meanwhile.
    const reader = await session(p.port)
    await reader.query(`INSERT INTO ${scratch.name} VALUES ('asked')`)
    await reader.end()
    const next = await session(p.port)
    try {
      const rows: unknown[] = []
      for await (const row of next.query(new QueryStream('SELECT n FROM generate_series(1, 3) n'))) rows.push(row)
      assert.deepEqual(rows, [{ n: 1 }, { n: 2 }, { n: 3 }])
      assert.deepEqual((await next.query('SELECT 4 AS n')).rows, [{ n: 4 }])
    } finally {
      await next.end()
    }
  } finally {
    await p.close()
    await scratch.tcp.query(`DROP TABLE IF EXISTS ${scratch.name}_asked`)
  }
})

test('a clean transaction gives its backend back: another session runs on it at once', async () => {
  const p = await txProxy(1)
  const [a, b] = [await session(p.port), await session(p.port)]
  try {
    await a.query("SELECT set_config('statement_timeout', '777', true), lower('X')") // (transaction-local)
    await a.query(`INSERT INTO ${scratch.name} VALUES ('clean')`)
    assert.equal((await b.query("SELECT current_setting('statement_timeout') AS v")).rows[0].v, '0', 'b runs, and sees nothing of a')
  } finally {
    await Promise.all([a.end(), b.end()])
    await p.close()
  }
})

test("currval() is not kept past the transaction that called nextval(): the next session on its backend never sees it", async () => {
  await scratch.tcp.query('CREATE SEQUENCE IF NOT EXISTS txpool_seq')
  const p = await txProxy(1)
  const [a, b] = [await session(p.port), await session(p.port)]
  try {
    const { v } = (await a.query("SELECT nextval('txpool_seq') AS v")).rows[0]
    assert.ok(Number(v) > 0)
    const err = await b.query("SELECT currval('txpool_seq')").then(() => assert.fail("a's currval leaked"), (e) => e)
    assert.equal(err.code, '55000', err.message)
    assert.equal((await b.query('SELECT 1 AS one')).rows[0].one, 1)
  } finally {
    await Promise.all([a.end(), b.end()])
    await p.close()
    await scratch.tcp.query('DROP SEQUENCE IF EXISTS txpool_seq')
  }
})

test('named prepared statements follow a session to another backend', async () => {
  const p = await txProxy(2, 3000)
  const [a, b, c] = [await session(p.port), await session(p.port), await session(p.port)]
  try {
    const named = { name: 'by-name', text: "SELECT pg_backend_pid() AS pid, 'x' || $1::text AS v", values: ['1'] }
    const first = (await a.query(named)).rows[0] // then a's backend stays with it, parked
    await b.query('BEGIN') // a second backend
    await c.query('BEGIN') // a's, taken back for c: the pool is full
    const again = a.query({ ...named, values: ['2'] }) // waits for one
    await b.query('COMMIT') // b's backend goes to a
    const second = (await within(3000, 'a to run', again)).rows[0]
    assert.notEqual(second.pid, first.pid, 'a ran on the other backend')
    assert.equal(second.v, 'x2')
    assert.equal(await metric(p, 'statements_prepared_again_total'), 1)
    assert.equal(await metric(p, 'lent_backends'), 2, "c's, and the one a keeps parked")
    await c.query('COMMIT')
    await assert.rejects(a.query({ name: 'by-name', text: 'SELECT 2' }), /.*/, 'pg refuses a name reused for other text itself')
  } finally {
    await Promise.all([a.end(), b.end(), c.end()])
    await p.close()
  }
})

test("a backend reset after a session that kept state there forgets its named statements: another session's is prepared again on it", async () => {
  const p = await txProxy(1)
  const a = await session(p.port)
  try {
    assert.deepEqual((await a.query({ name: 'kept_across', text: 'SELECT 1 AS x' })).rows, [{ x: 1 }])
    const b = await session(p.port)
    await b.query('CREATE TEMP TABLE txpool_reset_me (x int)') // pinned: its end resets the backend (DISCARD ALL)
    await b.end()
    assert.deepEqual((await within(3000, 'the named statement', a.query({ name: 'kept_across', text: 'SELECT 1 AS x' }))).rows, [{ x: 1 }])
  } finally {
    await a.end()
    await p.close()
  }
})

test("DDL that changes a named statement's result type gives Postgres's 0A000 on the backend it is prepared again on, as pg over TCP gets", async () => {
  const table = `${scratch.name}_shape`
  await scratch.tcp.query(`CREATE TABLE ${table} (x int); INSERT INTO ${table} VALUES (1)`)
  const p = await txProxy(2, 3000)
  const [a, c, d] = [await session(p.port), await session(p.port), await session(p.port)]
  const shape = { name: 'shape', text: `SELECT * FROM ${table}` }
  try {
    const pid = async (s: Client) => (await s.query('SELECT pg_backend_pid() AS pid')).rows[0].pid
    assert.deepEqual((await a.query(shape)).rows, [{ x: 1 }])
    const first = await pid(a) // a's statement is prepared here; the backend stays with a
    await c.query('BEGIN') // the second backend
    await d.query('BEGIN') // takes a's
    assert.equal(await pid(d), first)
    await c.query('COMMIT')
    await scratch.tcp.query(`ALTER TABLE ${table} ADD COLUMN y int`)
    const err = await a.query(shape).then(() => assert.fail('the result type changed'), (e) => e)
    assert.equal(err.code, '0A000')
    assert.equal(err.message, 'cached plan must not change result type')
    assert.notEqual(await pid(a), first, 'it ran on the other backend, where the proxy prepared it again')
    await d.query('COMMIT')
  } finally {
    await Promise.all([a.end(), c.end(), d.end()])
    await p.close()
    await scratch.tcp.query(`DROP TABLE ${table}`)
  }
})

test('a busy session keeps its backend between transactions while no other needs it', async () => {
  const p = await txProxy(2)
  const a = await session(p.port)
  try {
    const pids = new Set<number>()
    for (let i = 0; i < 20; i++) pids.add((await a.query('SELECT pg_backend_pid() AS pid')).rows[0].pid)
    assert.equal(pids.size, 1)
    assert.equal(await metric(p, 'lends_total'), 1, 'lent once')
  } finally {
    await a.end()
    await p.close()
  }
})

test('notifications reach a session that LISTENs while it runs nothing', async () => {
  const p = await txProxy(2)
  const a = await session(p.port)
  try {
    await a.query('LISTEN txpool_chan')
    const heard = new Promise<{ channel: string; payload?: string }>((resolve) => a.once('notification', resolve))
    await scratch.tcp.query("NOTIFY txpool_chan, 'hello'")
    assert.deepEqual(await within(3000, 'the notification', heard).then(({ channel, payload }) => ({ channel, payload })), { channel: 'txpool_chan', payload: 'hello' })
  } finally {
    await a.end()
    await p.close()
  }
})

test("pipelined queries from several sessions keep their order and their errors, each session its own", async () => {
  const p = await txProxy(2)
  const clients = await Promise.all(Array.from({ length: 4 }, () => session(p.port)))
  try {
    const results = await Promise.all(
      clients.map((c, i) =>
        Promise.all(
          Array.from({ length: 10 }, (_, j) =>
            (j === 5 ? c.query('SELECT 1/0') : c.query('SELECT $1::int * 100 + $2::int AS v', [i, j])).then(
              (r) => r.rows[0].v,
              (e) => e.code
            )
          )
        )
      )
    )
    results.forEach((r, i) => assert.deepEqual(r, Array.from({ length: 10 }, (_, j) => (j === 5 ? '22012' : i * 100 + j)), `session ${i}`))
  } finally {
    await Promise.all(clients.map((c) => c.end()))
    await p.close()
  }
})

test('a session that vanishes mid-transaction commits nothing; its backend is cleaned and lent again', async () => {
  const p = await txProxy(1, 3000)
  const [a, b] = [await session(p.port), await session(p.port)]
  try {
    await a.query('BEGIN')
    await a.query(`INSERT INTO ${scratch.name} VALUES ('never')`)
    ;((a as any).connection.stream.ws._socket as import('node:net').Socket).destroy()
    assert.equal((await within(3000, 'the backend, cleaned', b.query(`SELECT count(*)::int AS n FROM ${scratch.name} WHERE name = 'never'`))).rows[0].n, 0)
    assert.equal((await b.query('SELECT 1 AS one')).rows[0].one, 1)
  } finally {
    await b.end()
    await p.close()
  }
})

test('an exhausted pool: 53300 past --pool-timeout, naming the flags; the session goes on', async () => {
  const p = await txProxy(1, 300)
  const [a, b] = [await session(p.port), await session(p.port)]
  try {
    await a.query('BEGIN')
    const started = performance.now()
    const err = await b.query('SELECT 1').then(() => assert.fail('no backend to run on'), (e) => e)
    assert.equal(err.code, '53300')
    assert.match(err.message, /all 1 are busy \(raise --pool-size, or --pool-timeout\)/)
    assert.ok(performance.now() - started >= 250, 'after the timeout')
    assert.equal(await metric(p, 'lend_timeouts_total'), 1)
    assert.ok((await metric(p, 'lends_total')) >= 1)
    const key = { user: 'scram_user', database: PG.database }
    assert.deepEqual([await metric(p, 'key_backends', { ...key, state: 'lent' }), await metric(p, 'key_backends', { ...key, state: 'idle' })], [1, 0], 'the key’s one backend, lent')
    await a.query('COMMIT')
    assert.equal((await b.query('SELECT 1 AS one')).rows[0].one, 1, 'the session goes on')
  } finally {
    await Promise.all([a.end(), b.end()])
    await p.close()
  }
})

test("a login Postgres refuses (the role's connection limit): the session gets Postgres's own error, not a wait for the pool", async () => {
  const role = `txpool_limited_${process.pid}`
  await scratch.tcp.query(`CREATE ROLE ${role} LOGIN PASSWORD '${PASSWORD}' CONNECTION LIMIT 1`)
  const p = await txProxy(2, 3000)
  const as = async () => {
    const c = new Client({ ...edgeConfig(p.port, 'scram_user', { application_name: APP }), user: role, password: PASSWORD })
    await c.connect()
    return c
  }
  const [a, b] = [await as(), await as()]
  try {
    await a.query('BEGIN') // the role's one connection
    const err = await b.query('SELECT 1').then(() => assert.fail('over the limit'), (e) => e)
    assert.equal(err.code, '53300')
    assert.match(err.message, /too many connections for role/)
    await a.query('COMMIT')
    assert.equal((await b.query('SELECT 1 AS one')).rows[0].one, 1, 'the session goes on')
  } finally {
    await Promise.all([a.end(), b.end()])
    await p.close()
    await eventually(async () => (await scratch.tcp.query(`DROP ROLE ${role}`).then(() => true, () => false)), 'the role dropped')
  }
})

test("a backend Postgres terminates while lent: its FATAL reaches the session, which then ends as a TCP connection would; the others go on", async () => {
  const p = await txProxy(2, 3000)
  const [a, b] = [await session(p.port), await session(p.port)]
  try {
    const errored = new Promise<Error>((resolve) => a.once('error', resolve))
    const running = a.query('SELECT pg_sleep(30)').then(() => assert.fail('terminated'), (e) => e)
    const queued = a.query('SELECT 1').then(() => assert.fail('terminated'), (e) => e)
    await sleeping()
    await scratch.tcp.query("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1 AND query LIKE 'SELECT pg_sleep%'", [APP])
    assert.equal((await within(5000, 'the statement to fail', running)).code, '57P01', "Postgres's own word for it")
    assert.equal((await within(5000, 'the queued statement to fail', queued)).message, 'Connection terminated unexpectedly')
    assert.equal((await within(5000, "the client's error event", errored)).message, 'Connection terminated unexpectedly')
    assert.equal((await b.query('SELECT 1 AS one')).rows[0].one, 1, 'another session goes on')
  } finally {
    await Promise.all([a.end().catch(() => {}), b.end()])
    await p.close()
  }
})

test("a backend Postgres terminates while parked with its session is never lent to another, though its connection closes late", async () => {
  // A relay that passes Postgres's closing on half a second late, as a loaded machine may: the
  // FATAL is in long before the close.
  const late = net.createServer((client) => {
    const upstream = net.connect(PG.port, PG.host)
    client.on('data', (d) => upstream.writable && upstream.write(d))
    upstream.on('data', (d) => client.write(d))
    upstream.on('close', () => setTimeout(() => client.destroy(), 500))
    client.on('close', () => upstream.destroy())
    client.on('error', () => {})
    upstream.on('error', () => {})
  })
  await new Promise<void>((resolve) => late.listen(0, '127.0.0.1', resolve))
  const p = await startProxy({ upstream: `127.0.0.1:${(late.address() as net.AddressInfo).port}`, pool: { mode: 'transaction', size: 1, timeoutMs: 3000 } })
  const [a, b] = [await session(p.port), await session(p.port)]
  try {
    const pid = (await a.query('SELECT pg_backend_pid() AS pid')).rows[0].pid // (its backend now parked with it)
    const errored = new Promise<Error>((resolve) => a.once('error', resolve))
    await scratch.tcp.query('SELECT pg_terminate_backend($1)', [pid])
    assert.match((await within(5000, "a's FATAL", errored)).message, /terminating connection due to administrator command/)
    const { rows } = await within(5000, "b's query", b.query('SELECT pg_backend_pid() AS pid'))
    assert.notEqual(rows[0].pid, pid, 'b runs on a new backend')
  } finally {
    await Promise.all([a.end().catch(() => {}), b.end()])
    await p.close()
    late.close()
  }
})

test('a backend lost without a word while lent (the network): what ran there fails with 08006, and the session goes on, on another', async () => {
  const relay = await startDelayRelay({ host: PG.host, port: PG.port }, 0)
  const p = await startProxy({ upstream: `127.0.0.1:${relay.port}`, pool: { mode: 'transaction', size: 2, timeoutMs: 3000 } })
  const a = await session(p.port)
  try {
    const running = a.query('SELECT pg_sleep(2)').then(() => assert.fail('lost'), (e) => e)
    await sleeping()
    relay.cut()
    const err = await within(5000, 'the statement to fail', running)
    assert.equal(err.code, '08006')
    assert.match(err.message, /connection to Postgres was lost while this ran; nothing of its transaction was kept/)
    assert.equal((await within(5000, 'the next statement', a.query('SELECT 1 AS one'))).rows[0].one, 1, 'the session goes on')
  } finally {
    await a.end()
    await p.close()
    await relay.close()
    // Postgres still runs the statement whose connection was cut: not to be taken for a later test's.
    await scratch.tcp.query("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1 AND query LIKE 'SELECT pg_sleep%'", [APP])
  }
})

test("a cancel reaches the backend running the session's statement", async () => {
  const p = await txProxy(2)
  const a = await session(p.port)
  try {
    const running = a.query('SELECT pg_sleep(30)').then(() => assert.fail('cancelled'), (e) => e)
    await sleeping()
    await (a as any).cancelRunning()
    assert.equal((await within(5000, 'the cancel', running)).code, '57014')
  } finally {
    await a.end()
    await p.close()
  }
})

// ── POST /sql: each request is one lend ─────────────────────────────────────────────────────

/** A transaction-mode proxy whose /sql logs in with this file's application_name. */
const sqlProxy = (size: number, timeoutMs = 3000) => startProxy({ pool: { mode: 'transaction', size, timeoutMs }, sql: { applicationName: APP } })

/** One POST /sql: a query, or a batch (several). */
async function post(p: { port: number }, ...queries: string[]): Promise<{ status: number; json: any }> {
  const body = queries.length === 1 ? { query: queries[0], params: [] } : { queries: queries.map((query) => ({ query, params: [] })) }
  const res = await fetch(`http://127.0.0.1:${p.port}/sql`, {
    method: 'POST',
    headers: { 'Neon-Connection-String': `postgresql://scram_user:${encodeURIComponent(PASSWORD)}@${PG.host}:${PG.port}/${PG.database}` },
    body: JSON.stringify(body),
  })
  return { status: res.status, json: await res.json() }
}
const rowsOf = (r: { json: any }) => r.json.rows ?? r.json.results?.at(-1)?.rows

test('/sql borrows from the pool: at most --pool-size backends, each reset ahead of a request when it changed hands, whatever the SQL reads like', async () => {
  const p = await sqlProxy(2)
  const handovers = () => metric(p, 'handovers_total', { outcome: 'reset' })
  try {
    assert.equal((await post(p, 'SELECT 1 AS one')).status, 200)
    const [resets, before] = [await metric(p, 'pool_resets_total'), await handovers()]
    await Promise.all(Array.from({ length: 6 }, () => post(p, "SELECT 'x' AS x, 2 AS two")))
    const answers = await Promise.all(Array.from({ length: 12 }, (_, i) =>
      i % 3 ? post(p, `SELECT pg_backend_pid() AS pid, pg_sleep(0.05)`) : post(p, `INSERT INTO ${scratch.name} VALUES ('sql${i}')`, 'SELECT pg_backend_pid() AS pid')
    ))
    assert.deepEqual(answers.map((a) => a.status), Array(12).fill(200), JSON.stringify(answers.find((a) => a.status !== 200)?.json))
    assert.ok(new Set(answers.map((a) => rowsOf(a)[0].pid)).size <= 2, 'on two backends at most')
    assert.ok((await backendsHeld()) <= 2)
    assert.ok((await metric(p, 'lends_total')) >= 19)
    // Every request is another user: each backend a request found used (all but one the pool may have opened) was reset ahead of it.
    assert.ok((await handovers()) - before >= 17, `${(await handovers()) - before} handovers for 18 requests`)
    assert.equal(await metric(p, 'pool_resets_total'), resets, 'nothing reset behind a request, as a backend goes on to its next')
  } finally {
    await p.close()
  }
})

test('/sql: a request that may leave state behind is reset (or its backend closed), and the next request sees none of it', async () => {
  const p = await sqlProxy(1)
  const look = "SELECT current_setting('statement_timeout') AS st, current_setting('app.sql_x', true) AS x, to_regclass('pg_temp.sql_left')::text AS t, to_regclass('pg_temp.sql_into')::text AS i, (SELECT count(*)::int FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()) AS locks"
  try {
    const fresh = rowsOf(await post(p, look))[0]
    const resets = await metric(p, 'pool_resets_total')
    for (const leaves of ['SET statement_timeout = 4321', "SELECT set_config('app.sql_x', 'leak', false)", 'CREATE TEMP TABLE sql_left (x int)', 'SELECT pg_advisory_lock(4545)', 'SELECT 1 AS x INTO TEMP sql_into', 'SELECT 1 AS x -- a comment\r, pg_advisory_lock(4546) AS y']) {
      assert.equal((await post(p, leaves)).status, 200, leaves)
      assert.deepEqual(rowsOf(await post(p, look))[0], fresh, `after ${leaves}`)
    }
    // random()'s seed, which DISCARD ALL keeps: the next request draws from a fresh one.
    const seeded = rowsOf(await post(p, 'SELECT setseed(0.42)', 'SELECT random() AS r'))[0].r
    assert.equal(rowsOf(await post(p, 'SELECT setseed(0.42)', 'SELECT random() AS r'))[0].r, seeded, 'within a request, its own seed')
    assert.equal((await post(p, 'SELECT setseed(0.42)')).status, 200)
    assert.notEqual(rowsOf(await post(p, 'SELECT random() AS r'))[0].r, seeded, 'the next request draws from another seed')
    assert.equal((await post(p, 'BEGIN')).status, 200)
    assert.deepEqual(rowsOf(await post(p, "SELECT pg_current_xact_id_if_assigned() IS NULL AS none")), [{ none: true }], 'a dangling BEGIN is rolled back')
    assert.ok((await metric(p, 'pool_resets_total')) >= resets + 1, 'the one left in a transaction was rolled back and reset')
  } finally {
    await p.close()
  }
})

test('/sql: where the database runs code of its own (a trigger), a request that reads is reset', async () => {
  const table = `${scratch.name}_trig`
  await scratch.tcp.query(`CREATE TABLE ${table} (x int)`)
  await scratch.tcp.query(`CREATE FUNCTION ${table}_f() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN PERFORM set_config('statement_timeout', '4321', false); RETURN NEW; END $$`)
  await scratch.tcp.query(`CREATE TRIGGER t BEFORE INSERT ON ${table} FOR EACH ROW EXECUTE FUNCTION ${table}_f()`)
  const p = await sqlProxy(1)
  try {
    const fresh = rowsOf(await post(p, "SELECT current_setting('statement_timeout') AS st"))[0]
    assert.equal((await post(p, `INSERT INTO ${table} VALUES (1)`)).status, 200)
    assert.deepEqual(rowsOf(await post(p, "SELECT current_setting('statement_timeout') AS st"))[0], fresh)
  } finally {
    await p.close()
    await scratch.tcp.query(`DROP TABLE ${table}; DROP FUNCTION ${table}_f()`)
  }
})

test('/sql: a row-level security policy that sets something counts as code the database runs: a request that reads is reset', async () => {
  const table = `${scratch.name}_rls`
  await scratch.tcp.query(`CREATE TABLE ${table} (x int); INSERT INTO ${table} VALUES (1)`)
  await scratch.tcp.query(`ALTER TABLE ${table} ENABLE ROW LEVEL SECURITY, FORCE ROW LEVEL SECURITY`)
  await scratch.tcp.query(`CREATE POLICY p ON ${table} USING (set_config('statement_timeout', '4321', false) IS NOT NULL)`)
  const p = await sqlProxy(1)
  try {
    const fresh = rowsOf(await post(p, "SELECT current_setting('statement_timeout') AS st"))[0]
    assert.equal((await post(p, `SELECT x FROM ${table}`)).status, 200)
    assert.deepEqual(rowsOf(await post(p, "SELECT current_setting('statement_timeout') AS st"))[0], fresh)
  } finally {
    await p.close()
    await scratch.tcp.query(`DROP TABLE ${table}`)
  }
})

test('/sql: an exhausted pool answers 503 with SQLSTATE 53300 past --pool-timeout, naming the flags', async () => {
  const p = await sqlProxy(1, 300)
  try {
    const long = post(p, 'SELECT pg_sleep(1.5)')
    await sleeping()
    const { status, json } = await post(p, 'SELECT 1')
    assert.equal(status, 503)
    assert.equal(json.code, '53300')
    assert.match(json.message, /all 1 are busy \(raise --pool-size, or --pool-timeout\)/)
    assert.equal((await long).status, 200)
    assert.equal((await post(p, 'SELECT 1 AS one')).status, 200, 'served once the backend is back')
  } finally {
    await p.close()
  }
})

test('/sql and WebSocket sessions waiting for a backend leave the line when their client goes away', async () => {
  const p = await startProxy({ pool: { mode: 'transaction', size: 1, timeoutMs: 400 } })
  const holder = edgeClient(p.port, 'scram_user')
  await holder.connect()
  try {
    await holder.query('BEGIN') // the key's one backend
    const request = new AbortController()
    const posted = fetch(`http://127.0.0.1:${p.port}/sql`, {
      method: 'POST',
      headers: { 'Neon-Connection-String': `postgresql://scram_user:${encodeURIComponent(PASSWORD)}@${PG.host}:${PG.port}/${PG.database}` },
      body: JSON.stringify({ query: 'SELECT 1', params: [] }),
      signal: request.signal,
    }).catch((e) => e)
    const waiter = edgeClient(p.port, 'scram_user')
    waiter.on('error', () => {})
    await waiter.connect()
    const waited = waiter.query('SELECT 1').catch((e) => e)
    await eventually(async () => (await metric(p, 'lend_waiting')) === 2, 'both to wait in line')
    request.abort()
    ;((waiter as any).connection.stream.ws._socket as import('node:net').Socket).destroy()
    await posted
    await waited
    await new Promise((r) => setTimeout(r, 600)) // past --pool-timeout: a waiter still in line would time out now
    assert.equal(await metric(p, 'lend_timeouts_total'), 0, 'neither waited out its time')
    assert.equal(await metric(p, 'lend_waiting'), 0)
    await holder.query('COMMIT')
  } finally {
    await holder.end()
    await p.close()
  }
})

test('/sql: a login Postgres refuses for a key it served (the role\'s connection limit) is a 503 with its SQLSTATE', async () => {
  const role = `txpool_sqllimit_${process.pid}`
  await scratch.tcp.query(`CREATE ROLE ${role} LOGIN PASSWORD '${PASSWORD}' CONNECTION LIMIT 1`)
  const p = await sqlProxy(2)
  const as = (query: string) =>
    fetch(`http://127.0.0.1:${p.port}/sql`, {
      method: 'POST',
      headers: { 'Neon-Connection-String': `postgresql://${role}:${encodeURIComponent(PASSWORD)}@${PG.host}:${PG.port}/${PG.database}` },
      body: JSON.stringify({ query, params: [] }),
    }).then(async (r) => ({ status: r.status, json: await r.json() }))
  try {
    const long = as('SELECT pg_sleep(0.5)') // the role's one connection
    await eventually(async () => (await scratch.tcp.query('SELECT count(*)::int AS n FROM pg_stat_activity WHERE usename = $1', [role])).rows[0].n === 1, 'the first request to run')
    const { status, json } = await as('SELECT 1')
    assert.deepEqual([status, json.code], [503, '53300'])
    assert.match(json.message, /too many connections for role/)
    assert.equal((await long).status, 200)
  } finally {
    await p.close()
    await eventually(async () => (await scratch.tcp.query(`DROP ROLE ${role}`).then(() => true, () => false)), 'the role dropped')
  }
})

test('/sql and WebSocket sessions share one lender per user, database and password', async () => {
  const p = await startProxy({ pool: { mode: 'transaction', size: 1, timeoutMs: 300 } })
  const client = edgeClient(p.port, 'scram_user')
  await client.connect()
  try {
    await client.query('BEGIN')
    const { status, json } = await post(p, 'SELECT 1')
    assert.deepEqual([status, json.code], [503, '53300'], 'the one backend is the session’s, in its transaction')
    await client.query('COMMIT')
    const [viaSql, viaWs] = [rowsOf(await post(p, 'SELECT pg_backend_pid() AS pid'))[0].pid, (await client.query('SELECT pg_backend_pid() AS pid')).rows[0].pid]
    assert.equal(viaSql, viaWs)
  } finally {
    await client.end()
    await p.close()
  }
})

/**
 * The proxy's POST /sql endpoint (proxy/sql/handler.ts), which speaks Neon's SQL-over-HTTP protocol: driven
 * by the real `neon()` from @neondatabase/serverless (pointed at it with neonConfig.fetchEndpoint)
 * and by raw fetch/http requests for what neon() never sends. The handler is mounted on a plain
 * HTTP server of this file's own (one per configuration), as the lead wires it into createProxy.
 *
 * Results and errors are compared with pg over TCP against the same database; the shared corpus
 * (test/support/corpus.ts) runs through neon() too, with the differences that come from neon() itself (its
 * own type parsing, one statement per query) named and asserted.
 */
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import http from 'node:http'
import type { AddressInfo } from 'node:net'
import os from 'node:os'
import pg from 'pg'
import { neon, neonConfig, NeonDbError, Pool as NeonPool, type HTTPTransactionOptions } from '@neondatabase/serverless'
import { sqlHandler, ERROR_FIELDS, SQL_REQUEST_HEADERS, type SqlHandler, type SqlOptions, type SqlLog } from '../proxy/sql/handler'
import { formatHostPort } from '../proxy/upstream/address'
import { BackendPool } from '../proxy/pool/backends'
import { PASSWORD, freePort, startPostgres, tlsOnly } from './support/stack'
import { generateCerts } from './support/certs'
import { pgbouncerBinary, startPgBouncer } from './support/pgbouncer'
import { pgConfig, testPostgres, eventually, same, startProxy, tryUpgrade } from './support/helpers'
import { buildCorpus, setupSql, teardownSql, uniqueSchema, type CorpusEntry } from './support/corpus'

const PG = testPostgres()
const UPSTREAM = { host: PG.host, port: PG.port }
const schema = uniqueSchema('edgepg_sql')
const corpus = buildCorpus(schema)

/** A connection string for the test Postgres. */
const conn = (user = 'scram_user', password = PASSWORD, host = `${PG.host}:${PG.port}`, database = PG.database) =>
  `postgresql://${user}:${encodeURIComponent(password)}@${host}/${database}`
const CONN = conn()

let admin: pg.Client
let tcp: pg.Client
let main: Mounted
const mounted: Mounted[] = []

interface Mounted {
  url: string
  handler: SqlHandler
  /** The handler's pool of backends. */
  pool: BackendPool
  logs: SqlLog[]
  app: string
  close(): Promise<void>
}

let serial = 0
/** A plain HTTP server with the /sql handler (and 404 elsewhere), with its own application_name. */
async function mount(options: Partial<SqlOptions> = {}, host = '127.0.0.1'): Promise<Mounted> {
  const app = `edgepg-sql-${process.pid}-${++serial}`
  const logs: SqlLog[] = []
  const pool = options.backends instanceof BackendPool ? options.backends : new BackendPool(options.backends)
  const handler = sqlHandler({ upstream: UPSTREAM, applicationName: app, log: (e) => logs.push(e), ...options, backends: pool })
  const server = http.createServer((req, res) => {
    if (new URL(req.url ?? '/', 'http://x').pathname === '/sql') return handler.handle(req, res)
    res.writeHead(404).end()
  })
  await new Promise<void>((resolve) => server.listen(0, host, resolve))
  const { port } = server.address() as AddressInfo
  const m: Mounted = {
    url: `http://${host}:${port}/sql`,
    handler,
    pool,
    logs,
    app,
    async close() {
      mounted.splice(mounted.indexOf(m), 1)
      await handler.close()
      pool.close()
      server.closeAllConnections()
      await new Promise<void>((resolve) => server.close(() => resolve()))
    },
  }
  mounted.push(m)
  return m
}

/** neon() against a mounted handler (neonConfig.fetchEndpoint is global: set on each use). */
function sqlAt(m: Mounted, connectionString = CONN, options: HTTPTransactionOptions<boolean, boolean> = {}) {
  neonConfig.fetchEndpoint = m.url
  return neon(connectionString, options as HTTPTransactionOptions<false, false>)
}

/** Sends a neon() query now (its promise is lazy: nothing is sent until someone awaits it). */
const start = <T>(query: PromiseLike<T>): Promise<T> => Promise.resolve(query)

/** Awaits a promise that must reject, and returns what it rejected with. */
async function rejection(promise: PromiseLike<unknown>, what: string): Promise<any> {
  try {
    await promise
  } catch (err) {
    return err
  }
  assert.fail(`${what}: expected an error, got a result`)
}

/** A raw POST to /sql: status, headers and parsed (or text) body. */
async function post(m: Mounted, body: unknown, headers: Record<string, string> = {}) {
  const res = await fetch(m.url, {
    method: 'POST',
    headers: { 'Neon-Connection-String': CONN, ...headers },
    body: typeof body === 'string' ? body : JSON.stringify(body),
  })
  const text = await res.text()
  let json: any
  try {
    json = JSON.parse(text)
  } catch {}
  return { status: res.status, headers: res.headers, text, json }
}

/** Backends of one mounted handler (by its application_name), optionally only those running `like`. */
async function backendsOf(m: Mounted, like?: string): Promise<number> {
  const { rows } = await admin.query(
    `SELECT count(*)::int AS n FROM pg_stat_activity WHERE application_name = $1 AND ($2::text IS NULL OR (query LIKE $2 AND state = 'active'))`,
    [m.app, like ?? null]
  )
  return rows[0].n
}

/** An error's message and every field Neon's protocol carries (absent: undefined). */
function errorFields(e: any) {
  const out: Record<string, unknown> = { message: e?.message }
  for (const f of ERROR_FIELDS) out[f] = e?.[f] ?? undefined
  return out
}

before(async () => {
  admin = new pg.Client(pgConfig('trust_user'))
  tcp = new pg.Client(pgConfig())
  await Promise.all([admin.connect(), tcp.connect()])
  await admin.query(setupSql(schema))
  main = await mount()
})

after(async () => {
  for (const m of [...mounted]) await m.close().catch(() => {})
  if (admin) {
    await admin.query(teardownSql(schema)).catch(() => {})
    await admin.end().catch(() => {})
  }
  await tcp?.end().catch(() => {})
})

// ── neon(): queries ─────────────────────────────────────────────────────────────────────────

test('neon(): tagged templates with parameters, sql.query, arrayMode and fullResults', async () => {
  const sql = sqlAt(main)
  const rows = await sql`SELECT ${42}::int AS n, ${'it\'s "ü" ✓'}::text AS t, ${null}::int AS nothing, ${true}::bool AS b`
  same(rows, [{ n: 42, t: 'it\'s "ü" ✓', nothing: null, b: true }], 'tagged template')

  same(await sql.query('SELECT $1::int + $2::int AS sum', [2, 3]), [{ sum: 5 }], 'sql.query')
  same(await sql.query('SELECT 1 AS x, 2 AS x, $1::text AS y', ['why'], { arrayMode: true }), [[1, 2, 'why']], 'arrayMode keeps duplicate columns')
  same(await sql.query('SELECT 1 AS x, 2 AS x'), [{ x: 2 }], 'object mode: the later duplicate wins, as with pg')

  const text = `SELECT id, name, qty, price FROM ${schema}.items WHERE id <= $1 ORDER BY id`
  const full: any = await sql.query(text, [2], { fullResults: true })
  const expected = await tcp.query(text, [2])
  assert.equal(full.command, 'SELECT')
  assert.equal(full.rowCount, 2)
  assert.equal(full.rowAsArray, false)
  same(full.rows, expected.rows, 'fullResults rows match pg over TCP')
  same(full.fields.map((f: object) => ({ ...f })), expected.fields.map((f) => ({ ...f })), 'fields (tableID, columnID, typmod, …) match pg over TCP')

  const arr: any = await sqlAt(main, CONN, { arrayMode: true, fullResults: true }).query(text, [1])
  assert.equal(arr.rowAsArray, true)
  same(arr.rows, [[1, 'widget', 5, '9.99']], 'arrayMode + fullResults')

  const insert: any = await sql.query(`INSERT INTO ${schema}.kv VALUES ('neon-1', 'a'), ('neon-2', 'b')`, [], { fullResults: true })
  assert.deepEqual([insert.command, insert.rowCount, insert.fields, insert.rows], ['INSERT', 2, [], []], 'INSERT: command and rowCount from the tag')
  const ddl: any = await sql.query(`CREATE TEMP TABLE scratch (a int)`, [], { fullResults: true })
  assert.deepEqual([ddl.command, ddl.rowCount], ['CREATE', null], 'a tag without a count: rowCount null')
  await admin.query(`DELETE FROM ${schema}.kv WHERE k LIKE 'neon-%'`)
})

test('neon(): sql.transaction runs in one transaction, with isolation level, read only and deferrable', async () => {
  const sql = sqlAt(main)
  const [a, b, c] = await sql.transaction(
    [
      sql`SELECT now()::text AS started, current_setting('transaction_isolation') AS iso`,
      sql`SELECT now()::text AS started, current_setting('transaction_read_only') AS ro, current_setting('transaction_deferrable') AS d`,
      sql`SELECT pg_sleep(0.01), now()::text AS started`,
    ],
    { isolationLevel: 'Serializable', readOnly: true, deferrable: true }
  )
  assert.equal((a as any)[0].iso, 'serializable')
  assert.equal((b as any)[0].ro, 'on')
  assert.equal((b as any)[0].d, 'on')
  assert.ok((a as any)[0].started === (b as any)[0].started && (b as any)[0].started === (c as any)[0].started, 'now() is the same in every statement: one transaction')

  for (const level of ['ReadUncommitted', 'ReadCommitted', 'RepeatableRead'] as const) {
    const [[row]] = (await sql.transaction([sql`SHOW transaction_isolation`], { isolationLevel: level })) as any
    assert.equal(row.transaction_isolation, level.replace(/([a-z])([A-Z])/, '$1 $2').toLowerCase(), `isolation ${level}`)
  }
  const [[rw]] = (await sql.transaction([sql`SHOW transaction_read_only`])) as any
  assert.equal(rw.transaction_read_only, 'off', 'read write by default')

  const ro = await rejection(sql.transaction([sql`INSERT INTO ${sql.unsafe(schema)}.kv VALUES ('ro', 'x')`], { readOnly: true }), 'write in a read-only batch')
  assert.ok(ro instanceof NeonDbError, `NeonDbError, got ${ro}`)
  assert.equal(ro.code, '25006', 'read_only_sql_transaction')

  // per-transaction options fullResults/arrayMode, and a function form
  const [full] = (await sql.transaction((q) => [q`SELECT 1 AS one`], { fullResults: true, arrayMode: true })) as any
  assert.deepEqual([full.rows, full.rowAsArray, full.command], [[[1]], true, 'SELECT'])
})

test("neon's Pool with poolQueryViaFetch: pool.query goes over /sql (its URL drops the port)", async () => {
  neonConfig.fetchEndpoint = main.url
  neonConfig.poolQueryViaFetch = true
  const pool = new NeonPool({ connectionString: CONN })
  try {
    const r = await pool.query('SELECT $1::int AS n, $2::text AS t', [5, 'five'])
    same(r.rows, [{ n: 5, t: 'five' }], 'rows')
    assert.equal(r.rowCount, 1)
    const arr = await pool.query({ text: 'SELECT 1 AS a, 2 AS b', rowMode: 'array' })
    same(arr.rows, [[1, 2]], "rowMode 'array'")
    const err = await rejection(pool.query('SELECT 1/0'), 'pool.query error')
    assert.equal(err.code, '22012')
  } finally {
    neonConfig.poolQueryViaFetch = false
    await pool.end()
  }
})

test('a batch whose statement fails in the middle commits nothing', async () => {
  const sql = sqlAt(main)
  const kv = sql.unsafe(`${schema}.kv`)
  const err = await rejection(
    sql.transaction([sql`INSERT INTO ${kv} VALUES ('batch-1', 'one')`, sql`SELECT 1 / ${0}::int AS boom`, sql`INSERT INTO ${kv} VALUES ('batch-2', 'two')`]),
    'batch with 1/0'
  )
  assert.equal(err.code, '22012', `division_by_zero, got ${err.message}`)
  const { rows } = await admin.query(`SELECT k FROM ${schema}.kv WHERE k LIKE 'batch-%'`)
  assert.deepEqual(rows, [], 'nothing of the failed batch was committed')

  // a constraint violation in the last statement rolls back the first too
  const dup = await rejection(sql.transaction([sql`INSERT INTO ${kv} VALUES ('batch-3', 'x')`, sql`INSERT INTO ${kv} VALUES ('a', 'dup')`]), 'batch with a duplicate key')
  assert.equal(dup.code, '23505')
  assert.equal((await admin.query(`SELECT k FROM ${schema}.kv WHERE k LIKE 'batch-%'`)).rowCount, 0, 'rolled back')

  // and a good batch commits everything
  await sql.transaction([sql`INSERT INTO ${kv} VALUES ('batch-4', 'x')`, sql`INSERT INTO ${kv} VALUES ('batch-5', 'y')`])
  assert.equal((await admin.query(`SELECT k FROM ${schema}.kv WHERE k LIKE 'batch-%'`)).rowCount, 2, 'committed')
  await admin.query(`DELETE FROM ${schema}.kv WHERE k LIKE 'batch-%'`)

  // a statement that ends the transaction itself is refused (what follows would run outside it)
  const ended = await post(main, { queries: [{ query: 'SELECT 1' }, { query: 'COMMIT' }, { query: `INSERT INTO ${schema}.kv VALUES ('batch-6', 'x')` }] })
  assert.equal(ended.status, 400, ended.text)
  assert.equal(ended.json.code, '25000')
  assert.match(ended.json.message, /statement 2 of the batch ended its transaction/)
  assert.equal((await admin.query(`SELECT k FROM ${schema}.kv WHERE k = 'batch-6'`)).rowCount, 0, 'the statement after COMMIT did not run')
})

// ── errors ──────────────────────────────────────────────────────────────────────────────────

test('errors: HTTP 400 with every DatabaseError field, equal to pg over TCP', async () => {
  const sql = sqlAt(main)
  const cases: Array<[string, unknown[]]> = [
    ['SELEC 1', []],
    [`SELECT nope FROM ${schema}.items`, []],
    [`SELECT ${schema}.nofn($1::int)`, [1]],
    [`INSERT INTO ${schema}.items (id, name, qty) VALUES (1, 'dup', 1)`, []],
    [`UPDATE ${schema}.items SET qty = -1 WHERE id = 1`, []],
    [`DELETE FROM ${schema}.items WHERE id = 1`, []],
    ['DO $$ BEGIN PERFORM 1/0; END $$', []],
    [`DO $$ BEGIN EXECUTE 'SELECT 1 FROM nowhere_' || 'x'; END $$`, []],
    [
      `DO $$ BEGIN RAISE EXCEPTION 'custom % ✗', 42 USING DETAIL = 'the detail', HINT = 'the hint', ERRCODE = 'P0042', COLUMN = 'col', CONSTRAINT = 'con', DATATYPE = 'typ', TABLE = 'tab', SCHEMA = 'sch'; END $$`,
      [],
    ],
    ['SELECT $1::int', ['abc']],
    // No data can follow over HTTP: refused with CopyFail, as pg refuses a COPY without a stream.
    [`COPY ${schema}.items FROM STDIN`, []],
  ]
  const seen = new Set<string>()
  for (const [text, values] of cases) {
    const expected = await rejection(tcp.query(text, values), `pg: ${text}`)
    assert.ok(expected instanceof pg.DatabaseError, `pg gave a DatabaseError for ${text}`)
    const got = await rejection(sql.query(text, values), `neon(): ${text}`)
    assert.ok(got instanceof NeonDbError, `neon() gave a NeonDbError for ${text}: ${got}`)
    same(errorFields(got), errorFields(expected), `error fields for ${text}`)
    for (const f of ERROR_FIELDS) if (got[f] !== undefined) seen.add(f)
  }
  same([...seen].sort(), [...ERROR_FIELDS].sort(), 'every field was exercised by some case')

  // on the wire: HTTP 400, every key present (null when absent)
  const raw = await post(main, { query: 'SELECT 1/0' })
  assert.equal(raw.status, 400)
  assert.equal(raw.headers.get('content-type'), 'application/json')
  same(Object.keys(raw.json), ['message', ...ERROR_FIELDS], 'error keys, in Neon order')
  assert.equal(raw.json.code, '22012')
  assert.equal(raw.json.hint, null)

  // the connection is fine afterwards
  same(await sql`SELECT 1 AS ok`, [{ ok: 1 }], 'usable after errors')
})

test('requests the proxy refuses: clear messages and statuses', async () => {
  const cases: Array<[string, () => ReturnType<typeof post>, number, RegExp]> = [
    ['bad JSON', () => post(main, '{"query": '), 400, /request body is not valid JSON/],
    ['no query', () => post(main, { params: [] }), 400, /must be JSON \{"query"/],
    ['query not a string', () => post(main, { query: 42 }), 400, /"query" must be a string/],
    ['params not an array', () => post(main, { query: 'SELECT 1', params: 'x' }), 400, /"params" must be an array/],
    ['batch item without query', () => post(main, { queries: [{ query: 'SELECT 1' }, {}] }), 400, /queries\[1\]: "query" must be a string/],
    ['no connection string', () => post(main, { query: 'SELECT 1' }, { 'Neon-Connection-String': '' }), 400, /missing Neon-Connection-String/],
    ['not a URL', () => post(main, { query: 'SELECT 1' }, { 'Neon-Connection-String': 'postgresql://[bad' }), 400, /not a valid URL/],
    ['wrong scheme', () => post(main, { query: 'SELECT 1' }, { 'Neon-Connection-String': 'mysql://u:p@h/db' }), 400, /must be a postgresql:\/\/ URL/],
    ['no user', () => post(main, { query: 'SELECT 1' }, { 'Neon-Connection-String': `postgresql://${PG.host}:${PG.port}/db` }), 400, /no user name/],
    ['bad isolation level', () => post(main, { queries: [] }, { 'Neon-Batch-Isolation-Level': 'Chaos' }), 400, /invalid isolation level "Chaos"/],
    ['host not allowed', () => post(main, { query: 'SELECT 1' }, { 'Neon-Connection-String': conn('scram_user', PASSWORD, '10.9.8.7:5432') }), 403, /host 10\.9\.8\.7:5432 is not an allowed upstream/],
    ['another port of the upstream host', () => post(main, { query: 'SELECT 1' }, { 'Neon-Connection-String': conn('scram_user', PASSWORD, `${PG.host}:1`) }), 403, /not an allowed upstream/],
    // (edgepg-proxy's own rule admits it: test/upstream-rule.test.ts)
    ['a name for the upstream, by the default isAllowed', () => post(main, { query: 'SELECT 1' }, { 'Neon-Connection-String': conn('scram_user', PASSWORD, `localhost:${PG.port}`) }), 403, /host localhost:\d+ is not an allowed upstream/],
  ]
  for (const [what, run, status, message] of cases) {
    const r = await run()
    assert.equal(r.status, status, `${what}: ${r.text}`)
    assert.match(r.json?.message ?? '', message, `${what}: message`)
    assert.ok(!r.text.includes(PASSWORD), `${what}: the password is never echoed`)
  }
  const get = await fetch(main.url)
  assert.equal(get.status, 405)
  assert.equal(get.headers.get('allow'), 'POST, OPTIONS')
  await get.text()

  // neon() reports non-400 statuses with the body
  const refused = await rejection(sqlAt(main, conn('scram_user', PASSWORD, '10.9.8.7:5432'))`SELECT 1`, 'neon() to a host not allowed')
  assert.match(refused.message, /HTTP status 403.*not an allowed upstream/)

  // the port may be left out when the host is the upstream's (neon()'s Pool-over-fetch drops it)
  same(await sqlAt(main, conn('scram_user', PASSWORD, PG.host))`SELECT 1 AS ok`, [{ ok: 1 }], 'upstream host without a port')
  // an operator's isAllowed may admit other names, and pick where they go
  const aliased = await mount({ isAllowed: (named) => (named.host === 'db.internal' ? UPSTREAM : formatHostPort(named) === formatHostPort(UPSTREAM)) })
  same(await sqlAt(aliased, conn('scram_user', PASSWORD, 'db.internal:5432'))`SELECT 2 AS ok`, [{ ok: 2 }], 'isAllowed returning a HostPort')
  await aliased.close()
})

// ── credentials and pooling ─────────────────────────────────────────────────────────────────

test('a wrong password gets 28P01 from Postgres, and is never served from a valid pool', async () => {
  const m = await mount()
  const good = sqlAt(m)
  same(await good`SELECT current_user AS u`, [{ u: 'scram_user' }], 'right password')
  for (const round of [1, 2]) {
    const err = await rejection(sqlAt(m, conn('scram_user', 'not-the-password'))`SELECT 1`, `wrong password, round ${round}`)
    assert.ok(err instanceof NeonDbError, `NeonDbError, got ${err}`)
    assert.equal(err.code, '28P01', `invalid_password, got ${err.code}: ${err.message}`)
    assert.match(err.message, /password authentication failed for user "scram_user"/)
    assert.equal(m.pool.size.pooled, 1, 'the refused login left nothing in the pool')
    same(await sqlAt(m)`SELECT 1 AS ok`, [{ ok: 1 }], 'right password still works')
  }
  for (const role of ['md5_user', 'password_user', 'trust_user'] as const) {
    same(await sqlAt(m, conn(role))`SELECT current_user AS u`, [{ u: role }], `auth method of ${role}`)
  }
  const nodb = await rejection(sqlAt(m, conn('scram_user', PASSWORD, `${PG.host}:${PG.port}`, 'no_such_db'))`SELECT 1`, 'no such database')
  assert.equal(nodb.code, '3D000')
  assert.equal(m.pool.size.pooled, 4, 'one backend per (user, database, password) that worked')
  assert.ok(!JSON.stringify(m.logs).includes(PASSWORD) && !JSON.stringify(m.logs).includes('not-the-password'), 'logs never hold a password')
  await m.close()
})

test('pool: at most max connections per key (the rest wait), idle ones closed after the idle timeout', async () => {
  const m = await mount({ pool: { max: 2 }, backends: { idleTimeoutMs: 300 } })
  const sql = sqlAt(m)
  const started = Date.now()
  let peak = 0
  let done = false
  const all = Promise.all([0, 1, 2].map((i) => sql`SELECT pg_sleep(0.4), ${i}::int AS i`)).finally(() => (done = true))
  while (!done) {
    peak = Math.max(peak, await backendsOf(m))
    await new Promise((r) => setTimeout(r, 20))
  }
  same((await all).map((rows: any) => rows[0].i), [0, 1, 2], 'all three answered')
  assert.equal(peak, 2, `peak backends ${peak}, want max 2`)
  assert.ok(Date.now() - started >= 750, 'the third waited for a free connection')
  assert.ok(m.handler.stats().connections <= 2, 'never more than max in the pool')
  await eventually(async () => (await backendsOf(m)) === 0, 'idle backends to exit', 3000)
  same(m.pool.size, { pooled: 0, idle: 0 }, 'the pool is empty')
  same(await sql`SELECT 1 AS again`, [{ again: 1 }], 'a new backend is made on demand')
  await m.close()
})

test('pool: a request aborted while waiting for a connection never runs, and costs no connection', async () => {
  const m = await mount({ pool: { max: 1 } })
  const sql = sqlAt(m)
  const [{ pid }] = (await sql`SELECT pg_backend_pid() AS pid`) as any
  const busy = start(sql`SELECT pg_sleep(0.4), pg_backend_pid() AS pid`)
  await eventually(async () => (await backendsOf(m, '%pg_sleep(0.4)%')) === 1, 'the first request to run')
  const ac = new AbortController()
  const queued = rejection(sql.query(`INSERT INTO ${schema}.kv VALUES ('queued', 'x')`, [], { fetchOptions: { signal: ac.signal } }), 'queued request')
  await eventually(() => m.handler.stats().waiting === 1, 'the second request to wait for the connection')
  ac.abort()
  await queued
  same(((await busy) as any)[0].pid, pid, 'the first ran on the pooled connection')
  same(await sql`SELECT pg_backend_pid() AS pid`, [{ pid }], 'the connection survived the abort')
  assert.equal((await admin.query(`SELECT 1 FROM ${schema}.kv WHERE k = 'queued'`)).rowCount, 0, 'the aborted request never ran')
  await m.close()
})

test('limits: the pool’s size (beyond it, connections of their own), maxRequests 503, connect timeout 503, unreachable upstream 502', async () => {
  const m = await mount({ pool: { max: 1, connectTimeoutMs: 250 }, backends: { maxBackends: 1 } })
  same(await sqlAt(m, conn('md5_user'))`SELECT current_user AS u`, [{ u: 'md5_user' }], 'first key')
  same(await sqlAt(m)`SELECT current_user AS u`, [{ u: 'scram_user' }], 'second key, beyond the pool')
  same(m.pool.size, { pooled: 1, idle: 1 }, 'the pool kept only the first')
  await eventually(async () => (await backendsOf(m)) === 1, 'the second key’s connection closed')
  // The only turn sleeps long enough for the check that needs it busy, even on a loaded machine.
  const sleeping = start(sqlAt(m)`SELECT pg_sleep(1.5)`)
  await eventually(async () => (await backendsOf(m, '%pg_sleep(1.5)%')) === 1, 'the sleep to run')
  same(await sqlAt(m, conn('md5_user'))`SELECT current_user AS u`, [{ u: 'md5_user' }], 'other credentials take their own turn')
  const waited = await rejection(sqlAt(m)`SELECT 1`, 'waiting longer than connectTimeoutMs')
  assert.match(waited.message, /HTTP status 503.*no connection to Postgres available in time/)
  const limited = await mount({ maxRequests: 1 })
  const inFlight = start(sqlAt(limited)`SELECT pg_sleep(0.3)`)
  await eventually(() => limited.handler.stats().requests === 1, 'one request in flight')
  const turnedAway = await rejection(sqlAt(limited)`SELECT 1`, 'a request over maxRequests')
  assert.match(turnedAway.message, /HTTP status 503.*too many requests in progress \(1\)/)
  await inFlight
  await limited.close()
  await sleeping
  await m.close()

  const closed = await new Promise<number>((resolve) => {
    const srv = http.createServer().listen(0, '127.0.0.1', () => {
      const { port } = srv.address() as AddressInfo
      srv.close(() => resolve(port))
    })
  })
  const nowhere = await mount({ isAllowed: () => ({ host: '127.0.0.1', port: closed }) })
  const unreachable = await rejection(sqlAt(nowhere)`SELECT 1`, 'upstream down')
  assert.match(unreachable.message, new RegExp(`HTTP status 502.*cannot connect to Postgres at 127\\.0\\.0\\.1:${closed}: ECONNREFUSED`))
  same(nowhere.pool.size, { pooled: 0, idle: 0 }, 'nothing kept from a failed connect')
  await nowhere.close()
})

test('one log entry per request: status, statements, bytes, outcome; no secrets', async () => {
  const m = await mount()
  const sql = sqlAt(m)
  await sql`SELECT ${'secret-param'}::text AS x`
  await rejection(sql`SELECT 1/0`, '1/0')
  await sql.transaction([sql`SELECT 1`, sql`SELECT 2`])
  await post(m, '{nope')
  await fetch(m.url, { method: 'OPTIONS' }).then((r) => r.text())
  await eventually(() => m.logs.length === 5, 'five log entries', 1000)
  same(m.logs.map((l) => [l.status, l.statements, l.outcome]), [
    [200, 1, 'ok'],
    [400, 1, 'postgres error 22012'],
    [200, 2, 'ok'],
    [400, 0, 'refused: request body is not valid JSON: ' + m.logs[3].outcome.split('JSON: ')[1]],
    [204, 0, 'preflight'],
  ], 'statuses, statement counts and outcomes')
  const [first] = m.logs
  assert.equal(first.upstream, `${PG.host}:${PG.port}`)
  assert.equal(first.peer, '127.0.0.1')
  assert.ok(first.bytesIn > 0 && first.bytesOut > 0 && first.durationMs >= 0, `sizes and duration: ${JSON.stringify(first)}`)
  const text = JSON.stringify(m.logs)
  assert.ok(!text.includes(PASSWORD) && !text.includes('secret-param') && !text.includes('1/0'), 'no password, parameter or query text in the log')
  await m.close()
})

test('connections go back reset: session state never leaks into the next request', async () => {
  const m = await mount({ pool: { max: 1 } })
  const sql = sqlAt(m)
  const [{ pid }] = (await sql`SELECT pg_backend_pid() AS pid`) as any
  await sql`SELECT set_config('search_path', 'nowhere', false)`
  await sql`CREATE TEMP TABLE leftover (a int)`
  await sql`SELECT pg_advisory_lock(4444)`
  const [after] = (await sql`SELECT pg_backend_pid() AS pid, current_setting('search_path') AS sp, to_regclass('pg_temp.leftover') AS t`) as any
  same(after, { pid, sp: '"$user", public', t: null }, 'same connection, reset')
  // (Key 4444 is this test's alone; other files' tests take advisory locks of their own meanwhile.)
  assert.equal((await admin.query(`SELECT count(*)::int AS n FROM pg_locks WHERE locktype = 'advisory' AND objid = 4444 AND pid = $1`, [pid])).rows[0].n, 0, 'advisory lock released')

  // a backend left inside a transaction is rolled back
  await sql`BEGIN`
  const [next] = (await sql`SELECT pg_backend_pid() AS pid, txid_current() AS x`) as any
  const [again] = (await sql`SELECT txid_current() AS x`) as any
  assert.equal(next.pid, pid, 'the dangling BEGIN was rolled back by the reset, and the backend reused')
  assert.notEqual(again.x, next.x, 'each request in a transaction of its own')
  const lingering = await admin.query(`SELECT count(*)::int AS n FROM pg_stat_activity WHERE application_name = $1 AND state LIKE 'idle in transaction%'`, [m.app])
  assert.equal(lingering.rows[0].n, 0, 'no connection left idle in a transaction')
  await m.close()
})

// ── limits ──────────────────────────────────────────────────────────────────────────────────

test('limits: body too large → 413, response too large → 507 (a batch commits nothing)', async () => {
  const m = await mount({ maxBodyBytes: 4096, maxResponseBytes: 64 * 1024 })
  const sql = sqlAt(m)
  same(await sql`SELECT length(${'x'.repeat(3000)}::text) AS n`, [{ n: 3000 }], 'under the body limit')
  const big = await rejection(sql`SELECT ${'x'.repeat(5000)}::text`, 'body over the limit')
  assert.match(big.message, /HTTP status 413.*request body is too large \(max is 4096 bytes\)/)

  // a large body with no Content-Length (chunked), and a huge one: answered, not hung
  for (const size of [20_000, 8 << 20]) {
    const status = await new Promise<number>((resolve, reject) => {
      const req = http.request(m.url, { method: 'POST', headers: { 'neon-connection-string': CONN }, agent: false }, (res) => {
        res.resume()
        resolve(res.statusCode ?? 0)
      })
      req.on('error', (err) => (/EPIPE|ECONNRESET/.test((err as any).code) ? undefined : reject(err)))
      req.write('{"query": "' + 'y'.repeat(size))
      req.end('"}')
    })
    assert.equal(status, 413, `chunked body of ${size} bytes`)
  }

  same((await sql`SELECT repeat('x', 1000) AS r FROM generate_series(1, 50)`).length, 50, 'under the response limit')
  const tooBig = await rejection(sql`SELECT repeat('x', 1000) AS r FROM generate_series(1, 1000)`, 'response over the limit')
  assert.match(tooBig.message, /HTTP status 507.*response is too large \(max is 65536 bytes\)/)
  // rows far beyond the limit: the query is cancelled while rows still arrive
  const t0 = Date.now()
  const endless = await rejection(sql`SELECT repeat('x', 100) FROM generate_series(1, 100000) a, generate_series(1, 1000) b`, 'huge result')
  assert.match(endless.message, /HTTP status 507/)
  assert.ok(Date.now() - t0 < 5000, `cut early (${Date.now() - t0} ms), not after the whole result`)

  const kv = sql.unsafe(`${schema}.kv`)
  const batch = await rejection(sql.transaction([sql`INSERT INTO ${kv} VALUES ('big-1', 'x')`, sql`SELECT repeat('x', 1000) FROM generate_series(1, 1000)`]), 'batch over the limit')
  assert.match(batch.message, /HTTP status 507/)
  assert.equal((await admin.query(`SELECT 1 FROM ${schema}.kv WHERE k = 'big-1'`)).rowCount, 0, 'the 507 batch committed nothing')
  await eventually(async () => (await backendsOf(m, '%generate_series%')) === 0, 'no backend still producing rows')
  same(await sql`SELECT 1 AS ok`, [{ ok: 1 }], 'usable afterwards')
  await m.close()
})

test('statement timeout: 400 with 57014 from Postgres; a batch cannot lift it', async () => {
  const m = await mount({ statementTimeoutMs: 300 })
  const sql = sqlAt(m)
  const c = new pg.Client({ ...pgConfig(), statement_timeout: 300 })
  await c.connect()
  const expected = await rejection(c.query('SELECT pg_sleep(2)'), 'pg with statement_timeout')
  await c.end()
  const err = await rejection(sql`SELECT pg_sleep(2)`, 'neon() sleeping past the timeout')
  assert.equal(err.code, '57014')
  same(errorFields(err), errorFields(expected), 'the same error as pg over TCP with statement_timeout')
  same(await sql`SHOW statement_timeout`, [{ statement_timeout: '300ms' }], 'set on the connection')

  // SET inside a batch does not outlive the request, and the proxy cancels a statement past the timeout anyway
  same(await sql.transaction([sql`SET statement_timeout = 0`, sql`SHOW statement_timeout`]), [[], [{ statement_timeout: '0' }]], 'SET in a batch')
  same(await sql`SHOW statement_timeout`, [{ statement_timeout: '300ms' }], 'restored by the reset')
  const t0 = Date.now()
  const lifted = await rejection(sql.transaction([sql`SET LOCAL statement_timeout = 0`, sql`SELECT pg_sleep(5)`]), 'batch that lifts the timeout')
  assert.equal(lifted.code, '57014')
  assert.match(lifted.message, /^canceling statement due to statement timeout \(edgepg-proxy: 300 ms\)$/)
  assert.ok(Date.now() - t0 < 3000, `cancelled by the proxy after ${Date.now() - t0} ms`)
  await m.close()
})

test('a client that aborts its request cancels the running query', async () => {
  const m = await mount()
  const sql = sqlAt(m)
  const kv = sql.unsafe(`${schema}.kv`)
  for (const [what, run] of [
    ['single query', (signal: AbortSignal) => sql.query('SELECT pg_sleep(30)', [], { fetchOptions: { signal } })],
    ['batch', (signal: AbortSignal) => sql.transaction([sql`INSERT INTO ${kv} VALUES ('aborted', 'x')`, sql`SELECT pg_sleep(30)`], { fetchOptions: { signal } })],
  ] as const) {
    const ac = new AbortController()
    const pending = rejection(run(ac.signal), `${what} aborted`)
    await eventually(async () => (await backendsOf(m, '%pg_sleep(30)%')) === 1, `${what}: pg_sleep to start`)
    const t0 = Date.now()
    ac.abort()
    const err = await pending
    assert.match(String(err.message), /abort/i, `${what}: neon() reports the abort`)
    await eventually(async () => (await backendsOf(m, '%pg_sleep(30)%')) === 0, `${what}: pg_sleep to be cancelled`, 1500)
    assert.ok(Date.now() - t0 < 1500, `${what}: cancelled within ${Date.now() - t0} ms`)
    await eventually(async () => (await backendsOf(m)) === 0, `${what}: the cancelled connection to be closed`, 2000)
  }
  assert.equal((await admin.query(`SELECT 1 FROM ${schema}.kv WHERE k = 'aborted'`)).rowCount, 0, 'the aborted batch committed nothing')
  await eventually(() => m.logs.filter((l) => l.outcome === 'aborted by client').length === 2, 'two aborts logged', 1000)
  same(await sql`SELECT 1 AS ok`, [{ ok: 1 }], 'usable afterwards')
  await m.close()
})

test('upstream TLS (verify-full): queries and cancels reach a TLS-only Postgres', async () => {
  const certs = await generateCerts()
  const tlsPg = await startPostgres(tlsOnly(18, certs.server))
  try {
    const target = { host: '127.0.0.1', port: tlsPg.port }
    const m = await mount({ upstream: target, upstreamTls: { mode: 'verify-full', ca: certs.ca.cert } })
    const sql = sqlAt(m, conn('scram_user', PASSWORD, `127.0.0.1:${tlsPg.port}`, tlsPg.database))
    same(await sql`SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()`, [{ ssl: true }], 'the connection is TLS')

    const tlsAdmin = new pg.Client({ host: '127.0.0.1', port: tlsPg.port, user: 'scram_user', password: PASSWORD, database: tlsPg.database, ssl: { ca: certs.ca.cert } })
    await tlsAdmin.connect()
    const sleeping = async () =>
      (await tlsAdmin.query(`SELECT count(*)::int AS n FROM pg_stat_activity WHERE application_name = $1 AND query LIKE '%pg_sleep(30)%' AND state = 'active'`, [m.app])).rows[0].n
    const ac = new AbortController()
    const pending = rejection(sql.query('SELECT pg_sleep(30)', [], { fetchOptions: { signal: ac.signal } }), 'aborted over TLS')
    await eventually(async () => (await sleeping()) === 1, 'pg_sleep to start')
    ac.abort()
    await pending
    await eventually(async () => (await sleeping()) === 0, 'the CancelRequest (over TLS) to stop pg_sleep', 1500)
    await tlsAdmin.end()

    const wrongCa = await mount({ upstream: target, upstreamTls: { mode: 'verify-full', ca: certs.otherCa.cert } })
    const refused = await rejection(sqlAt(wrongCa, conn('scram_user', PASSWORD, `127.0.0.1:${tlsPg.port}`, tlsPg.database))`SELECT 1`, 'unknown CA')
    assert.match(refused.message, /HTTP status 502.*cannot connect to Postgres/)
    await Promise.all([m.close(), wrongCa.close()])
  } finally {
    await tlsPg.stop()
    await certs.cleanup()
  }
})

test('a password over plain http:// from a non-loopback client is refused unless allowInsecurePasswords', async (t) => {
  const address = Object.values(os.networkInterfaces()).flat().find((i) => i && i.family === 'IPv4' && !i.internal)?.address
  if (!address) return t.skip('no non-loopback IPv4 address to serve on')
  const strict = await mount({}, address)
  const flagged = await mount({ allowInsecurePasswords: true }, address)
  const r = await post(strict, { query: 'SELECT 1' })
  assert.equal(r.status, 403, r.text)
  assert.match(r.json.message, /a password over plain http:\/\/ from a non-loopback client is refused/)
  assert.equal((await post(strict, { query: 'SELECT 1' }, { 'Neon-Connection-String': `postgresql://trust_user@${PG.host}:${PG.port}/${PG.database}` })).status, 200, 'no password: fine')
  assert.equal((await post(flagged, { query: 'SELECT 1' })).status, 200, 'allowInsecurePasswords')
  await Promise.all([strict.close(), flagged.close()])
})

test('through PgBouncer (transaction mode) with the pool off, as docs/pooling.md says: nothing is SET, the proxy enforces the timeout', async (t) => {
  if (!pgbouncerBinary()) return t.skip('pgbouncer is not installed (.ci/run installs it)')
  const bouncer = await startPgBouncer(PG, { default_pool_size: 4 })
  const port = bouncer.port
  try {
    const m = await mount({ upstream: { host: '127.0.0.1', port }, statementTimeoutMs: 300, backends: { enabled: false } })
    const sql = sqlAt(m, conn('scram_user', PASSWORD, `127.0.0.1:${port}`))
    same(await sql`SELECT ${7}::int AS n`, [{ n: 7 }], 'a query through PgBouncer')
    const kv = sql.unsafe(`${schema}.kv`)
    const failed = await rejection(sql.transaction([sql`INSERT INTO ${kv} VALUES ('bouncer', 'x')`, sql`SELECT 1/0`]), 'failing batch')
    assert.equal(failed.code, '22012')
    assert.equal((await admin.query(`SELECT 1 FROM ${schema}.kv WHERE k = 'bouncer'`)).rowCount, 0, 'rolled back through PgBouncer')
    const t0 = Date.now()
    const timedOut = await rejection(sql`SELECT pg_sleep(3)`, 'sleep past the timeout')
    assert.equal(timedOut.code, '57014')
    assert.match(timedOut.message, /^canceling statement due to statement timeout \(edgepg-proxy: 300 ms\)$/)
    assert.ok(Date.now() - t0 < 1500, `cancelled after ${Date.now() - t0} ms (a CancelRequest through PgBouncer)`)
    same(await sql`SELECT 1 AS ok`, [{ ok: 1 }], 'usable afterwards')
    await m.close()
  } finally {
    await bouncer.stop()
  }
})

// ── CORS and Authorization ──────────────────────────────────────────────────────────────────

test('CORS: preflight, reflected allowed Origins, refused ones; no Origin is fine', async () => {
  const m = await mount({ allowedOrigins: ['https://app.example'] })
  const pre = await fetch(m.url, { method: 'OPTIONS', headers: { origin: 'https://app.example', 'access-control-request-method': 'POST', 'access-control-request-headers': 'neon-connection-string, neon-array-mode' } })
  assert.equal(pre.status, 204)
  assert.equal(pre.headers.get('access-control-allow-origin'), 'https://app.example')
  assert.equal(pre.headers.get('access-control-allow-methods'), 'POST, OPTIONS')
  const allowed = (pre.headers.get('access-control-allow-headers') ?? '').split(/,\s*/)
  for (const h of ['Neon-Connection-String', 'Neon-Raw-Text-Output', 'Neon-Array-Mode', 'Neon-Batch-Isolation-Level', 'Neon-Batch-Read-Only', 'Neon-Batch-Deferrable', 'Authorization', 'Content-Type']) {
    assert.ok(allowed.includes(h), `preflight allows ${h}`)
  }
  same(allowed, SQL_REQUEST_HEADERS, 'the exported list')
  assert.ok(Number(pre.headers.get('access-control-max-age')) > 0, 'preflight is cacheable')

  const ok = await post(m, { query: 'SELECT 1 AS one' }, { origin: 'https://app.example' })
  assert.equal(ok.status, 200)
  assert.equal(ok.headers.get('access-control-allow-origin'), 'https://app.example')
  assert.equal(ok.headers.get('vary'), 'Origin')

  const refusedPre = await fetch(m.url, { method: 'OPTIONS', headers: { origin: 'https://evil.example' } })
  assert.equal(refusedPre.status, 403)
  assert.equal(refusedPre.headers.get('access-control-allow-origin'), null)
  const refused = await post(m, { query: 'SELECT 1' }, { origin: 'https://evil.example' })
  assert.equal(refused.status, 403)
  assert.match(refused.json.message, /origin https:\/\/evil\.example is not allowed/)
  assert.equal((await post(m, { query: 'SELECT 1' })).status, 200, 'no Origin: allowed')
  await m.close()

  const any = await mount({ allowedOrigins: ['*'] })
  const star = await post(any, { query: 'SELECT 1' }, { origin: 'https://whoever.example' })
  assert.equal(star.status, 200)
  assert.equal(star.headers.get('access-control-allow-origin'), 'https://whoever.example')
  await any.close()
  const none = await mount()
  assert.equal((await post(none, { query: 'SELECT 1' }, { origin: 'https://app.example' })).status, 403, 'no allowed Origins by default')
  await none.close()
})

test("CORS in the whole proxy: /sql answers preflights for the WebSocket routes' allowed Origins, and only those", async () => {
  const sqlLogs: SqlLog[] = []
  const proxy = await startProxy({ allowedOrigins: ['https://app.example'], sqlLog: (e) => sqlLogs.push(e) })
  try {
    const url = `http://127.0.0.1:${proxy.port}/sql`
    const preflight = (origin: string) =>
      fetch(url, { method: 'OPTIONS', headers: { origin, 'access-control-request-method': 'POST', 'access-control-request-headers': 'content-type, neon-connection-string' } })
    const pre = await preflight('https://app.example')
    assert.equal(pre.status, 204, 'preflight from an allowed Origin answered')
    assert.equal(pre.headers.get('access-control-allow-origin'), 'https://app.example')
    assert.equal(pre.headers.get('access-control-allow-methods'), 'POST, OPTIONS')
    const ok = await fetch(url, { method: 'POST', headers: { origin: 'https://app.example', 'Neon-Connection-String': CONN }, body: JSON.stringify({ query: 'SELECT 1 AS one' }) })
    assert.equal(ok.status, 200, await ok.clone().text())
    assert.equal(ok.headers.get('access-control-allow-origin'), 'https://app.example', 'the response carries the allowed Origin')
    same((await ok.json()).rows, [{ one: 1 }], 'rows')
    const upgrade = await tryUpgrade(proxy.url, { headers: { origin: 'https://app.example' } })
    upgrade.ws?.close()
    assert.equal(upgrade.status, 101, 'the WebSocket route allows the same Origin')

    const refused = await preflight('https://evil.example')
    assert.equal(refused.status, 403, 'preflight from another Origin refused')
    assert.equal(refused.headers.get('access-control-allow-origin'), null, 'no CORS headers for it')
    assert.match((await refused.json()).message, /origin https:\/\/evil\.example is not allowed \(--allow-origin\)/)
    assert.equal((await tryUpgrade(proxy.url, { headers: { origin: 'https://evil.example' } })).status, 403, 'the WebSocket route refuses it too')
    same(sqlLogs.map((l) => [l.status, l.outcome]), [[204, 'preflight'], [200, 'ok'], [403, 'refused: origin']], '/sql log')
    const conn = new URL(CONN)
    same([sqlLogs[1].user, sqlLogs[1].database], [decodeURIComponent(conn.username), conn.pathname.slice(1)], 'the request logged by user and database')
    assert.ok(!JSON.stringify(sqlLogs).includes(decodeURIComponent(conn.password)), 'no password in the log')
  } finally {
    await proxy.close()
  }
})

test('Authorization: ignored by default; checked by an authToken callback when given', async () => {
  same(await sqlAt(main, CONN, { authToken: 'anything' })`SELECT 1 AS ok`, [{ ok: 1 }], 'ignored without a check')
  const seen: Array<string | undefined> = []
  const m = await mount({ authToken: (token) => (seen.push(token), token === 'open-sesame') })
  same(await sqlAt(m, CONN, { authToken: async () => 'open-sesame' })`SELECT 1 AS ok`, [{ ok: 1 }], 'right token')
  for (const authToken of ['wrong', undefined]) {
    const err = await rejection(sqlAt(m, CONN, authToken ? { authToken } : {})`SELECT 1`, `token ${authToken}`)
    assert.match(err.message, /HTTP status 401.*authorization token refused/)
  }
  same(seen, ['open-sesame', 'wrong', undefined], 'the callback saw each bearer token')
  await m.close()
})

// ── the wire format ─────────────────────────────────────────────────────────────────────────

test('wire format: field objects, raw text vs Neon-style JSON values, array mode, per-query arrayMode', async () => {
  const text = `SELECT true AS b, 7::int2 AS s, 8::int4 AS i, 9007199254740993::int8 AS l, 1.5::float8 AS f, 0.1::float4 AS f4, 'NaN'::float8 AS nan,
    '-Infinity'::float4 AS ninf, '{"a":[1,{"b":null}]}'::jsonb AS j, 2.50::numeric AS n, NULL::int AS z, ARRAY[1, NULL, 3] AS arr,
    ARRAY['a', 'NULL', NULL, 'b"c\\d', '', ' sp '] AS t, '{{1,2},{3,4}}'::int[] AS m, ARRAY[true, false] AS ba, ARRAY['{"k":1}'::jsonb] AS ja,
    '[0:1]={5,6}'::int[] AS bounded, ARRAY['sad', 'ok']::${schema}.mood[] AS moods, '2024-01-02'::date AS d, ARRAY['(1,2),(3,4)'::box, '(0,0),(1,1)'] AS boxes`
  const raw = await post(main, { query: text }, { 'Neon-Raw-Text-Output': 'true', 'Neon-Array-Mode': 'true' })
  assert.equal(raw.status, 200, raw.text)
  same(Object.keys(raw.json), ['command', 'rowCount', 'rowAsArray', 'fields', 'rows'], 'response keys')
  const fromPg = await tcp.query({ text, rowMode: 'array', types: { getTypeParser: () => (v: string) => v } } as any)
  same(raw.json.rows, fromPg.rows, 'raw text output: the text Postgres sent, as pg gets it')
  same(raw.json.fields, fromPg.fields.map((f: pg.FieldDef) => ({ name: f.name, dataTypeID: f.dataTypeID, tableID: f.tableID, columnID: f.columnID, dataTypeSize: f.dataTypeSize, dataTypeModifier: f.dataTypeModifier, format: 'text' })), 'field objects')
  same([raw.json.command, raw.json.rowCount, raw.json.rowAsArray], ['SELECT', 1, true], 'command, rowCount, rowAsArray')

  // without raw text output: Neon's server-side conversion
  const typed = await post(main, { query: text })
  assert.equal(typed.status, 200, typed.text)
  assert.equal(typed.json.rowAsArray, false)
  same(typed.json.rows, [{
    b: true, s: 7, i: 8, l: '9007199254740993', f: 1.5, f4: 0.1, nan: 'NaN', ninf: '-Infinity', j: { a: [1, { b: null }] }, n: '2.50', z: null,
    arr: [1, null, 3], t: ['a', 'NULL', null, 'b"c\\d', '', ' sp '], m: [[1, 2], [3, 4]], ba: [true, false], ja: [{ k: 1 }], bounded: [5, 6],
    moods: ['sad', 'ok'], d: '2024-01-02', boxes: ['(3,4),(1,2)', '(1,1),(0,0)'],
  }], 'typed JSON values')

  // per-query arrayMode overrides the header, in a batch too
  const batch = await post(main, { queries: [{ query: 'SELECT 1 AS a', arrayMode: true }, { query: 'SELECT 2 AS b' }, { query: 'SELECT 3 AS c', arrayMode: false }] }, {
    'Neon-Array-Mode': 'true', 'Neon-Raw-Text-Output': 'true', 'Neon-Batch-Isolation-Level': 'RepeatableRead', 'Neon-Batch-Read-Only': 'true',
  })
  assert.equal(batch.status, 200, batch.text)
  same(Object.keys(batch.json), ['results'], 'batch response keys')
  same(batch.json.results.map((r: any) => r.rows), [[['1']], [['2']], [{ c: '3' }]], 'per-query arrayMode')
  assert.equal(batch.headers.get('neon-batch-isolation-level'), 'RepeatableRead', 'batch options echoed')
  assert.equal(batch.headers.get('neon-batch-read-only'), 'true')
  same((await post(main, { queries: [] })).json, { results: [] }, 'an empty batch')

  // parameters: JSON values become Postgres text (arrays as array literals, objects as JSON)
  const params = await post(main, { query: 'SELECT $1::int AS n, $2::bool AS b, $3::text[] AS t, $4::jsonb AS j, $5::text AS z, $6::int[] AS nested', params: [42, true, ['a"b', null, 'c,d'], { k: [1] }, null, [[1, 2], [3, null]]] }, { 'Neon-Raw-Text-Output': 'true' })
  assert.equal(params.status, 200, params.text)
  same(params.json.rows, [{ n: '42', b: 't', t: '{"a\\"b",NULL,"c,d"}', j: '{"k": [1]}', z: null, nested: '{{1,2},{3,NULL}}' }], 'parameters')

  // one statement per query, as with Neon (the extended protocol)
  const multi = await post(main, { query: 'SELECT 1; SELECT 2' })
  assert.equal(multi.status, 400)
  assert.equal(multi.json.code, '42601')
})

test('shutdown: close() cancels what still runs and ends the pools', async () => {
  const m = await mount()
  const sql = sqlAt(m)
  await sql`SELECT 1`
  const pending = rejection(sql`SELECT pg_sleep(30)`, 'query during shutdown')
  await eventually(async () => (await backendsOf(m, '%pg_sleep(30)%')) === 1, 'pg_sleep to start')
  const t0 = Date.now()
  await m.close()
  assert.ok(Date.now() - t0 < 3000, `close() took ${Date.now() - t0} ms`)
  const err = await pending
  assert.match(err.message, /HTTP status 503.*edgepg-proxy is shutting down/)
  await eventually(async () => (await backendsOf(m)) === 0, 'backends to exit')
  same(m.handler.stats(), { connections: 0, waiting: 0, requests: 0 }, 'nothing left')
  same(m.pool.size, { pooled: 0, idle: 0 }, 'the pool is empty')
})

// ── the shared corpus through neon() ────────────────────────────────────────────────────────

/**
 * Values as plain data, so neon()'s own (bundled) pg-types objects compare with pg's: its
 * postgres-interval instances are of another class than pg's (same fields), so intervals are
 * compared as plain objects; Buffers as hex and Dates as ISO text for clearer diffs.
 */
function plain(v: unknown): unknown {
  if (v === null || typeof v !== 'object') return v
  if (v instanceof Uint8Array) return { bytes: Buffer.from(v).toString('hex') }
  if (v instanceof Date) return { date: Number.isNaN(v.getTime()) ? 'Invalid' : v.toISOString() }
  if (Array.isArray(v)) return v.map(plain)
  return Object.fromEntries(Object.entries(v).map(([k, x]) => [k, plain(x)]))
}

/** What neon()'s fullResults and pg's Result share (pg's `oid` has no counterpart in Neon's protocol). */
const shape = (r: any) => ({ command: r.command, rowCount: r.rowCount, rowAsArray: r.rowAsArray, fields: plain(r.fields), rows: plain(r.rows) })

/**
 * Where neon() through /sql cannot give what pg over TCP gives, by Neon's protocol (not the proxy):
 * - one statement per query (Neon runs the extended protocol): multi-statement strings fail with
 *   42601 "cannot insert multiple commands into a prepared statement";
 * - a query with no statement (empty, blank, only comments or ';') has command "" where pg has
 *   null (Neon's server sends the missing command tag as ""); rowCount is null on both.
 */
const EMPTY_QUERIES = new Set(['empty query', 'whitespace-only query', 'comment-only query', 'lone semicolon'])

test(`corpus (${corpus.length} queries) through neon(): same rows, fields, command, rowCount and errors as pg over TCP`, async (t) => {
  const sql = sqlAt(main)
  const differences: string[] = []
  for (const entry of corpus) {
    await t.test(entry.name, async () => {
      const config: any = { text: entry.text, ...('values' in entry && { values: entry.values }), ...(entry.rowMode && { rowMode: entry.rowMode }), ...(entry.types && { types: entry.types }) }
      let expected: any
      try {
        expected = { result: shape(await tcp.query(config)) }
      } catch (err) {
        expected = { error: errorFields(err) }
      }
      neonConfig.fetchEndpoint = main.url
      let got: any
      try {
        got = { result: shape(await sql.query(entry.text, (entry.values ?? []) as any[], { fullResults: true, arrayMode: entry.rowMode === 'array', ...(entry.types && { types: entry.types as any }) })) }
      } catch (err) {
        got = { error: errorFields(err) }
      }
      if (/^multi-statement/.test(entry.name)) {
        assert.equal(got.error?.code, '42601', `${entry.name}: neon() fails with 42601 by design, got ${JSON.stringify(got)}`)
        assert.match(got.error.message, /cannot insert multiple commands into a prepared statement/)
        differences.push(entry.name)
        return
      }
      if (EMPTY_QUERIES.has(entry.name)) {
        assert.equal(expected.result?.command, null, `${entry.name}: pg has command null`)
        expected.result.command = ''
        differences.push(entry.name)
      }
      same(got, expected, `${entry.name}: neon() via /sql differs from pg over TCP`)
    })
  }
  assert.equal(differences.length, 10, `the known differences: ${differences.join(', ')}`)
})

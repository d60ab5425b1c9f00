/**
 * Parity with pg over TCP: the shared corpus (test/support/corpus.ts) and a set of behaviours run through
 * edgepg (Client and Pool, via the proxy) and through plain `pg` over TCP against the same
 * database; results must be deep-equal, errors must be the same DatabaseError field for field.
 */
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { randomBytes } from 'node:crypto'
import pg from 'pg'
import { Client, Pool } from '../src/index'
import { edgeClient, edgePool, startProxy, pgConfig, backends, eventually, within, same } from './support/helpers'
import { buildCorpus, setupSql, teardownSql, uniqueSchema, type CorpusEntry } from './support/corpus'

const schema = uniqueSchema()
const corpus = buildCorpus(schema)

let proxy: Awaited<ReturnType<typeof startProxy>>
let admin: pg.Client
let edge: Client
let pool: Pool
let tcp: pg.Client

/** Everything a test opened, ended in `after` whatever happened. */
const opened: Array<{ end(): Promise<void> }> = []
function track<T extends { end(): Promise<void> }>(x: T): T {
  opened.push(x)
  return x
}
async function endAll(...xs: Array<{ end(): Promise<void> }>) {
  for (const x of xs) {
    const i = opened.indexOf(x)
    if (i >= 0) opened.splice(i, 1)
    await x.end()
  }
}

before(async () => {
  // Session mode: pg-exact down to processID, which transaction mode shares among a key's sessions
  // (docs/pooling.md; test/transaction-pool.test.ts shows it).
  proxy = await startProxy({ pool: { mode: 'session' } })
  admin = new pg.Client(pgConfig('trust_user'))
  await admin.connect()
  await admin.query(setupSql(schema))
  edge = track(edgeClient(proxy.port))
  pool = track(edgePool(proxy.port, { max: 4 }))
  tcp = track(new pg.Client(pgConfig()))
  await Promise.all([edge.connect(), tcp.connect()])
})

after(async () => {
  for (const x of opened.splice(0).reverse()) await within(2000, 'end()', x.end()).catch(() => {})
  if (admin) {
    await admin.query(teardownSql(schema)).catch(() => {})
    await admin.end().catch(() => {})
  }
  await proxy?.close()
})

// ── normalisation ───────────────────────────────────────────────────────────────────────────

/** What pg hands back for a query: a Result, or an array of them for a multi-statement query. */
function normResult(r: any): unknown {
  if (Array.isArray(r)) return r.map(normResult)
  return { command: r.command, rowCount: r.rowCount, oid: r.oid, rows: r.rows, fields: r.fields, rowAsArray: r.rowAsArray }
}

/** An error (or notice): its class, name, message and every own enumerable field. */
function normError(e: any): Record<string, unknown> {
  const out: Record<string, unknown> = { class: e?.constructor?.name, name: e?.name, message: e?.message }
  for (const key of Object.keys(e ?? {})) if (key !== 'client') out[key] = e[key]
  return out
}

type Outcome = { result: unknown } | { error: Record<string, unknown> }
type Queryable = { query(config: any): Promise<any> }

function queryConfig(entry: CorpusEntry): pg.QueryConfig & Record<string, unknown> {
  const config: any = { text: entry.text }
  if ('values' in entry) config.values = entry.values
  if (entry.rowMode) config.rowMode = entry.rowMode
  if (entry.types) config.types = entry.types
  return config
}

async function outcome(q: Queryable, config: any): Promise<Outcome> {
  try {
    return { result: normResult(await q.query(config)) }
  } catch (err) {
    return { error: normError(err) }
  }
}

// ── the corpus ──────────────────────────────────────────────────────────────────────────────

test(`corpus (${corpus.length} queries): edgepg Client and Pool deep-equal pg over TCP`, async (t) => {
  assert.ok(corpus.length >= 60, `corpus has only ${corpus.length} entries`)
  assert.equal(new Set(corpus.map((e) => e.name)).size, corpus.length, 'corpus entry names are unique')
  for (const entry of corpus) {
    await t.test(entry.name, async () => {
      const expected = await outcome(tcp, queryConfig(entry))
      if (entry.error) {
        assert.ok('error' in expected, `${entry.name}: expected pg to fail with ${entry.error}, got a result`)
        assert.equal(expected.error.code, entry.error, `${entry.name}: SQLSTATE`)
        assert.equal(expected.error.class, 'DatabaseError', `${entry.name}: error class`)
      } else {
        assert.ok('result' in expected, `${entry.name}: expected a result from pg, got ${JSON.stringify((expected as any).error)}`)
      }
      same(await outcome(edge, queryConfig(entry)), expected, `${entry.name}: edgepg Client differs from pg over TCP`)
      same(await outcome(pool, queryConfig(entry)), expected, `${entry.name}: edgepg Pool (pool.query) differs from pg over TCP`)
    })
  }
})

test('client-level setTypeParser: same results through edgepg Client, Pool and pg', async () => {
  const install = (c: pg.Client | pg.PoolClient) => {
    c.setTypeParser(20, (v: string) => BigInt(v))
    c.setTypeParser(1700, (v: string) => Number(v))
    c.setTypeParser(1082, (v: string) => `date:${v}`)
    c.setTypeParser(1184, 'text', (v: string) => `tz:${v}`)
  }
  const e = track(edgeClient(proxy.port))
  const p = track(edgePool(proxy.port, { max: 1 }))
  const c = track(new pg.Client(pgConfig()))
  p.on('connect', install)
  install(e)
  install(c)
  await Promise.all([e.connect(), c.connect()])
  const configs: any[] = [
    { text: `SELECT 9223372036854775807::int8 AS big, 1.25::numeric AS n, '2024-02-29'::date AS d, '2024-01-02 03:04:05+00'::timestamptz AS tz, 7::int4 AS i` },
    { text: 'SELECT $1::int8 AS big, $2::numeric[] AS arr', values: [12345678901234567n, [1.5, null]], rowMode: 'array' },
    // a per-query `types` wins over the client's parsers
    { text: 'SELECT 1::int8 AS big', types: { getTypeParser: () => (v: string) => `query:${v}` } },
    ...corpus.filter((x) => /^(int2\/int4\/int8|numeric precision|date$|timestamptz$|integer parameters)/.test(x.name)).map(queryConfig),
  ]
  for (const config of configs) {
    const expected = await outcome(c, config)
    assert.ok('result' in expected, `${config.text}: expected a result from pg`)
    same(await outcome(e, config), expected, `${config.text}: edgepg Client`)
    same(await outcome(p, config), expected, `${config.text}: edgepg Pool`)
  }
  const { rows } = await e.query(configs[0])
  assert.equal(rows[0].big, 9223372036854775807n)
  assert.equal(rows[0].n, 1.25)
  assert.equal(rows[0].d, 'date:2024-02-29')
  assert.match(rows[0].tz, /^tz:2024-01-0/)
  assert.equal((await e.query(configs[2])).rows[0].big, 'query:1')
  await endAll(e, p, c)
})

// ── large results and values ────────────────────────────────────────────────────────────────

test('100k-row result is identical through all paths', async () => {
  const config = {
    text: `SELECT i, 'row ' || i AS label, i::numeric / 7 AS ratio, (i % 3 = 0) AS flag, make_date(2000, 1, 1) + (i % 1000) AS day
           FROM generate_series(1, 100000) i`,
  }
  const [fromTcp, fromEdge, fromPool] = await Promise.all([tcp.query(config), edge.query(config), pool.query(config)])
  assert.equal(fromTcp.rows.length, 100000)
  assert.equal(fromTcp.rowCount, 100000)
  assert.deepEqual(fromTcp.rows[99999], { i: 100000, label: 'row 100000', ratio: '14285.714285714286', flag: false, day: fromTcp.rows[99999].day })
  same(normResult(fromEdge), normResult(fromTcp), '100k rows: edgepg Client')
  same(normResult(fromPool), normResult(fromTcp), '100k rows: edgepg Pool')
})

test('10 MB bytea round trip, byte for byte', async () => {
  const data = randomBytes(10 * 1024 * 1024)
  const config = { text: 'SELECT $1::bytea AS b, length($1::bytea) AS n, md5($1::bytea) AS h', values: [data] }
  const fromTcp = await tcp.query(config)
  const fromEdge = await edge.query(config)
  assert.ok(Buffer.isBuffer(fromEdge.rows[0].b), 'bytea comes back as a Buffer')
  assert.ok(fromEdge.rows[0].b.equals(data), 'edgepg returned different bytes')
  assert.equal(fromEdge.rows[0].n, data.length)
  same(normResult(fromEdge), normResult(fromTcp), '10 MB bytea: edgepg Client')

  // stored through the Pool, read back through edgepg and pg
  await pool.query(`INSERT INTO ${schema}.blobs (id, data) VALUES (1, $1)`, [data])
  const read = { text: `SELECT id, data, md5(data) AS h FROM ${schema}.blobs WHERE id = 1` }
  const [stored, storedTcp] = await Promise.all([pool.query(read), tcp.query(read)])
  assert.ok(stored.rows[0].data.equals(data), 'pool read back different bytes')
  same(normResult(stored), normResult(storedTcp), '10 MB bytea stored: edgepg Pool')
  await pool.query(`DELETE FROM ${schema}.blobs WHERE id = 1`)
})

// ── notices, LISTEN/NOTIFY ──────────────────────────────────────────────────────────────────

test('NOTICE events carry the same fields', async () => {
  const sql = [
    `DO $$ BEGIN
       RAISE NOTICE 'hello % ✓', 'wörld' USING DETAIL = 'a detail', HINT = 'a hint';
       RAISE WARNING 'careful';
       RAISE INFO 'fyi';
       RAISE NOTICE 'coded' USING ERRCODE = '01234', COLUMN = 'c', TABLE = 't', SCHEMA = 's';
     END $$`,
    `DROP TABLE IF EXISTS ${schema}.does_not_exist`,
    'COMMIT', // WARNING: there is no transaction in progress
  ]
  const collect = async (c: pg.Client | pg.PoolClient) => {
    const notices: unknown[] = []
    const listener = (n: unknown) => notices.push(normError(n))
    c.on('notice', listener)
    const results = []
    for (const text of sql) results.push(await outcome(c, { text }))
    c.off('notice', listener)
    return { notices, results }
  }
  const expected = await collect(tcp)
  assert.equal(expected.notices.length, 6)
  assert.equal((expected.notices[0] as any).message, 'hello wörld ✓')
  assert.equal((expected.notices[0] as any).detail, 'a detail')
  same(await collect(edge), expected, 'notices: edgepg Client')
  const pc = await pool.connect()
  try {
    same(await collect(pc), expected, 'notices: edgepg Pool client')
  } finally {
    pc.release()
  }
})

test('LISTEN/NOTIFY between two edgepg clients matches what pg sees', async () => {
  const channel = `parity chan ✓ ${process.pid}`
  const quoted = pg.escapeIdentifier(channel)
  const listener = track(edgeClient(proxy.port))
  const sender = track(edgeClient(proxy.port))
  const tcpListener = track(new pg.Client(pgConfig()))
  await Promise.all([listener.connect(), sender.connect(), tcpListener.connect()])
  const got: unknown[] = []
  const gotTcp: unknown[] = []
  listener.on('notification', (n) => got.push(n))
  tcpListener.on('notification', (n) => gotTcp.push(n))
  same(await outcome(listener, { text: `LISTEN ${quoted}` }), await outcome(tcpListener, { text: `LISTEN ${quoted}` }), 'LISTEN result')

  await sender.query(`NOTIFY ${quoted}, 'from edgepg'`)
  await sender.query('SELECT pg_notify($1, $2)', [channel, 'payload ✓ 🐘 日本'])
  await sender.query(`NOTIFY ${quoted}`)
  await sender.query('SELECT pg_notify($1, $2)', [channel, 'x'.repeat(7000)])
  await sender.query(`BEGIN; NOTIFY ${quoted}, 'tx 1'; NOTIFY ${quoted}, 'tx 2'; COMMIT`)
  await sender.query(`BEGIN; NOTIFY ${quoted}, 'rolled back'; ROLLBACK`)
  await tcp.query(`NOTIFY ${quoted}, 'from pg over TCP'`)
  const payloads = ['from edgepg', 'payload ✓ 🐘 日本', '', 'x'.repeat(7000), 'tx 1', 'tx 2', 'from pg over TCP']
  await eventually(() => got.length >= payloads.length && gotTcp.length >= payloads.length, 'notifications to arrive')
  await new Promise((r) => setTimeout(r, 100)) // nothing further (the rolled-back one) may arrive
  assert.deepEqual(got.map((n: any) => n.payload), payloads)
  assert.deepEqual(got.map((n: any) => n.channel), payloads.map(() => channel))
  assert.deepEqual(got.map((n: any) => n.processId), [...payloads.slice(0, -1).map(() => (sender as any).processID), (tcp as any).processID])
  same(got, gotTcp, 'notifications: edgepg listener vs pg listener')

  // UNLISTEN stops delivery on both
  same(await outcome(listener, { text: `UNLISTEN ${quoted}` }), await outcome(tcpListener, { text: `UNLISTEN ${quoted}` }), 'UNLISTEN result')
  await sender.query(`NOTIFY ${quoted}, 'after unlisten'`)
  await listener.query('SELECT 1')
  await tcpListener.query('SELECT 1')
  assert.equal(got.length, payloads.length)
  assert.equal(gotTcp.length, payloads.length)
  await endAll(listener, sender, tcpListener)
})

// ── transactions ────────────────────────────────────────────────────────────────────────────

test('transactions and savepoints: same results and visible effects', async () => {
  const kv = `${schema}.kv`
  const script = async (c: Queryable, observer: Queryable) => {
    const log: Array<[string, Outcome]> = []
    const step = async (text: string, values?: unknown[]) => log.push([text, await outcome(c, values ? { text, values } : { text })])
    const peek = async (label: string) => log.push([`peek ${label}`, await outcome(observer, { text: `SELECT k, v FROM ${kv} WHERE k LIKE 'tx-%' ORDER BY k` })])
    await step('BEGIN')
    await step(`INSERT INTO ${kv} VALUES ('tx-a', $1)`, ['A'])
    await peek('uncommitted insert is invisible to others')
    await step('SAVEPOINT s1')
    await step(`INSERT INTO ${kv} VALUES ('tx-b', 'B')`)
    await step('ROLLBACK TO SAVEPOINT s1')
    await step(`INSERT INTO ${kv} VALUES ('tx-c', 'C')`)
    await step('SAVEPOINT s2')
    await step('SELECT 1/0 AS boom')
    await step('SELECT 1 AS aborted')
    await step('ROLLBACK TO s2')
    await step('RELEASE SAVEPOINT s1')
    await step(`SELECT k, v FROM ${kv} WHERE k LIKE 'tx-%' ORDER BY k`)
    await step('COMMIT')
    await peek('after COMMIT')
    await step('BEGIN')
    await step(`UPDATE ${kv} SET v = 'changed' WHERE k LIKE 'tx-%'`)
    await step(`DELETE FROM ${kv} WHERE k = 'tx-a'`)
    await step('ROLLBACK')
    await peek('after ROLLBACK')
    await step('BEGIN ISOLATION LEVEL SERIALIZABLE')
    await step(`INSERT INTO ${kv} VALUES ('tx-a', 'dup')`)
    await step('COMMIT') // of a failed transaction: reported as ROLLBACK
    await step('START TRANSACTION READ ONLY')
    await step(`INSERT INTO ${kv} VALUES ('tx-z', 'ro')`)
    await step('ROLLBACK')
    await step(`DELETE FROM ${kv} WHERE k LIKE 'tx-%'`)
    await peek('after cleanup')
    return log
  }
  const observerTcp = track(new pg.Client(pgConfig()))
  await observerTcp.connect()
  const expected = await script(tcp, pool)
  const find = (label: string) => (expected.find(([l]) => l === `peek ${label}`)![1] as any).result.rows
  assert.deepEqual(find('uncommitted insert is invisible to others'), [])
  assert.deepEqual(find('after COMMIT'), [{ k: 'tx-a', v: 'A' }, { k: 'tx-c', v: 'C' }])
  assert.deepEqual(find('after ROLLBACK'), [{ k: 'tx-a', v: 'A' }, { k: 'tx-c', v: 'C' }])
  assert.deepEqual(find('after cleanup'), [])
  same(await script(edge, observerTcp), expected, 'transaction script: edgepg Client')
  const pc = await pool.connect()
  try {
    same(await script(pc, observerTcp), expected, 'transaction script: edgepg Pool client')
  } finally {
    pc.release()
  }
  await endAll(observerTcp)
})

// ── timeouts ────────────────────────────────────────────────────────────────────────────────

test('query_timeout: "Query read timeout" on both, client usable afterwards; edgepg also stops the statement', async () => {
  const pause = (ms: number) => new Promise((r) => setTimeout(r, ms))
  const run = async (c: pg.Client) => {
    await c.connect()
    const log = [
      await outcome(c, { text: 'SELECT pg_sleep(0.4) AS slept' }),
      (await pause(400), await outcome(c, { text: 'SELECT 1 AS after_timeout' })),
      await outcome(c, { text: 'SELECT pg_sleep(0.4) AS per_query', query_timeout: 100 }),
      await outcome(c, { text: 'SELECT 2 AS queued_behind_the_sleep' }), // the sleep is still running: times out too
      (await pause(400), await outcome(c, { text: 'SELECT 3 AS again' })),
    ]
    await within(3000, 'client.end()', endAll(c))
    return log
  }
  const [fromEdge, fromTcp] = await Promise.all([
    run(track(edgeClient(proxy.port, 'scram_user', { query_timeout: 150 }))),
    run(track(new pg.Client({ ...pgConfig(), query_timeout: 150 }))),
  ])
  const timeout = { error: { class: 'Error', name: 'Error', message: 'Query read timeout' } }
  assert.deepEqual(fromTcp[0], timeout)
  assert.deepEqual(fromTcp[2], timeout)
  assert.deepEqual(fromTcp[3], timeout)
  assert.ok('result' in fromTcp[1] && 'result' in fromTcp[4], 'the setup queries succeeded')
  // The one difference, documented: edgepg cancels the timed-out statement on the server, so the
  // query behind it runs at once rather than wait for the sleep and time out too.
  assert.ok('result' in fromEdge[3], `edgepg: the query behind the timed-out one ran: ${JSON.stringify(fromEdge[3])}`)
  same([0, 1, 2, 4].map((i) => fromEdge[i]), [0, 1, 2, 4].map((i) => fromTcp[i]), 'query_timeout: edgepg Client')
})

test('client.end() while a query is still running (e.g. after query_timeout) resolves, as with pg', async () => {
  const run = async (c: pg.Client) => {
    await c.connect()
    const timedOut = await outcome(c, { text: 'SELECT pg_sleep(2) AS slept', query_timeout: 100 })
    // pg destroys the socket when a query is active and resolves end() on the connection's 'end'
    const ended = await within(3000, 'client.end() with an active query', endAll(c).then(() => 'ended')).catch((err) => err.message)
    return { timedOut, ended }
  }
  const [fromEdge, fromTcp] = await Promise.all([run(track(edgeClient(proxy.port))), run(track(new pg.Client(pgConfig())))])
  assert.deepEqual(fromTcp, { timedOut: { error: { class: 'Error', name: 'Error', message: 'Query read timeout' } }, ended: 'ended' })
  same(fromEdge, fromTcp, 'end() with an active query: edgepg Client')
})

test('statement_timeout: server-side 57014, same DatabaseError on both', async () => {
  const run = async (c: pg.Client) => {
    await c.connect()
    const log = [
      await outcome(c, { text: 'SELECT pg_sleep(2) AS slept' }),
      await outcome(c, { text: 'SELECT pg_sleep($1) AS slept', values: [2] }),
      await outcome(c, { text: 'SHOW statement_timeout' }),
      await outcome(c, { text: 'SELECT 1 AS still_usable' }),
    ]
    await endAll(c)
    return log
  }
  const [fromEdge, fromTcp] = await Promise.all([
    run(track(edgeClient(proxy.port, 'scram_user', { statement_timeout: 100 }))),
    run(track(new pg.Client({ ...pgConfig(), statement_timeout: 100 }))),
  ])
  assert.equal((fromTcp[0] as any).error.code, '57014')
  assert.equal((fromTcp[0] as any).error.message, 'canceling statement due to statement timeout')
  same(fromEdge, fromTcp, 'statement_timeout: edgepg Client')

  const timedPool = track(edgePool(proxy.port, { statement_timeout: 100, max: 1 }))
  same(await outcome(timedPool, { text: 'SELECT pg_sleep(2) AS slept' }), fromTcp[0], 'statement_timeout: edgepg Pool')
  await endAll(timedPool)
})

// ── Pool ────────────────────────────────────────────────────────────────────────────────────

test('Pool max: at most `max` backends, the rest wait', async () => {
  const run = async (p: pg.Pool, app: string) => {
    const queries = Array.from({ length: 5 }, (_, i) => p.query('SELECT pg_sleep(0.25) AS slept, $1::int AS i', [i]))
    const counts = { total: p.totalCount, waiting: p.waitingCount }
    let peak = 0
    let done = false
    const all = Promise.all(queries).finally(() => (done = true))
    while (!done) {
      peak = Math.max(peak, await backends(app))
      assert.ok(p.totalCount <= 2, `totalCount ${p.totalCount} > max`)
      await new Promise((r) => setTimeout(r, 20))
    }
    const results = (await all).map(normResult)
    const after = { total: p.totalCount, idle: p.idleCount, waiting: p.waitingCount }
    await endAll(p)
    return { counts, peak, results, after }
  }
  const app = `edgepg-parity-max-${process.pid}`
  const [fromEdge, fromPg] = await Promise.all([
    run(track(edgePool(proxy.port, { max: 2, application_name: `${app}-edge` })), `${app}-edge`),
    run(track(new pg.Pool({ ...pgConfig(), max: 2, application_name: `${app}-pg` })), `${app}-pg`),
  ])
  assert.deepEqual(fromPg.counts, { total: 2, waiting: 3 })
  assert.equal(fromPg.peak, 2)
  assert.equal(fromEdge.peak, 2, 'edgepg Pool used more or fewer backends than max')
  same(fromEdge, fromPg, 'Pool max: edgepg Pool vs pg.Pool')
})

test('Pool idleTimeoutMillis: idle clients are removed and their backends exit', async () => {
  const run = async (p: pg.Pool, app: string) => {
    let removed = 0
    p.on('remove', () => removed++)
    await Promise.all([1, 2, 3].map((i) => p.query('SELECT pg_sleep(0.05), $1::int AS i', [i])))
    const busy = { total: p.totalCount, idle: p.idleCount }
    assert.equal(await backends(app), 3)
    await eventually(() => p.totalCount === 0, 'idle clients to be removed', 3000)
    await eventually(async () => (await backends(app)) === 0, 'backends to exit', 3000)
    const idle = { total: p.totalCount, idle: p.idleCount, removed }
    await endAll(p)
    return { busy, idle }
  }
  const app = `edgepg-parity-idle-${process.pid}`
  // Without warm backends, which would keep the backends past their clients by design (test/pool.test.ts).
  const unpooled = await startProxy({ pool: { enabled: false } })
  const [fromEdge, fromPg] = await Promise.all([
    run(track(edgePool(unpooled.port, { idleTimeoutMillis: 300, application_name: `${app}-edge` })), `${app}-edge`),
    run(track(new pg.Pool({ ...pgConfig(), idleTimeoutMillis: 300, application_name: `${app}-pg` })), `${app}-pg`),
  ]).finally(() => unpooled.close())
  assert.deepEqual(fromPg, { busy: { total: 3, idle: 3 }, idle: { total: 0, idle: 0, removed: 3 } })
  same(fromEdge, fromPg, 'idleTimeoutMillis: edgepg Pool vs pg.Pool')
})

test('Pool connect/release: checkout, reuse, session state, release(err), double release', async () => {
  const run = async (p: pg.Pool) => {
    const log: unknown[] = []
    const snap = (label: string) => log.push([label, p.totalCount, p.idleCount, p.waitingCount])
    const a = await p.connect()
    snap('a checked out')
    await a.query(`SET application_name = 'parity-connect-release'`)
    await a.query('CREATE TEMP TABLE parity_session (x int)')
    const pidA = (a as any).processID
    a.release()
    snap('a released')
    const b = await p.connect()
    log.push(['same client reused', b === a, (b as any).processID === pidA])
    log.push(['session state kept', await outcome(b, { text: `SELECT current_setting('application_name') AS app, count(*)::int AS n FROM pg_temp.parity_session` })])
    const c = await p.connect()
    snap('b and c checked out')
    const waiter = p.connect() // max 2: waits
    snap('third connect waits')
    c.release()
    const d = await waiter
    log.push(['waiter got the released client', d === c])
    d.release()
    b.release(new Error('discard me'))
    snap('b released with an error')
    let double: unknown
    try {
      b.release()
    } catch (err) {
      double = normError(err)
    }
    log.push(['double release', double])
    const viaCallback = await new Promise<unknown>((resolve, reject) =>
      p.connect((err, client, done) => {
        if (err) return reject(err)
        client!.query('SELECT 42 AS answer', (qerr, res) => {
          done()
          qerr ? reject(qerr) : resolve(normResult(res))
        })
      })
    )
    log.push(['callback connect', viaCallback])
    await eventually(() => p.totalCount === 1, 'discarded client to be removed')
    snap('end state')
    await endAll(p)
    log.push(['after end', await outcome(p, { text: 'SELECT 1' })])
    return log
  }
  const [fromEdge, fromPg] = await Promise.all([
    run(track(edgePool(proxy.port, { max: 2 }))),
    run(track(new pg.Pool({ ...pgConfig(), max: 2 }))),
  ])
  same(fromEdge, fromPg, 'connect/release: edgepg Pool vs pg.Pool')
})

test('Pool events connect/acquire/release/remove/error fire as pg.Pool fires them', async () => {
  const run = async (p: pg.Pool) => {
    const log: unknown[] = []
    const ids = new Map<unknown, number>()
    const id = (c: unknown) => {
      if (!ids.has(c)) ids.set(c, ids.size)
      return ids.get(c)
    }
    p.on('connect', (c) => log.push(['connect', id(c)]))
    p.on('acquire', (c) => log.push(['acquire', id(c)]))
    p.on('release', (err, c) => log.push(['release', err ? normError(err) : err, id(c)]))
    p.on('remove', (c) => log.push(['remove', id(c)]))
    p.on('error', (err, c) => log.push(['error', normError(err), id(c)]))
    // 'remove' follows the client's asynchronous end(), so wait for the event itself (and record a
    // timeout as an entry, so the comparison shows what is missing rather than stopping here)
    const removed = (n: number) =>
      eventually(() => log.some((e) => Array.isArray(e) && e[0] === 'remove' && e[1] === n), `'remove' of client ${n}`, 2000).catch((err) => log.push(err.message))

    log.push('pool.query')
    await p.query('SELECT 1 AS one')
    log.push('connect two')
    const a = await p.connect()
    const b = await p.connect()
    log.push('release one, release the other with an error')
    a.release()
    b.release(new Error('bad client'))
    await removed(1)
    log.push('pool.query that fails')
    await p.query('SELECT 1/0').catch(() => {})
    await removed(0)
    log.push('idle client whose backend is terminated')
    const c = await p.connect()
    // (not c.processID: after a pipelined connect, BackendKeyData arrives with the first answer)
    const pid = (await c.query('SELECT pg_backend_pid() AS pid')).rows[0].pid
    c.release()
    await admin.query('SELECT pg_terminate_backend($1)', [pid])
    await removed(2)
    await new Promise((r) => setTimeout(r, 100)) // any trailing events
    log.push('end with an idle client')
    await p.query('SELECT 2 AS two')
    await endAll(p)
    await removed(3)
    return log
  }
  const [fromEdge, fromPg] = await Promise.all([run(track(edgePool(proxy.port, { max: 2 }))), run(track(new pg.Pool({ ...pgConfig(), max: 2 })))])
  assert.ok(fromPg.some((e) => Array.isArray(e) && e[0] === 'error' && (e[1] as any).code === '57P01'), 'pg.Pool emits error for the terminated idle client')
  same(fromEdge, fromPg, 'pool events: edgepg Pool vs pg.Pool')
})

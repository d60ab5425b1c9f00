/**
 * httpSql (src/http.ts): SQL over HTTP in Neon's protocol, against edgepg-proxy's POST /sql.
 *
 * Unit tests first (template composition, parameter serialisation against pg's own, the request
 * as sent, parsing by OID, error shapes) with a custom `fetch`; then, against the real endpoint:
 * the parity corpus (fullResults deep-equal to pg over TCP), transactions, errors field for field,
 * network/HTTP/abort failures, authToken at the server, Pool.query over HTTP, and round trips
 * behind a 100 ms delay relay.
 *
 * The endpoint is edgepg-proxy's own POST /sql route.
 */
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import http from 'node:http'
import { inspect } from 'node:util'
import pg from 'pg'
// @ts-ignore: pg's internal modules ship no type declarations
import pgUtils from 'pg/lib/utils.js'
import { httpSql, HttpQuery, HttpSqlError, DatabaseError, Pool, types, defaults, type HttpSqlOptions } from '../src/index'
import { prepareValue, poolQueryViaHttp } from '../src/http'
import { config as globalConfig, webSocketUrl } from '../src/config'
import { startProxy, pgConfig, testPostgres, edgeConfig, same } from './support/helpers'
import { PASSWORD, freePort } from './support/stack'
import { buildCorpus, setupSql, teardownSql, uniqueSchema, type CorpusEntry } from './support/corpus'
import { startDelayRelay } from './support/delay-relay'

const PgResult = (pg as any).Result
const schema = uniqueSchema('edgepg_http')
const corpus = buildCorpus(schema)

// ── helpers ─────────────────────────────────────────────────────────────────────────────────

type Closer = { close(): Promise<void> | void }
const closers: Closer[] = []

/** The /sql endpoint under test: edgepg-proxy's. */
let endpoint: { port: number; url: string; via: string }
let admin: pg.Client
let tcp: pg.Client

const connectionString = () => {
  const info = testPostgres()
  return `postgresql://scram_user:${encodeURIComponent(PASSWORD)}@${info.host}:${info.port}/${info.database}`
}

async function listen(server: http.Server): Promise<number> {
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
  return (server.address() as { port: number }).port
}

const closeServer = (server: http.Server) => () =>
  new Promise<void>((resolve) => {
    server.closeAllConnections()
    server.close(() => resolve())
  })

/** edgepg-proxy's own POST /sql route. */
async function startEndpoint() {
  const proxy = await startProxy()
  closers.push(proxy)
  return { port: proxy.port, url: `http://127.0.0.1:${proxy.port}/sql`, via: 'createProxy' }
}

/** An httpSql against the test endpoint. */
const sqlFor = (extra: HttpSqlOptions = {}) => httpSql(connectionString(), { fetchEndpoint: endpoint.url, ...extra })

/** A fetch that records requests and answers with `respond` (no network). */
function fakeFetch(respond: (body: any, headers: Headers, url: string) => Response | Promise<Response> = () => json(result([]))) {
  const calls: Array<{ url: string; headers: Headers; body: any; init: RequestInit }> = []
  const fn = async (url: string, init: RequestInit) => {
    const headers = new Headers(init.headers)
    const body = JSON.parse(String(init.body))
    calls.push({ url, headers, body, init })
    return respond(body, headers, url)
  }
  return Object.assign(fn, { calls })
}

const json = (body: unknown, status = 200) => new Response(JSON.stringify(body), { status, headers: { 'content-type': 'application/json' } })
const field = (name: string, dataTypeID: number) => ({ name, dataTypeID, tableID: 0, columnID: 0, dataTypeSize: -1, dataTypeModifier: -1, format: 'text' })
function result(rows: unknown[][], fields = [field('a', 23)], command = 'SELECT') {
  return { command, rowCount: rows.length, rowAsArray: true, fields, rows }
}

/** pg's result, reduced to what the parity tests compare (as test/parity.test.ts does). */
function normResult(r: any): unknown {
  if (Array.isArray(r)) return r.map(normResult)
  return { command: r.command, rowCount: r.rowCount, oid: r.oid, rows: r.rows, fields: r.fields, rowAsArray: r.rowAsArray }
}

/** An error: class, name, message and own enumerable fields (`length`, the wire size, is not carried over HTTP). */
function normError(e: any): Record<string, unknown> {
  const out: Record<string, unknown> = { class: e?.constructor?.name, name: e?.name, message: e?.message }
  for (const key of Object.keys(e ?? {})) if (key !== 'client' && key !== 'length') out[key] = e[key]
  return out
}

type Outcome = { result: unknown } | { error: Record<string, unknown> }
async function outcome(run: () => Promise<unknown>): Promise<Outcome> {
  try {
    return { result: normResult(await run()) }
  } catch (err) {
    return { error: normError(err) }
  }
}

async function rejection(promise: Promise<unknown>, label: string): Promise<any> {
  try {
    await promise
  } catch (err) {
    return err
  }
  assert.fail(`${label}: expected a rejection`)
}

before(async () => {
  endpoint = await startEndpoint()
  admin = new pg.Client(pgConfig('trust_user'))
  await admin.connect()
  await admin.query(setupSql(schema))
  tcp = new pg.Client(pgConfig())
  await tcp.connect()
})

after(async () => {
  await tcp?.end().catch(() => {})
  if (admin) {
    await admin.query(teardownSql(schema)).catch(() => {})
    await admin.end().catch(() => {})
  }
  for (const c of closers.splice(0).reverse()) await c.close()
})

// ── templates ───────────────────────────────────────────────────────────────────────────────

test('templates: values become $n parameters, never SQL text', () => {
  const sql = httpSql('postgres://u:p@h/db')
  const evil = "1; DROP TABLE users; --"
  const q = sql`SELECT * FROM t WHERE id = ${evil} AND n IN (${1}, ${2n}) AND tags = ${['a', 'b']}`
  assert.ok(q instanceof HttpQuery, 'sql`` gives an HttpQuery')
  assert.deepEqual(q.toQuery(), { text: 'SELECT * FROM t WHERE id = $1 AND n IN ($2, $3) AND tags = $4', values: [evil, 1, 2n, ['a', 'b']] })
  assert.deepEqual(sql`SELECT 1`.toQuery(), { text: 'SELECT 1', values: [] })
  assert.deepEqual(sql`${1}${2}`.toQuery(), { text: '$1$2', values: [1, 2] })
})

test('templates compose: nested fragments inline, their parameters renumbered', () => {
  const sql = httpSql('postgres://u:p@h/db')
  const byId = (id: number) => sql`id = ${id}`
  const where = sql`WHERE ${byId(7)} AND name = ${'x'} AND ${sql`deep = ${sql`${true}`} AND ${sql``}TRUE`}`
  const q = sql`SELECT ${'a'} FROM t ${where} ORDER BY ${sql.unsafe('created_at DESC')} LIMIT ${10}`
  assert.deepEqual(q.toQuery(), {
    text: 'SELECT $1 FROM t WHERE id = $2 AND name = $3 AND deep = $4 AND TRUE ORDER BY created_at DESC LIMIT $5',
    values: ['a', 7, 'x', true, 10],
  })
  // the same fragment twice: numbered afresh at each place
  const f = sql`x = ${1}`
  assert.deepEqual(sql`${f} OR ${f}`.toQuery(), { text: 'x = $1 OR x = $2', values: [1, 1] })
  // a fragment is unaffected by being nested
  assert.deepEqual(where.toQuery(), { text: 'WHERE id = $1 AND name = $2 AND deep = $3 AND TRUE', values: [7, 'x', true] })
  // sql.unsafe is raw text, also on its own
  assert.deepEqual(sql.unsafe('SELECT 1').toQuery(), { text: 'SELECT 1', values: [] })
  // sql.query keeps its text and parameters as given
  assert.deepEqual(sql.query('SELECT $1, $2', [1, null]).toQuery(), { text: 'SELECT $1, $2', values: [1, null] })
})

test('templates: misuse is refused with a message saying what to do', () => {
  const sql = httpSql('postgres://u:p@h/db')
  assert.throws(() => (sql as any)('SELECT 1'), /tagged template.*sql\.query/)
  assert.throws(() => sql`SELECT ${sql.query('SELECT $1', [1])}`.toQuery(), /cannot be nested/)
  assert.throws(() => httpSql('mysql://u:p@h/db'), /postgres:\/\//)
  assert.throws(() => httpSql('not a url'), /not a valid postgres:\/\/ URL/)
  assert.throws(() => httpSql({ user: 'u', password: 'secret-pw', database: 'db' }), (err: Error) => /no host/.test(err.message) && !err.message.includes('secret-pw'))
  assert.throws(() => httpSql('postgres://u:secret-pw@/db'), (err: Error) => /not a valid/.test(err.message) && !err.message.includes('secret-pw'))
  return assert.rejects(sql.transaction([sql`SELECT 1`, 'SELECT 2' as any]), /takes an array of queries/)
})

test('queries are lazy and run once: nothing is sent until awaited', async () => {
  const fetch = fakeFetch()
  const sql = httpSql('postgres://u:p@h/db', { fetch })
  const q = sql`SELECT ${1}`
  sql`SELECT 2` // never awaited: never sent
  await new Promise((r) => setTimeout(r, 10))
  assert.equal(fetch.calls.length, 0, 'nothing sent before await')
  await q
  await q
  await q.then((rows) => rows)
  assert.equal(fetch.calls.length, 1, 'one request however often it is awaited')
  assert.equal(Object.prototype.toString.call(q), '[object HttpQuery]', 'toStringTag')
  await Promise.all([sql`SELECT 3`, sql`SELECT 4`])
  assert.equal(fetch.calls.length, 3, 'Promise.all runs both')
})

// ── parameters: pg's serialisation ──────────────────────────────────────────────────────────

class Point {
  constructor(readonly x: number, readonly y: number) {}
  toPostgres() {
    return `(${this.x},${this.y})`
  }
}
class Wrapper {
  constructor(readonly inner: unknown) {}
  toPostgres(prepare: (v: unknown) => unknown) {
    return prepare(this.inner)
  }
}

/** Every JS kind a parameter can be, and combinations pg treats specially. */
function jsKinds(): Array<[string, unknown]> {
  return [
    ['null', null],
    ['undefined', undefined],
    ['string', 'héllo "q" \\ \n'],
    ['empty string', ''],
    ['integer', 42],
    ['negative float', -1.5e-7],
    ['big number', 1e21],
    ['NaN', NaN],
    ['Infinity', -Infinity],
    ['bigint', 123456789012345678901234567890n],
    ['true', true],
    ['false', false],
    ['Date', new Date(Date.UTC(2024, 0, 2, 3, 4, 5, 678))],
    ['Date (epoch)', new Date(0)],
    ['Date (year 5)', new Date(Date.UTC(5, 5, 5, 5, 5, 5, 5))],
    ['Date (BC)', new Date(Date.UTC(-43, 2, 15, 12))],
    ['Date (far future)', new Date(Date.UTC(275000, 0, 1))],
    ['Buffer', Buffer.from([0, 1, 127, 128, 255, 92, 39, 34])],
    ['empty Buffer', Buffer.alloc(0)],
    ['Uint8Array', new Uint8Array([9, 8, 7, 0, 255])],
    ['Uint8Array view with offset', new Uint8Array(new Uint8Array([1, 2, 3, 4, 5]).buffer, 1, 3)],
    ['Int16Array', new Int16Array([1, -1, 256])],
    ['DataView', new DataView(new Uint8Array([10, 20, 30]).buffer, 1)],
    ['flat array', [1, 2, 3]],
    ['array with nulls', [1, null, undefined, 4]],
    ['nested array with nulls', [[1, null], [null, 4]]],
    ['empty array', []],
    ['array of strings needing quotes', ['a', 'b,c', 'd"e', 'back\\slash', '{braces}', 'NULL', '', ' sp ']],
    ['array of Buffers', [Buffer.from('hi'), null, new Uint8Array([0, 255])]],
    ['array of Dates', [new Date(Date.UTC(2024, 0, 1)), null]],
    ['array of objects', [{ a: 1 }, { b: [2, null] }]],
    ['array of booleans and bigints', [true, false, 10n]],
    ['deep nested', [[[1, 2], [3]], [[null]]]],
    ['object', { a: 1, s: 'ü ✓', n: null, list: [1, 'two', null], nested: { deep: {} } }],
    ['empty object', {}],
    ['object with toJSON', { toJSON: () => ({ replaced: true }) }],
    ['toPostgres', new Point(1.5, -2)],
    ['toPostgres returning via prepareValue', new Wrapper([1, new Date(0)])],
    ['toPostgres in an array', [new Point(0, 0), new Point(1, 1)]],
    ['array inside toPostgres inside array', [new Wrapper(['x', null])]],
  ]
}

/** pg's prepareValue output in the text form HTTP carries (pg sends Buffers as binary; bytea hex is their text). */
const pgText = (v: unknown) => {
  const out = pgUtils.prepareValue(v)
  return Buffer.isBuffer(out) ? '\\x' + out.toString('hex') : out
}

test('prepareValue: same text as pg for every JS kind, in several time zones and with parseInputDatesAsUTC', () => {
  const tz = process.env.TZ
  const asUTC = defaults.parseInputDatesAsUTC
  try {
    for (const zone of ['UTC', 'America/St_Johns', 'Asia/Kolkata', 'Pacific/Kiritimati', 'Europe/Berlin']) {
      process.env.TZ = zone
      for (const utc of [false, true]) {
        defaults.parseInputDatesAsUTC = utc
        for (const [kind, value] of jsKinds()) same(prepareValue(value), pgText(value), `${kind} (TZ=${zone}, parseInputDatesAsUTC=${utc})`)
      }
    }
  } finally {
    process.env.TZ = tz
    if (tz === undefined) delete process.env.TZ
    defaults.parseInputDatesAsUTC = asUTC
  }
  // a circular toPostgres fails as pg's does
  const loop: any = { toPostgres: () => loop }
  assert.throws(() => pgUtils.prepareValue(loop), /circular reference/)
  assert.throws(() => prepareValue(loop), /circular reference/)
})

test('prepareValue: an invalid Date serialises as pg serialises it', () => {
  const warn = process.emitWarning
  process.emitWarning = () => {} // pg's deprecation notice
  try {
    same(prepareValue(new Date(NaN)), pgText(new Date(NaN)), 'invalid Date')
  } finally {
    process.emitWarning = warn
  }
})

// ── the request ─────────────────────────────────────────────────────────────────────────────

test("request: Neon's headers and body; endpoint https://<host>/sql by default", async () => {
  const fetch = fakeFetch()
  const sql = httpSql('postgresql://us%40er:p%2Fw@db.example.com:6543/my%20db?sslmode=require', { fetch })
  await sql`SELECT ${1}::int, ${null}, ${Buffer.from([1, 2])}, ${[1, 2]}, ${{ a: 1 }}`
  const [call] = fetch.calls
  assert.equal(call.url, 'https://db.example.com/sql', 'default endpoint: the host, port dropped')
  assert.equal(call.init.method, 'POST', 'POST')
  assert.equal(call.headers.get('neon-connection-string'), 'postgresql://us%40er:p%2Fw@db.example.com:6543/my%20db?sslmode=require', 'connection string as given')
  assert.equal(call.headers.get('neon-raw-text-output'), 'true', 'raw text output')
  assert.equal(call.headers.get('neon-array-mode'), 'true', 'array mode')
  assert.equal(call.headers.get('authorization'), null, 'no Authorization without authToken')
  assert.equal(call.headers.get('neon-batch-isolation-level'), null, 'no batch headers on a single query')
  assert.deepEqual(call.body, { query: 'SELECT $1::int, $2, $3, $4, $5', params: ['1', null, '\\x0102', '{"1","2"}', '{"a":1}'] })
})

test('request: fetchEndpoint (string or function), connection options override the URL, fetchOptions merge', async () => {
  const fetch = fakeFetch()
  const controller = new AbortController()
  const a = httpSql('postgres://u:p@h:5433/db', { fetch, fetchEndpoint: (host, port) => `http://proxy.local/${host}/${port}/sql` })
  await a`SELECT 1`
  assert.equal(fetch.calls[0].url, 'http://proxy.local/h/5433/sql', 'fetchEndpoint function gets host and port')
  const b = httpSql({ connectionString: 'postgres://u:p@h/db', user: 'other', password: 'pw with space', host: 'h2', port: 7000, database: 'd/b', fetch, fetchEndpoint: 'http://fixed/sql' })
  await b.query('SELECT 1', [], { fetchOptions: { signal: controller.signal, headers: { 'x-trace': 't1', 'Neon-Array-Mode': 'false' } } })
  const call = fetch.calls[1]
  assert.equal(call.url, 'http://fixed/sql', 'fetchEndpoint string')
  assert.equal(call.headers.get('neon-connection-string'), 'postgres://other:pw%20with%20space@h2:7000/d%2Fb', 'options override the URL, percent-encoded')
  assert.equal(call.headers.get('x-trace'), 't1', 'fetchOptions headers are added')
  assert.equal(call.headers.get('neon-array-mode'), 'true', "the protocol's own headers win")
  assert.equal(call.init.signal, controller.signal, 'fetchOptions.signal is passed on')
  // options alone, a password function called per request
  let n = 0
  const c = httpSql({ host: 'h3', user: 'u', database: 'd', password: async () => `pw${++n}`, fetch })
  await c`SELECT 1`
  await c`SELECT 2`
  assert.deepEqual(fetch.calls.slice(2).map((x) => [x.url, x.headers.get('neon-connection-string')]), [
    ['https://h3/sql', 'postgresql://u:pw1@h3/d'],
    ['https://h3/sql', 'postgresql://u:pw2@h3/d'],
  ])
})

test('request: authToken (string or function, per call) as a bearer token; batch headers', async () => {
  const fetch = fakeFetch((body) => json(body.queries ? { results: body.queries.map(() => result([])) } : result([])))
  let n = 0
  const sql = httpSql('postgres://u:p@h/db', { fetch, authToken: () => `jwt-${++n}`, isolationLevel: 'RepeatableRead' })
  await sql`SELECT 1`
  await sql.query('SELECT 1', [], { authToken: 'per-call' })
  await sql.transaction([sql`SELECT 1`, sql`SELECT 2`], { readOnly: true, deferrable: false })
  await sql.transaction([sql`SELECT 1`], { isolationLevel: 'Serializable', deferrable: true, authToken: async () => 'async-token' })
  const h = fetch.calls.map((c) => c.headers)
  assert.deepEqual(h.map((x) => x.get('authorization')), ['Bearer jwt-1', 'Bearer per-call', 'Bearer jwt-2', 'Bearer async-token'])
  assert.equal(h[0].get('neon-batch-isolation-level'), null, 'no isolation header for a single query')
  assert.deepEqual([h[2].get('neon-batch-isolation-level'), h[2].get('neon-batch-read-only'), h[2].get('neon-batch-deferrable')], ['RepeatableRead', 'true', 'false'])
  assert.deepEqual([h[3].get('neon-batch-isolation-level'), h[3].get('neon-batch-read-only'), h[3].get('neon-batch-deferrable')], ['Serializable', null, 'true'])
  assert.deepEqual(fetch.calls[2].body, { queries: [{ query: 'SELECT 1', params: [] }, { query: 'SELECT 2', params: [] }] })
  const failing = httpSql('postgres://u:p@h/db', { fetch, authToken: () => { throw new Error('no session') } })
  const err = await rejection(failing`SELECT 1`, 'authToken that throws')
  assert.ok(err instanceof HttpSqlError && /authToken\(\) failed: no session/.test(err.message), `authToken failure says so: ${err.message}`)
})

// ── results: parsed by OID, shapes ──────────────────────────────────────────────────────────

test('results: rows by default, arrayMode, fullResults (a pg Result), at every level', async () => {
  const fields = [field('id', 23), field('big', 20), field('t', 1184), field('x', 23), field('x', 25)]
  const row = ['1', '9007199254740993', '2024-01-02 03:04:05.678+00', '5', 'last']
  const fetch = fakeFetch((body) => json(body.queries ? { results: body.queries.map(() => result([row], fields)) } : result([row], fields)))
  const sql = httpSql('postgres://u:p@h/db', { fetch })
  const expectObj = { id: 1, big: '9007199254740993', t: new Date('2024-01-02T03:04:05.678Z'), x: 'last' }
  assert.deepEqual(await sql`SELECT`, [expectObj])
  assert.deepEqual(await sql.query('SELECT', [], { arrayMode: true }), [[1, '9007199254740993', new Date('2024-01-02T03:04:05.678Z'), 5, 'last']])
  const full = await sql.query('SELECT', [], { fullResults: true })
  assert.ok(full instanceof PgResult, 'fullResults is a pg Result')
  assert.equal(full.fields[0].constructor.name, 'Field', "fields are pg-protocol's Field")
  assert.deepEqual(normResult(full), { command: 'SELECT', rowCount: 1, oid: null, rows: [expectObj], fields: full.fields, rowAsArray: false })
  const arrays = httpSql('postgres://u:p@h/db', { fetch, arrayMode: true, fullResults: true })
  const r = await arrays`SELECT`
  assert.equal(r.rowAsArray, true, 'httpSql-level arrayMode')
  assert.deepEqual(await arrays.query('SELECT', [], { arrayMode: false, fullResults: false }), [expectObj], 'per-call options override')
  // transaction: per-query options, then the transaction's, then httpSql's
  const [a, b, c] = await sql.transaction((tx) => [tx`SELECT`, tx.query('SELECT', [], { arrayMode: true }), tx.query('SELECT', [], { fullResults: false })], { fullResults: true })
  assert.ok(a instanceof PgResult && !a.rowAsArray, 'transaction-level fullResults')
  assert.ok(b instanceof PgResult && b.rowAsArray, 'per-query arrayMode inside a transaction')
  assert.deepEqual(c, [expectObj], 'per-query fullResults: false inside a transaction')
  // a query keeps the options of the sql`` that made it (as its type says), under the transaction's
  const [d, e] = await sql.transaction([arrays`SELECT`, sql`SELECT`])
  assert.ok(d instanceof PgResult && d.rowAsArray, "a query from another httpSql keeps that httpSql's options")
  assert.deepEqual(e, [expectObj], "and this httpSql's own queries keep its options")
  const [f] = await sql.transaction([arrays`SELECT`], { fullResults: false, arrayMode: false })
  assert.deepEqual(f, [expectObj], "the transaction's options win over the query's httpSql defaults")
  // INSERT's oid (Postgres ≥ 12 always tags 0), commands without a tag, empty queries
  const insert = await httpSql('postgres://u:p@h/db', { fetch: fakeFetch(() => json({ command: 'INSERT', rowCount: 2, rowAsArray: true, fields: [], rows: [] })) }).query('INSERT', [], { fullResults: true })
  assert.deepEqual([insert.command, insert.rowCount, insert.oid], ['INSERT', 2, 0])
  const empty = await httpSql('postgres://u:p@h/db', { fetch: fakeFetch(() => json({ command: '', rowCount: null, rowAsArray: true, fields: [], rows: [] })) }).query('', [], { fullResults: true })
  assert.deepEqual([empty.command, empty.rowCount, empty.oid, empty.rows], [null, null, null, []])
})

test('results: type parsers by OID — pg global parsers, types option at httpSql, query and transaction level', async () => {
  const fields = [field('big', 20), field('n', 1700), field('i', 23)]
  const fetch = fakeFetch((body) => json(body.queries ? { results: body.queries.map(() => result([['5', '1.5', '7']], fields)) } : result([['5', '1.5', '7']], fields)))
  const tagged = (tag: string) => ({ getTypeParser: (oid: number) => (v: string) => `${tag}:${oid}:${v}` })
  const sql = httpSql('postgres://u:p@h/db', { fetch })
  assert.deepEqual(await sql`x`, [{ big: '5', n: '1.5', i: 7 }], "pg's default parsers")
  const int8 = types.getTypeParser(20)
  types.setTypeParser(20, (v: string) => BigInt(v))
  try {
    assert.deepEqual(await sql`x`, [{ big: 5n, n: '1.5', i: 7 }], 'types.setTypeParser (global) applies')
  } finally {
    types.setTypeParser(20, int8)
  }
  const own = httpSql('postgres://u:p@h/db', { fetch, types: tagged('sql') })
  assert.deepEqual(await own`x`, [{ big: 'sql:20:5', n: 'sql:1700:1.5', i: 'sql:23:7' }], 'httpSql-level types')
  assert.deepEqual(await own.query('x', [], { types: tagged('q') }), [{ big: 'q:20:5', n: 'q:1700:1.5', i: 'q:23:7' }], 'query-level types win')
  const [t1, t2] = await own.transaction([own`x`, own.query('x', [], { types: tagged('inner') })], { types: tagged('tx') })
  assert.deepEqual(t1, [{ big: 'tx:20:5', n: 'tx:1700:1.5', i: 'tx:23:7' }], 'transaction-level types')
  assert.deepEqual(t2, [{ big: 'inner:20:5', n: 'inner:1700:1.5', i: 'inner:23:7' }], "a query's own types win inside a transaction")
})

test('errors: HTTP 400 with a SQLSTATE is a pg DatabaseError with every field; other failures are HttpSqlErrors saying what failed', async () => {
  const pgFields = { message: 'boom', code: '22012', severity: 'ERROR', detail: 'd', hint: 'h', position: 8, internalPosition: null, internalQuery: null, where: 'w', schema: 's', table: 't', column: 'c', dataType: 'dt', constraint: 'k', file: 'f.c', line: '1', routine: 'r' }
  const sql = (respond: () => Response) => httpSql('postgres://u:secret@h/db', { fetch: fakeFetch(respond), fetchEndpoint: 'http://x/sql' })
  const dbErr = await rejection(sql(() => json(pgFields, 400))`SELECT 1/0`, 'database error')
  assert.ok(dbErr instanceof DatabaseError, 'a pg DatabaseError (instanceof works)')
  assert.deepEqual(normError(dbErr), {
    class: 'DatabaseError', name: 'error', message: 'boom', severity: 'ERROR', code: '22012', detail: 'd', hint: 'h', position: '8', internalPosition: undefined, internalQuery: undefined,
    where: 'w', schema: 's', table: 't', column: 'c', dataType: 'dt', constraint: 'k', file: 'f.c', line: '1', routine: 'r',
  })
  const cases: Array<[string, () => Response, RegExp, number | undefined]> = [
    ['403 with a JSON message', () => json({ message: 'host x is not an allowed upstream', code: null }, 403), /^edgepg: POST http:\/\/x\/sql answered HTTP 403: host x is not an allowed upstream$/, 403],
    ['400 without SQLSTATE (a bad request)', () => json({ message: 'request body is not valid JSON', code: null, severity: null }, 400), /answered HTTP 400: request body is not valid JSON/, 400],
    ['502 with a text body', () => new Response('upstream down\n', { status: 502, statusText: 'Bad Gateway' }), /answered HTTP 502 Bad Gateway: upstream down$/, 502],
    ['500 with no body', () => new Response('', { status: 500 }), /answered HTTP 500: \(empty body\)/, 500],
    ['200 that is not JSON', () => new Response('<html>hello</html>'), /answered with something that is not a query result: <html>hello<\/html>/, 200],
    ['200 JSON of another shape', () => json({ hello: 1 }), /not a query result/, 200],
  ]
  for (const [label, respond, pattern, status] of cases) {
    const err = await rejection(sql(respond)`SELECT 1`, label)
    assert.ok(err instanceof HttpSqlError, `${label}: HttpSqlError, got ${err}`)
    assert.match(err.message, pattern, label)
    assert.equal(err.status, status, `${label}: status`)
    assert.equal(err.url, 'http://x/sql', `${label}: url`)
    assert.ok(!err.message.includes('secret'), `${label}: no password in the message`)
  }
  const thrown = await rejection(sql(() => { throw new TypeError('fetch failed', { cause: new Error('getaddrinfo ENOTFOUND x') }) })`SELECT 1`, 'fetch throws')
  assert.ok(thrown instanceof HttpSqlError, 'network failure is an HttpSqlError')
  assert.equal(thrown.message, 'edgepg: POST http://x/sql failed: fetch failed (getaddrinfo ENOTFOUND x)')
  assert.equal((thrown.cause as Error).message, 'fetch failed', 'the original error is the cause')
  const batch = await rejection(sql(() => json({ results: [result([])] })).transaction((tx) => [tx`SELECT 1`, tx`SELECT 2`]), 'short batch')
  assert.match(batch.message, /not 2 query results/, 'a batch answer with the wrong count')
})

// ── against the endpoint ────────────────────────────────────────────────────────────────────

/** Corpus entries that are one statement each: the HTTP protocol runs one statement per query (extended protocol). */
const singleStatement = (e: CorpusEntry) => !e.name.startsWith('multi-statement')

test(`corpus over HTTP: fullResults deep-equal to pg over TCP (single-statement entries)`, async (t) => {
  const sql = sqlFor()
  const entries = corpus.filter(singleStatement)
  assert.ok(entries.length >= corpus.length - 6, `most of the corpus applies (${entries.length} of ${corpus.length})`)
  for (const entry of entries) {
    await t.test(entry.name, async () => {
      const config: any = { text: entry.text }
      if ('values' in entry) config.values = entry.values
      if (entry.rowMode) config.rowMode = entry.rowMode
      if (entry.types) config.types = entry.types
      const expected = await outcome(() => tcp.query(config))
      assert.ok(entry.error ? 'error' in expected : 'result' in expected, `${entry.name}: pg over TCP gave ${inspect(expected).slice(0, 300)}`)
      const got = await outcome(() => sql.query(entry.text, entry.values ?? [], { fullResults: true, arrayMode: entry.rowMode === 'array', types: entry.types }))
      same(got, expected, `${entry.name}: httpSql differs from pg over TCP`)
    })
  }
})

test('corpus over HTTP: a multi-statement string fails (one statement per query), as on Neon', async () => {
  const err = await rejection(sqlFor().query('SELECT 1; SELECT 2'), 'multi-statement')
  assert.ok(err instanceof DatabaseError && err.code === '42601', `42601, got ${err}`)
  assert.match(err.message, /cannot insert multiple commands into a prepared statement/)
})

test('tagged templates against Postgres: parameters typed by the server, rows parsed like pg', async () => {
  const sql = sqlFor()
  const when = new Date(Date.UTC(2024, 0, 2, 3, 4, 5, 678))
  const rows = await sql`SELECT ${1}::int AS i, ${'x'}::text AS t, ${when}::timestamptz AS d, ${Buffer.from([0, 255])}::bytea AS b, ${[1, null, 3]}::int[] AS a, ${{ k: ['v'] }}::jsonb AS j, ${12345678901234567n}::int8 AS big`
  assert.deepEqual(rows, [{ i: 1, t: 'x', d: when, b: Buffer.from([0, 255]), a: [1, null, 3], j: { k: ['v'] }, big: '12345678901234567' }])
  const table = `${schema}.items`
  const byName = (name: string) => sql`name = ${name}`
  const got = await sql<{ id: number; name: string }>`SELECT id, name FROM ${sql.unsafe(table)} WHERE ${byName('widget')} OR ${byName("x'; DROP TABLE x; --")} ORDER BY id`
  assert.deepEqual(got, [{ id: 1, name: 'widget' }])
})

test('transaction: one request, results in order, all-or-nothing', async () => {
  const sql = sqlFor()
  const kv = `${schema}.kv`
  const key = (k: string) => `tx-http-${k}`
  const ok = await sql.transaction((tx) => [
    tx`INSERT INTO ${tx.unsafe(kv)} VALUES (${key('a')}, ${'1'})`,
    tx`INSERT INTO ${tx.unsafe(kv)} VALUES (${key('b')}, ${'2'}) RETURNING k`,
    tx`UPDATE ${tx.unsafe(kv)} SET v = v || '!' WHERE k LIKE ${key('%')}`,
    tx.query(`SELECT k, v FROM ${kv} WHERE k LIKE $1 ORDER BY k`, [key('%')], { arrayMode: true }),
    tx`SELECT count(*)::int AS n FROM ${tx.unsafe(kv)} WHERE k LIKE ${key('%')}`,
  ])
  assert.deepEqual(ok, [[], [{ k: key('b') }], [], [[key('a'), '1!'], [key('b'), '2!']], [{ n: 2 }]])
  const committed = async () => (await admin.query(`SELECT k, v FROM ${kv} WHERE k LIKE $1 ORDER BY k`, [key('%')])).rows
  assert.deepEqual(await committed(), [{ k: key('a'), v: '1!' }, { k: key('b'), v: '2!' }])

  // an error in the 4th statement: nothing of the first three stays
  const err = await rejection(
    sql.transaction([
      sql`DELETE FROM ${sql.unsafe(kv)} WHERE k = ${key('a')}`,
      sql`INSERT INTO ${sql.unsafe(kv)} VALUES (${key('c')}, 'c')`,
      sql`UPDATE ${sql.unsafe(kv)} SET v = 'changed' WHERE k = ${key('b')}`,
      sql`INSERT INTO ${sql.unsafe(kv)} VALUES (${key('b')}, 'duplicate')`,
      sql`SELECT 1`,
    ]),
    'failing transaction'
  )
  assert.ok(err instanceof DatabaseError && err.code === '23505', `unique violation, got ${err}`)
  assert.deepEqual(await committed(), [{ k: key('a'), v: '1!' }, { k: key('b'), v: '2!' }], 'rolled back entirely')

  // fullResults for the whole transaction
  const full = await sql.transaction([sql`DELETE FROM ${sql.unsafe(kv)} WHERE k LIKE ${key('%')}`, sql`SELECT 1 AS one`], { fullResults: true })
  assert.deepEqual(full.map((r: any) => [r.command, r.rowCount, r.rows]), [['DELETE', 2, []], ['SELECT', 1, [{ one: 1 }]]])
  assert.deepEqual(await committed(), [])
  assert.deepEqual(await sql.transaction([]), [], 'an empty transaction sends nothing')
})

test('transaction options: isolationLevel, readOnly, deferrable reach Postgres', async () => {
  const sql = sqlFor()
  const show = (tx: typeof sql) => [tx`SHOW transaction_isolation`, tx`SHOW transaction_read_only`, tx`SHOW transaction_deferrable`]
  const settings = async (opts: any) => (await sql.transaction(show, opts)).map((rows: any) => Object.values(rows[0])[0])
  assert.deepEqual(await settings({}), ['read committed', 'off', 'off'])
  assert.deepEqual(await settings({ isolationLevel: 'RepeatableRead' }), ['repeatable read', 'off', 'off'])
  assert.deepEqual(await settings({ isolationLevel: 'Serializable', readOnly: true, deferrable: true }), ['serializable', 'on', 'on'])
  const viaDefaults = sqlFor({ isolationLevel: 'Serializable', readOnly: true })
  assert.deepEqual((await viaDefaults.transaction(show)).map((rows: any) => Object.values(rows[0])[0]), ['serializable', 'on', 'off'], 'httpSql-level transaction defaults')
  const err = await rejection(sql.transaction([sql`CREATE TEMP TABLE nope (a int)`], { readOnly: true }), 'write in a read-only transaction')
  assert.ok(err instanceof DatabaseError && err.code === '25006', `read-only violation, got ${err}`)
})

test('errors from Postgres: the same DatabaseError as pg over TCP, field for field', async () => {
  const sql = sqlFor()
  for (const entry of corpus.filter((e) => e.error && singleStatement(e))) {
    const expected = await outcome(() => tcp.query({ text: entry.text, values: entry.values } as any))
    const got = await outcome(() => sql.query(entry.text, entry.values ?? []))
    same(got, expected, entry.name)
    assert.ok('error' in got && got.error.class === 'DatabaseError', `${entry.name}: a DatabaseError`)
  }
  const wrongPassword = httpSql(connectionString().replace(encodeURIComponent(PASSWORD), 'wrong'), { fetchEndpoint: endpoint.url })
  const err = await rejection(wrongPassword`SELECT 1`, 'wrong password')
  assert.ok(err instanceof DatabaseError && err.code === '28P01', `28P01, got ${err}`)
  const tcpErr = await rejection(new pg.Client({ ...pgConfig(), password: 'wrong' }).connect(), 'wrong password over TCP')
  same(normError(err), normError(tcpErr), 'wrong password: same error as pg')
})

test('network and HTTP errors say what failed', async () => {
  const closed = await freePort()
  const refused = await rejection(httpSql(connectionString(), { fetchEndpoint: `http://127.0.0.1:${closed}/sql` })`SELECT 1`, 'closed port')
  assert.ok(refused instanceof HttpSqlError, `HttpSqlError, got ${refused}`)
  assert.match(refused.message, new RegExp(`^edgepg: POST http://127\\.0\\.0\\.1:${closed}/sql failed: fetch failed \\(.*ECONNREFUSED`))
  assert.equal(refused.status, undefined, 'no status: never answered')

  const forbidden = await rejection(httpSql('postgres://u:p@10.1.2.3:5432/db', { fetchEndpoint: endpoint.url })`SELECT 1`, 'host not allowed')
  assert.ok(forbidden instanceof HttpSqlError && forbidden.status === 403, `403, got ${forbidden}`)
  assert.match(forbidden.message, /answered HTTP 403 Forbidden: host 10\.1\.2\.3:5432 is not an allowed upstream/)

  const tooLarge = await rejection(sqlFor()`SELECT length(${'x'.repeat(11 << 20)})`, 'request too large')
  assert.ok(tooLarge instanceof HttpSqlError && tooLarge.status === 413, `413, got ${tooLarge}`)
  assert.match(tooLarge.message, /answered HTTP 413 Payload Too Large: request body is too large/)

  const wrongPath = await rejection(httpSql(connectionString(), { fetchEndpoint: endpoint.url.replace('/sql', '/nope') })`SELECT 1`, 'wrong path')
  assert.ok(wrongPath instanceof HttpSqlError && wrongPath.status! >= 400, `an HTTP error, got ${wrongPath}`)
  assert.match(wrongPath.message, /\/nope answered HTTP 4\d\d/)
})

test('fetchOptions.signal aborts the request (and the proxy cancels the statement)', async () => {
  const sql = sqlFor()
  const started = performance.now()
  const timedOut = await rejection(sql.query('SELECT pg_sleep(5)', [], { fetchOptions: { signal: AbortSignal.timeout(200) } }), 'timeout')
  assert.ok(performance.now() - started < 2000, 'aborted promptly')
  assert.ok(timedOut instanceof HttpSqlError, `HttpSqlError, got ${timedOut}`)
  assert.match(timedOut.message, /failed: .*(timeout|aborted)/i)
  assert.equal((timedOut.cause as Error)?.name, 'TimeoutError', 'the abort reason is the cause')

  const controller = new AbortController()
  const pending = sqlFor({ fetchOptions: { signal: controller.signal } })`SELECT pg_sleep(5)`
  setTimeout(() => controller.abort(), 100)
  const aborted = await rejection(pending, 'abort')
  assert.match(aborted.message, /aborted/i)
  // the statement does not keep running on the server
  const deadline = Date.now() + 3000
  let running = 1
  while (running && Date.now() < deadline) {
    running = (await admin.query(`SELECT count(*)::int AS n FROM pg_stat_activity WHERE query = 'SELECT pg_sleep(5)' AND state = 'active'`)).rows[0].n
    if (running) await new Promise((r) => setTimeout(r, 50))
  }
  assert.equal(running, 0, 'the sleeping statement was cancelled')
})

test('authToken arrives at the server as a bearer token; custom fetch is used', async () => {
  // A recording hop in front of the endpoint: keeps each request's headers, forwards it unchanged.
  const seen: http.IncomingHttpHeaders[] = []
  const hop = http.createServer((req, res) => {
    seen.push(req.headers)
    const upstream = http.request({ host: '127.0.0.1', port: endpoint.port, path: req.url, method: req.method, headers: req.headers }, (up) => {
      res.writeHead(up.statusCode ?? 502, up.headers)
      up.pipe(res)
    })
    req.pipe(upstream)
  })
  const port = await listen(hop)
  closers.push({ close: closeServer(hop) })
  let fetched = 0
  const sql = httpSql(connectionString(), {
    fetchEndpoint: `http://127.0.0.1:${port}/sql`,
    authToken: async () => 'token-123',
    fetch: (url, init) => {
      fetched++
      return fetch(url, init)
    },
  })
  assert.deepEqual(await sql`SELECT ${'through the hop'}::text AS v`, [{ v: 'through the hop' }])
  await sql.transaction([sql`SELECT 1`, sql`SELECT 2`])
  assert.equal(fetched, 2, 'the custom fetch made both requests')
  assert.deepEqual(seen.map((h) => h.authorization), ['Bearer token-123', 'Bearer token-123'])
  assert.equal(seen[0]['neon-connection-string'], connectionString(), 'the connection string header')
})

// ── Pool.query over HTTP ────────────────────────────────────────────────────────────────────

/** The lead's wiring of Pool.query, as src/client.ts will have it. */
class HttpPool extends Pool {
  query(config: any, values?: any, callback?: any): any {
    return poolQueryViaHttp(this, config, values, callback) ?? super.query(config, values, callback)
  }
}

test('Pool queryViaHttp: pool.query goes over HTTP with the pool options; session needs keep to WebSockets', async () => {
  const proxy = await startProxy()
  closers.push(proxy)
  let fetched = 0
  const viaFetch = (url: string, init: RequestInit) => {
    fetched++
    return fetch(url, init)
  }
  const options = { ...edgeConfig(proxy.port), queryViaHttp: { fetchEndpoint: endpoint.url, fetch: viaFetch } } as any
  const pool = new HttpPool(options)
  try {
    const res = await pool.query('SELECT $1::int AS n, current_user AS u', [7])
    assert.deepEqual(normResult(res), normResult(await tcp.query('SELECT $1::int AS n, current_user AS u', [7])), 'same Result as pg')
    assert.equal(fetched, 1, 'went over HTTP')
    assert.equal(pool.totalCount, 0, 'no pooled WebSocket connection was opened')
    const arr = await pool.query({ text: 'SELECT 1 AS a, 2 AS b', rowMode: 'array' })
    assert.deepEqual(arr.rows, [[1, 2]], "rowMode 'array'")
    const typed = await pool.query({ text: 'SELECT 5::int8 AS big', types: { getTypeParser: () => (v: string) => BigInt(v) } } as any)
    assert.deepEqual(typed.rows, [{ big: 5n }], 'per-query types')
    const err = await rejection(pool.query('SELECT 1/0'), 'error over HTTP')
    same(normError(err), normError(await rejection(tcp.query('SELECT 1/0'), 'pg')), 'pool.query error: same DatabaseError as pg')
    assert.equal(fetched, 4, 'all over HTTP')

    // these need a session, or a callback: they go over the WebSocket
    const multi = await pool.query('SELECT 1 AS a; SELECT 2 AS b')
    assert.equal((multi as any).length, 2, 'multi-statement over the WebSocket')
    await new Promise<void>((resolve, reject) => pool.query('SELECT 1', (e: Error) => (e ? reject(e) : resolve())))
    assert.equal(fetched, 4, 'multi-statement and callback queries did not use HTTP')
    assert.ok(pool.totalCount > 0, 'they used a pooled connection')
    const onConnect = () => {}
    pool.on('connect', onConnect)
    await pool.query('SELECT 1')
    assert.equal(fetched, 4, "with a 'connect' listener (session setup), pool.query uses the WebSocket")
    pool.off('connect', onConnect)
    await pool.query('SELECT 1')
    assert.equal(fetched, 5, 'back to HTTP once the listener is gone')
  } finally {
    await pool.end()
  }
  const timed = new HttpPool({ ...options, statement_timeout: 1000 })
  await timed.query('SELECT 1')
  assert.equal(fetched, 5, 'statement_timeout (a session setting) keeps the Pool on WebSockets')
  await timed.end()
  const queryTimeout = new HttpPool({ ...options, query_timeout: 100 })
  const timeoutErr = await rejection(queryTimeout.query('SELECT pg_sleep(2)'), 'query_timeout')
  assert.equal(timeoutErr.message, 'Query read timeout', "query_timeout fails as pg's does")
  assert.equal(fetched, 6, 'query_timeout over HTTP')
  await queryTimeout.end()
  const plain = new Pool(edgeConfig(proxy.port))
  assert.equal(poolQueryViaHttp(plain, 'SELECT 1'), undefined, 'a Pool without queryViaHttp → undefined')
  await plain.end()
})

test('Pool queryViaHttp: true: the endpoint is derived from the Pool wsProxy (ws://host:port/v2 → http://host:port/sql)', async () => {
  // wsProxy names the endpoint's server (createProxy's, or the test server); HTTP queries never open the WebSocket
  let fetched = 0
  const counting = (url: string, init: RequestInit) => (fetched++, fetch(url, init))
  const pool = new HttpPool({ ...edgeConfig(endpoint.port), queryViaHttp: { fetch: counting } } as any)
  try {
    const res = await pool.query('SELECT $1::text AS v', ['derived'])
    assert.deepEqual(res.rows, [{ v: 'derived' }], 'answered')
    assert.equal(fetched, 1, 'over HTTP')
    assert.equal(pool.totalCount, 0, 'no WebSocket connection')
  } finally {
    await pool.end()
  }
})

test('Pool queryViaHttp: endpoint from the pool wsProxy, connection options with pg precedence, password function', async () => {
  const fetchFn = fakeFetch(() => json(result([['1']])))
  const base = { webSocketConstructor: class {} as any }
  const cases: Array<[any, string, string]> = [
    [{ host: 'db.example.com', user: 'u', password: 'p', database: 'd' }, 'https://db.example.com/sql', 'postgresql://u:p@db.example.com/d'],
    [{ host: 'h', port: 5433, user: 'u', wsProxy: 'proxy.example.com/edge/v2', useSecureWebSocket: false }, 'http://proxy.example.com/edge/sql', 'postgresql://u@h:5433'],
    [{ connectionString: 'postgres://cu:cp@ch/cd', host: 'ignored', user: 'ignored', wsProxy: (h: string, p: number) => `wss://px.example.com/v2?address=${h}:${p}` }, 'https://px.example.com/sql', 'postgres://cu:cp@ch/cd'],
    [{ connectionString: 'postgres://ch/cd', user: 'fill', password: () => Promise.resolve('fn-pw') }, 'https://ch/sql', 'postgres://fill:fn-pw@ch/cd'],
  ]
  for (const [opts, url, cs] of cases) {
    const pool = new Pool({ ...base, ...opts, queryViaHttp: { fetch: fetchFn } } as any)
    await poolQueryViaHttp(pool, 'SELECT 1')
    const call = fetchFn.calls.at(-1)!
    assert.equal(call.url, url, `endpoint for ${JSON.stringify(opts)}`)
    assert.equal(call.headers.get('neon-connection-string'), cs, `connection string for ${JSON.stringify(opts)}`)
    await pool.end()
  }
  const bad = new Pool({ ...base, connectionString: 'mysql://x/y', queryViaHttp: true } as any)
  const pending = poolQueryViaHttp(bad, 'SELECT 1')
  assert.ok(pending instanceof Promise, 'a bad connection string is reported by a rejected promise, as pool.query does')
  await assert.rejects(pending!, /postgres:\/\//)
  await bad.end()
})

test('a wsProxy without a scheme: ws:// to this machine (where edgepg-proxy serves plain WebSockets), wss:// elsewhere, useSecureWebSocket deciding when set', () => {
  const cases: Array<[string, boolean | undefined, string]> = [
    ['127.0.0.1:8080/v2', undefined, 'ws://127.0.0.1:8080/v2?address=db%3A5432'],
    ['localhost:8080/v2', undefined, 'ws://localhost:8080/v2?address=db%3A5432'],
    ['[::1]:8080/v2', undefined, 'ws://[::1]:8080/v2?address=db%3A5432'],
    ['127.1.2.3/v2', undefined, 'ws://127.1.2.3/v2?address=db%3A5432'],
    ['127.0.0.1.example.com/v2', undefined, 'wss://127.0.0.1.example.com/v2?address=db%3A5432'],
    ['localhost.example.com/v2', undefined, 'wss://localhost.example.com/v2?address=db%3A5432'],
    ['proxy.example.com/v2', undefined, 'wss://proxy.example.com/v2?address=db%3A5432'],
    ['127.0.0.1:8443/v2', true, 'wss://127.0.0.1:8443/v2?address=db%3A5432'],
    ['proxy.internal/v2', false, 'ws://proxy.internal/v2?address=db%3A5432'],
    ['wss://127.0.0.1:8443/v2', undefined, 'wss://127.0.0.1:8443/v2?address=db%3A5432'],
  ]
  for (const [wsProxy, useSecureWebSocket, want] of cases) assert.equal(webSocketUrl('db', 5432, { wsProxy, useSecureWebSocket }), want, `${wsProxy} ${useSecureWebSocket}`)
})

test("httpSql with config.wsProxy set and no fetchEndpoint: the /sql of that proxy, not Neon's https://<host>/sql", async () => {
  const fetchFn = fakeFetch(() => json(result([['1']])))
  const saved = globalConfig.wsProxy
  try {
    globalConfig.wsProxy = '127.0.0.1:8080/v2'
    await httpSql('postgres://u:p@db.example.com/d', { fetch: fetchFn })`SELECT 1`
    assert.equal(fetchFn.calls.at(-1)!.url, 'http://127.0.0.1:8080/sql')
    globalConfig.wsProxy = (host: string) => `wss://edge.example.com/${host}/v2`
    await httpSql('postgres://u:p@db.example.com/d', { fetch: fetchFn })`SELECT 1`
    assert.equal(fetchFn.calls.at(-1)!.url, 'https://edge.example.com/db.example.com/sql')
    globalConfig.wsProxy = undefined
    await httpSql('postgres://u:p@db.example.com/d', { fetch: fetchFn })`SELECT 1`
    assert.equal(fetchFn.calls.at(-1)!.url, 'https://db.example.com/sql', "without wsProxy: Neon's endpoint")
  } finally {
    globalConfig.wsProxy = saved
  }
})

// ── round trips ─────────────────────────────────────────────────────────────────────────────

test('round trips behind a 100 ms delay relay: a warm query takes 1, a 5-statement transaction takes 1', async () => {
  const ONE_WAY_MS = 100
  const relay = await startDelayRelay({ host: '127.0.0.1', port: endpoint.port }, ONE_WAY_MS)
  closers.push(relay)
  const sql = httpSql(connectionString(), { fetchEndpoint: `http://127.0.0.1:${relay.port}/sql` })
  await sql`SELECT 1` // warm-up: TCP connection (kept alive by fetch) and the proxy's pooled connection
  const rounds = async (run: () => Promise<unknown>) => {
    const start = performance.now()
    await run()
    return (performance.now() - start) / relay.rttMs
  }
  const measured: Record<string, number[]> = { query: [], transaction: [] }
  for (let i = 0; i < 3; i++) {
    measured.query.push(await rounds(() => sql`SELECT ${i}::int AS i, now() AS t`))
    measured.transaction.push(
      await rounds(() => sql.transaction((tx) => [tx`SELECT 1`, tx`SELECT ${2}::int`, tx`SELECT now()`, tx`SHOW transaction_isolation`, tx`SELECT ${'five'}::text`], { isolationLevel: 'RepeatableRead' }))
    )
  }
  const diag = JSON.stringify(measured)
  // best of three: a round trip never takes less than the RTT; scheduling noise only adds
  const best = (xs: number[]) => Math.min(...xs)
  assert.ok(best(measured.query) >= 0.9 && best(measured.query) < 1.5, `warm query: 1 round trip (${diag})`)
  assert.ok(best(measured.transaction) >= 0.9 && best(measured.transaction) < 1.5, `5-statement transaction: 1 round trip (${diag})`)
})

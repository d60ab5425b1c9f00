/**
 * Stopping a query: an AbortSignal, or pg's query_timeout, stops the statement on the server, not
 * only the promise, and the connection stays usable. On the package as Node imports it, through
 * the real proxy; what Postgres ran is read from pg_stat_activity and tables over TCP.
 */
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import pg from 'pg'
import { WebSocket } from 'ws'
import { startProxy, pgConfig, edgeConfig, eventually, within, scratchTable } from './support/helpers'
import { startDelayRelay } from './support/delay-relay'

let proxy: Awaited<ReturnType<typeof startProxy>>
let scratch: Awaited<ReturnType<typeof scratchTable>>
let table: string
let edgepg: any

before(async () => {
  proxy = await startProxy()
  edgepg = await import('edgepg' as string)
  scratch = await scratchTable('abort', 'name text NOT NULL')
  table = scratch.name
})
after(async () => {
  await scratch?.drop()
  await proxy?.close()
})

const config = (app: string, extra: object = {}) => ({ ...edgeConfig(proxy.port), webSocketConstructor: WebSocket, application_name: app, ...extra })
/** An edgepg Client for `app`, connected for `use`, ended afterwards whatever happened. */
async function withClient(app: string, use: (client: pg.Client) => Promise<void>, extra: object = {}) {
  const client: pg.Client = new edgepg.Client(config(app, extra))
  await client.connect()
  try {
    await use(client)
  } finally {
    await client.end()
  }
}
/** Statements running now for an application_name, seen from outside. */
const running = async (app: string) =>
  (await scratch.tcp.query(`SELECT query FROM pg_stat_activity WHERE application_name = $1 AND state = 'active'`, [app])).rows.map((r) => r.query)
const rows = async () => (await scratch.tcp.query(`SELECT name FROM ${table} ORDER BY name`)).rows.map((r) => r.name)
const sleeping = (app: string) => eventually(async () => (await running(app)).some((q) => q.includes('pg_sleep')), 'the statement to run')

test('an already-aborted signal: rejects with its reason, and nothing reaches Postgres', async () => {
  await withClient('abort-before', async (client) => {
    const reason = new Error('user went away')
    await assert.rejects(client.query({ text: `INSERT INTO ${table} VALUES ('never')`, signal: AbortSignal.abort(reason) } as any), (err) => err === reason)
    assert.deepEqual((await client.query('SELECT 1 AS one')).rows, [{ one: 1 }], 'the connection is usable')
    assert.deepEqual(await rows(), [])
  })
})

test('aborted while it runs: cancelled on the server, rejects with the reason (an AbortError by default); the connection goes on', async () => {
  const app = 'abort-running'
  await withClient(app, async (client) => {
    const controller = new AbortController()
    const query = client.query({ text: 'SELECT pg_sleep(30)', signal: controller.signal } as any)
    await sleeping(app)
    controller.abort()
    const err: any = await within(5000, 'the rejection', query.then(() => assert.fail('resolved'), (e: unknown) => e))
    assert.equal(err, controller.signal.reason)
    assert.equal(err.name, 'AbortError')
    // (pg rejects on the ErrorResponse; Postgres marks the backend idle a moment later, before its ReadyForQuery.)
    await eventually(async () => (await running(app)).length === 0, 'Postgres no longer running it (pg_sleep(30) would run on)', 2000)
    assert.deepEqual((await client.query('SELECT 2 AS two')).rows, [{ two: 2 }])
  })
})

test('aborted behind others in a pipeline: the one ahead of it is not touched; it is cancelled once it runs', async () => {
  const app = 'abort-pipelined'
  await withClient(app, async (client) => {
    const controller = new AbortController()
    const ahead = client.query('SELECT pg_sleep(0.5) AS ahead')
    const behind = client.query({ text: 'SELECT pg_sleep(30)', signal: controller.signal } as any)
    const start = Date.now()
    controller.abort()
    assert.deepEqual((await ahead).rows, [{ ahead: '' }], 'the query ahead finishes normally')
    await within(5000, 'the rejection', assert.rejects(behind, { name: 'AbortError' }))
    assert.ok(Date.now() - start < 5000)
    assert.deepEqual((await client.query('SELECT 3 AS three')).rows, [{ three: 3 }])
  })
})

test('aborted while queued and not yet sent (pipeline: false): it never reaches Postgres', async () => {
  await withClient('abort-queued', async (client) => {
    const controller = new AbortController()
    const ahead = client.query('SELECT pg_sleep(0.3)')
    const queued = client.query({ text: `INSERT INTO ${table} VALUES ('queued')`, signal: controller.signal } as any)
    controller.abort()
    await assert.rejects(queued, { name: 'AbortError' })
    await ahead
    assert.deepEqual(await rows(), [])
  }, { pipeline: false })
})

test("aborted inside a transaction: Postgres's own semantics (the transaction is failed, ROLLBACK ends it)", async () => {
  const app = 'abort-transaction'
  await withClient(app, async (client) => {
    await client.query('BEGIN')
    await client.query(`INSERT INTO ${table} VALUES ('in transaction')`)
    const controller = new AbortController()
    const query = client.query({ text: 'SELECT pg_sleep(30)', signal: controller.signal } as any)
    await sleeping(app)
    controller.abort()
    await within(5000, 'the rejection', assert.rejects(query, { name: 'AbortError' }))
    // (pg calls back on the ErrorResponse, maybe before the ReadyForQuery that says 'E' is read.)
    await assert.rejects(client.query('SELECT 1'), { code: '25P02' }, 'the transaction is failed')
    await client.query('ROLLBACK')
    assert.equal(client.getTransactionStatus(), 'I')
    assert.deepEqual(await rows(), [])
  })
})

test('query_timeout stops the statement on the server too (pg over TCP leaves it running)', async () => {
  const app = 'abort-timeout'
  for (const where of ['client', 'query'] as const) {
    await withClient(app, async (client) => {
      const text = 'SELECT pg_sleep(30)'
      await within(5000, 'the timeout', assert.rejects(client.query(where === 'client' ? text : ({ text, query_timeout: 300 } as any)), { message: 'Query read timeout' }))
      await eventually(async () => (await running(app)).length === 0, 'the statement to stop')
      assert.deepEqual((await client.query('SELECT 4 AS four')).rows, [{ four: 4 }])
    }, where === 'client' ? { query_timeout: 300 } : {})
  }
})

test('query_timeout on a query stream or cursor: it fails as in pg, and the statement stops on the server too', async () => {
  const { default: QueryStream } = await import('pg-query-stream')
  const { default: Cursor } = await import('pg-cursor')
  const app = 'abort-stream'
  await withClient(app, async (client) => {
    const stream = client.query(new QueryStream('SELECT pg_sleep(30)'))
    const read = (async () => {
      for await (const row of stream) assert.fail(`a row: ${JSON.stringify(row)}`)
    })()
    await within(5000, "the stream's error", assert.rejects(read, { message: 'Query read timeout' }))
    await eventually(async () => (await running(app)).length === 0, 'the statement to stop')
    assert.deepEqual((await client.query('SELECT 6 AS six')).rows, [{ six: 6 }], 'the connection goes on')

    const cursor = client.query(new Cursor('SELECT pg_sleep(30)'))
    await within(5000, "the cursor's error", assert.rejects(cursor.read(1), { message: 'Query read timeout' }))
    await eventually(async () => (await running(app)).length === 0, 'the statement to stop')
    const quick = client.query(new Cursor('SELECT generate_series(1, 3) AS n'))
    assert.deepEqual(await quick.read(10), [{ n: 1 }, { n: 2 }, { n: 3 }], 'one that ends in time is not touched')
    await quick.close()
    assert.deepEqual((await client.query('SELECT 7 AS seven')).rows, [{ seven: 7 }])
  }, { query_timeout: 300 })
})

test('pool.query({ signal }) and a Pool with query_timeout', async () => {
  const app = 'abort-pool'
  const pool = new edgepg.Pool({ ...config(app), max: 1 }) as pg.Pool
  const timed = new edgepg.Pool({ ...config(app), max: 1, query_timeout: 300 }) as pg.Pool
  try {
    const controller = new AbortController()
    const query = pool.query({ text: 'SELECT pg_sleep(30)', signal: controller.signal } as any)
    await sleeping(app)
    controller.abort()
    await within(5000, 'the rejection', assert.rejects(query, { name: 'AbortError' }))
    assert.deepEqual((await pool.query('SELECT 5 AS five')).rows, [{ five: 5 }], 'its connection serves the next query')
    await within(5000, 'the timeout', assert.rejects(timed.query('SELECT pg_sleep(30)'), { message: 'Query read timeout' }))
    await eventually(async () => (await running(app)).length === 0, 'the statement to stop')
  } finally {
    await pool.end()
    await timed.end()
  }
})

test("Neon's driver through the proxy: its CancelRequest still cancels its query", async () => {
  const neon = await import('@neondatabase/serverless')
  const app = 'abort-neon'
  const options = { ...pgConfig('scram_user'), application_name: app }
  neon.neonConfig.webSocketConstructor = WebSocket
  neon.neonConfig.wsProxy = () => `127.0.0.1:${proxy.port}/v2`
  neon.neonConfig.useSecureWebSocket = false
  neon.neonConfig.pipelineConnect = false
  const client = new neon.Client(options)
  await client.connect()
  try {
    const query = new neon.Client(options) as any
    const running = client.query('SELECT pg_sleep(30)')
    await sleeping(app)
    query.cancel(client, (client as any).activeQuery)
    await within(5000, 'the cancel', assert.rejects(running, { code: '57014' }))
  } finally {
    await client.end()
  }
})

test('behind a 200 ms RTT: abort to rejection takes one round trip, on the session\'s WebSocket and on a second one (the CancelRequest in its upgrade)', async () => {
  const noPool = await startProxy({ pool: { enabled: false } })
  try {
    for (const [how, port] of [['on the session', proxy.port], ['on a second WebSocket', noPool.port]] as const) {
      const relay = await startDelayRelay({ host: '127.0.0.1', port }, 100)
      const app = `abort-rtt-${port}`
      const client = new edgepg.Client({ ...config(app), wsProxy: () => `ws://127.0.0.1:${relay.port}/v2` }) as pg.Client
      await client.connect()
      try {
        const controller = new AbortController()
        const query = client.query({ text: 'SELECT pg_sleep(30)', signal: controller.signal } as any).catch((e: unknown) => e)
        await sleeping(app)
        const start = performance.now()
        controller.abort()
        await query
        const trips = (performance.now() - start) / relay.rttMs
        assert.ok(trips >= 0.9 && trips < 1.75, `${how}: abort to rejection took ${trips.toFixed(2)} round trips (expected 1; a second would make 2)`)
      } finally {
        await client.end()
        await relay.close()
      }
    }
  } finally {
    await noPool.close()
  }
})

test("the cancel goes on the session's own WebSocket where the proxy takes it (its pooled backends), else on a second one", async () => {
  const noPool = await startProxy({ pool: { enabled: false } })
  try {
    for (const [which, port, sockets] of [['pooled backends', proxy.port, 1], ['no pool', noPool.port, 2]] as const) {
      let opened = 0
      const Counting = class extends WebSocket {
        constructor(...args: ConstructorParameters<typeof WebSocket>) {
          super(...args)
          opened++
        }
      }
      const app = `abort-in-band-${sockets}`
      const client = new edgepg.Client({ ...config(app), webSocketConstructor: Counting, wsProxy: () => `ws://127.0.0.1:${port}/v2` }) as pg.Client
      await client.connect()
      try {
        const controller = new AbortController()
        const query = client.query({ text: 'SELECT pg_sleep(30)', signal: controller.signal } as any)
        await sleeping(app)
        controller.abort()
        await within(5000, 'the rejection', assert.rejects(query, { name: 'AbortError' }))
        assert.equal(opened, sockets, `${which}: WebSockets opened, the session's included`)
        assert.deepEqual((await client.query('SELECT 1 AS one')).rows, [{ one: 1 }])
      } finally {
        await client.end()
      }
    }
  } finally {
    await noPool.close()
  }
})

test('a cancel on the WebSocket that names a statement already answered reaches nothing; one naming the running statement stops it', async () => {
  const app = 'abort-stale'
  await withClient(app, async (client) => {
    const socket = (client as any).connection.stream
    assert.equal(socket.cancelsInBand, true)
    await client.query('SELECT 1') // one ReadyForQuery read since the login
    const finished = client.query('SELECT pg_sleep(0.5) AS slept')
    await sleeping(app)
    socket.sendCancel(0) // names the statement before, long answered: a cancel that arrived late
    assert.deepEqual((await finished).rows, [{ slept: '' }], 'the statement after it ran to its end')
    const running = client.query('SELECT pg_sleep(30)')
    await sleeping(app)
    socket.sendCancel(2) // two read: names this one
    await within(5000, 'the cancel', assert.rejects(running, { code: '57014' }))
  })
})

/**
 * edgepg-proxy's memory, measured on the proxy alone: it runs as a child process
 * (`node --import tsx proxy/cli.ts`, as deployed) and its resident set is read from
 * /proc/<pid>/status.
 *
 * - Backpressure: a client that reads a ~100 MB result at 100 KB/s. The proxy must pause its
 *   upstream socket instead of buffering, so its RSS grows by less than 64 MB.
 * - Idle sessions: 1,000 connected, idle edgepg clients. Reports the proxy's memory per session
 *   and checks it against a bound that a leak-sized regression would break.
 *
 * The test Postgres from test/support/run.ts allows 300 connections, so this file starts its own
 * (test/support/stack.ts) with max_connections=1100.
 *
 * Memory is measured after a full GC in the child (startGcProxy, test/support/child-proxy.ts).
 */
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { setTimeout as sleep } from 'node:timers/promises'
import pg from 'pg'
import { WebSocket } from 'ws'
import { Client } from '../src/index'
import { PASSWORD, startPostgres, type Postgres } from './support/stack'
import { LIFTED_LIMITS, startGcProxy, type GcProxy } from './support/child-proxy'
import { backends, eventually, within } from './support/helpers'
import { backendReader, bigResultQuery, bigResultRowError, passwordMessage, queryMessage, startupMessage } from './support/protocol'

const MB = 1 << 20
const mb = (bytes: number) => `${(bytes / MB).toFixed(1)} MB`

// ---------------------------------------------------------------------------------------------

let PG: Postgres
let admin: pg.Client
let proxy: GcProxy

before(async () => {
  // A Postgres of our own, with room for 1,000 sessions (the shared one allows 300 connections).
  PG = await startPostgres({ name: 'pg-mem', settings: { max_connections: '1100', shared_buffers: '32MB' } })
  admin = new pg.Client({ host: PG.host, port: PG.port, database: PG.database, user: 'trust_user' })
  await admin.connect()
  // No warm backends: the baselines wait for the warm-up sessions' backends to exit.
  proxy = await startGcProxy(`${PG.host}:${PG.port}`, [...LIFTED_LIMITS, '--no-pool'])
})

after(async () => {
  await proxy?.stop()
  await admin?.end().catch(() => {})
  await PG?.stop()
})

const edgeClient = (appName: string) =>
  new Client({
    host: PG.host,
    port: PG.port,
    database: PG.database,
    user: 'scram_user',
    password: PASSWORD,
    application_name: appName,
    webSocketConstructor: WebSocket as any,
    wsProxy: () => proxy.url,
  })

/** A few sessions through the proxy, so its lazily loaded code and warm-up allocations come before any baseline. */
async function warmUp(n: number) {
  const clients = Array.from({ length: n }, () => edgeClient('edgepg-mem-warmup'))
  await Promise.all(clients.map((c) => c.connect()))
  await Promise.all(clients.map((c) => c.query('SELECT $1::int AS v', [1])))
  await Promise.all(clients.map((c) => c.end()))
  await eventually(async () => (await backends('edgepg-mem-warmup', PG)) === 0, 'warm-up backends to exit', 10_000, 50)
}

test('backpressure: a client reading a ~100 MB result at 100 KB/s keeps the proxy’s memory growth under 64 MB', { timeout: 60_000 }, async (t) => {
  const ROWS = 100_000 // ~1 KB each: ~100 MB of DataRows
  const RATE = 100 * 1024 // bytes/s the client reads
  const WINDOW_MS = Number(process.env.EDGEPG_SLOW_READ_SECONDS ?? 12) * 1000
  const LIMIT = 64 * MB
  const appName = `edgepg-slow-reader-${process.pid}`

  await warmUp(5)
  await proxy.memoryAfterGc()
  await sleep(200)
  const baseline = proxy.rss()

  const ws = new WebSocket(proxy.url)
  let sampler: NodeJS.Timeout | undefined
  let pacer: NodeJS.Timeout | undefined
  try {
    await within(5000, 'the WebSocket to open', new Promise((resolve, reject) => (ws.once('open', resolve), ws.once('error', reject))))
    let received = 0
    let rows = 0
    let firstBad = ''
    let errors = ''
    const read = backendReader((type, body) => {
      if (type === 'D') {
        rows++
        if (!firstBad) firstBad = bigResultRowError(body, rows)
      } else if (type === 'E') errors += body.toString('latin1')
    })

    // The proxy offloads auth: it asks for a cleartext password, which trust_user's Postgres then
    // never needs. Startup, password and query go out pipelined, as edgepg sends them.
    const started = performance.now()
    const allowed = () => (RATE * (performance.now() - started)) / 1000
    ws.on('message', (data: Buffer) => {
      received += data.length
      read(data)
      if (received >= allowed()) ws.pause() // at most one socket read past the budget
    })
    pacer = setInterval(() => {
      if (received < allowed()) ws.resume()
    }, 10)
    ws.send(
      Buffer.concat([
        startupMessage({ user: 'trust_user', database: PG.database, application_name: appName }),
        passwordMessage('unused'),
        queryMessage(bigResultQuery(ROWS)),
      ])
    )

    const samples: number[] = []
    sampler = setInterval(() => samples.push(proxy.rss()), 200)
    await sleep(WINDOW_MS)
    clearInterval(sampler)
    samples.push(proxy.rss())
    const elapsed = (performance.now() - started) / 1000

    // Postgres still has most of the result to send and is blocked writing it: the backpressure
    // reached it, rather than the proxy reading it all into memory.
    const { rows: activity } = await admin.query('SELECT wait_event FROM pg_stat_activity WHERE application_name = $1', [appName])
    const peak = Math.max(...samples)
    const growth = peak - baseline
    t.diagnostic(
      `slow reader: read ${mb(received)} (${rows} rows) in ${elapsed.toFixed(1)} s = ${(received / 1024 / elapsed).toFixed(0)} KB/s; ` +
        `proxy RSS baseline ${mb(baseline)}, peak ${mb(peak)}, growth ${mb(growth)} over ${samples.length} samples (limit ${mb(LIMIT)}); ` +
        `backend wait_event ${activity[0]?.wait_event}`
    )
    assert.equal(errors, '', 'no ErrorResponse from Postgres')
    assert.equal(firstBad, '', 'every row read so far is intact')
    assert.ok(rows > 100, `the client read rows while pacing itself (got ${rows})`)
    assert.ok(received < RATE * elapsed * 1.5 + 256 * 1024, `the client read at most ~100 KB/s (read ${received} bytes in ${elapsed.toFixed(1)} s)`)
    assert.ok(received > RATE * elapsed * 0.5, `the client kept reading at ~100 KB/s (read ${received} bytes in ${elapsed.toFixed(1)} s)`)
    assert.ok(rows < ROWS / 2, `the client was far from the end of the result (${rows} of ${ROWS} rows)`)
    assert.equal(activity[0]?.wait_event, 'ClientWrite', 'the Postgres backend blocks writing to the proxy (the proxy paused its upstream socket)')
    assert.ok(growth < LIMIT, `the proxy's RSS grew by ${mb(growth)} (from ${mb(baseline)} to ${mb(peak)}), limit ${mb(LIMIT)}`)
  } finally {
    clearInterval(sampler)
    clearInterval(pacer)
    ws.terminate()
  }
  // The proxy drops the upstream of a client that vanished mid-result, paused or not.
  await eventually(async () => (await backends(appName, PG)) === 0, 'the slow reader’s backend to exit after the client went away', 10_000, 50)
})

test('1,000 idle sessions: proxy memory per session', { timeout: 120_000 }, async (t) => {
  const SESSIONS = Number(process.env.EDGEPG_IDLE_SESSIONS ?? 1000)
  const BATCH = 50
  // Measured on the 2-core box (scram_user, after a full GC): ~47 KB of RSS and ~14 KB of JS heap
  // per idle session. Most of the rest is V8 heap reserved but unused plus malloc high-water from
  // SCRAM (trust_user sessions: ~31 KB); repeated open/close rounds plateau, so it is not a leak.
  // The bounds leave ~2x headroom yet fail if each session kept, say, a 64 KB read buffer.
  const RSS_LIMIT = 96 * 1024
  const HEAP_LIMIT = 32 * 1024
  const appName = `edgepg-idle-${process.pid}`

  await warmUp(50)
  await sleep(200)
  const before = await proxy.memoryAfterGc()
  const rssBefore = proxy.rss()

  const clients: Client[] = []
  const errors: string[] = []
  let rssHalf = NaN
  let half = 0
  const t0 = performance.now()
  try {
    for (let i = 0; i < SESSIONS; i += BATCH) {
      const batch = Array.from({ length: Math.min(BATCH, SESSIONS - i) }, () => {
        const c = edgeClient(appName)
        c.on('error', (err) => errors.push(err.message))
        clients.push(c)
        return c
      })
      await within(30_000, `connect sessions ${i + 1}-${i + batch.length}`, Promise.all(batch.map(async (c, j) => {
        await c.connect()
        const { rows } = await c.query('SELECT $1::int AS v', [i + j])
        if (rows[0].v !== i + j) throw new Error(`session ${i + j} answered ${rows[0].v}`)
      })))
      if (Number.isNaN(rssHalf) && clients.length >= SESSIONS / 2) {
        half = clients.length
        // Halfway: the slope from here to SESSIONS is the marginal cost of a session, without the
        // one-off growth of V8's young generation that the first connections bring.
        await sleep(200)
        await proxy.memoryAfterGc()
        await sleep(200)
        rssHalf = proxy.rss()
      }
    }
    const openMs = performance.now() - t0
    assert.equal(await backends(appName, PG), SESSIONS, `${SESSIONS} backends are connected through the proxy`)

    await sleep(500) // idle
    const rssIdle = proxy.rss()
    const idle = await proxy.memoryAfterGc()
    await sleep(200)
    const rssIdleGc = proxy.rss()
    const perSession = (rssIdleGc - rssBefore) / SESSIONS
    const perSessionNoGc = (rssIdle - rssBefore) / SESSIONS
    const marginal = (rssIdleGc - rssHalf) / (SESSIONS - half)
    const heapPer = (idle.heapUsed - before.heapUsed) / SESSIONS
    const heapTotalPer = (idle.heapTotal - before.heapTotal) / SESSIONS
    const extPer = (idle.external - before.external) / SESSIONS
    t.diagnostic(
      `${SESSIONS} idle sessions (opened in ${(openMs / 1000).toFixed(1)} s, ${BATCH} at a time): proxy RSS ${mb(rssBefore)} -> ${mb(rssIdleGc)} after GC ` +
        `(${mb(rssIdle)} before GC) = ${(perSession / 1024).toFixed(1)} KB/session after GC, ${(perSessionNoGc / 1024).toFixed(1)} KB before; ` +
        `marginal ${(marginal / 1024).toFixed(1)} KB/session (RSS ${mb(rssHalf)} at ${half} sessions); ` +
        `JS heap used ${(heapPer / 1024).toFixed(1)} KB/session (heap reserved ${(heapTotalPer / 1024).toFixed(1)} KB), external ${(extPer / 1024).toFixed(1)} KB/session`
    )
    assert.deepEqual(errors, [], 'no client errors')
    assert.ok(perSession < RSS_LIMIT, `the proxy holds ${(perSession / 1024).toFixed(1)} KB per idle session (RSS after GC), limit ${RSS_LIMIT / 1024} KB`)
    assert.ok(heapPer < HEAP_LIMIT, `the proxy's JS heap holds ${(heapPer / 1024).toFixed(1)} KB per idle session, limit ${HEAP_LIMIT / 1024} KB`)

    // The sessions still work after idling.
    const answers = await within(30_000, 'a query on every idle session', Promise.all(clients.map((c, i) => c.query('SELECT $1::int AS v', [i]))))
    assert.ok(answers.every((r, i) => r.rows[0].v === i), 'every idle session answers its own query')
  } finally {
    await within(30_000, 'closing every session', Promise.all(clients.map((c) => c.end().catch(() => {}))))
  }
  await eventually(async () => (await backends(appName, PG)) === 0, 'every backend to exit once the clients closed', 15_000, 50)
  // The backends exit on Terminate, a moment before the proxy has finished each WebSocket's close
  // handshake: so give the proxy (bounded) time to let go of the sessions.
  let afterClose = await proxy.memoryAfterGc()
  await eventually(async () => (afterClose = await proxy.memoryAfterGc()).heapUsed - before.heapUsed < 8 * MB, 'the proxy to release the closed sessions', 10_000, 500).catch(() => {})
  t.diagnostic(`after closing: proxy RSS ${mb(proxy.rss())}, JS heap ${mb(afterClose.heapUsed)} (was ${mb(before.heapUsed)})`)
  assert.ok(afterClose.heapUsed - before.heapUsed < 8 * MB, `the proxy's JS heap returns near its baseline after the sessions close (${mb(before.heapUsed)} -> ${mb(afterClose.heapUsed)})`)
})

/**
 * Load: 500 concurrent edgepg sessions through edgepg-proxy issue queries back to back for 30 s on
 * loopback, with zero errors allowed, on at most --pool-size backends (transaction mode, the
 * default); reports throughput and p50/p99 latency.
 *
 * The proxy runs as a child process (`node --import tsx proxy/cli.ts`, as deployed), so the load
 * generator (this process) and the proxy do not share an event loop. The test Postgres from
 * test/support/run.ts allows 300 connections, so this file starts its own (test/support/stack.ts) with
 * max_connections=700.
 *
 *   EDGEPG_LOAD_SECONDS=5 npx tsx test/support/run.ts load     # a shorter run for local iteration
 *   EDGEPG_LOAD_SESSIONS=200 ...                        # fewer sessions (default 500)
 */
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { WebSocket } from 'ws'
import { Client } from '../src/index'
import { PASSWORD, startPostgres, type Postgres } from './support/stack'
import { LIFTED_LIMITS, startChildProxy, type ChildProxy } from './support/child-proxy'
import { backends, eventually, within } from './support/helpers'

const SECONDS = Number(process.env.EDGEPG_LOAD_SECONDS ?? 30)
const SESSIONS = Number(process.env.EDGEPG_LOAD_SESSIONS ?? 500)
/** Sessions connected at a time while opening them. */
const CONNECT_BATCH = 50

/** Nearest-rank percentile of an ascending array. */
const percentile = (sorted: Float64Array, p: number) => sorted[Math.min(sorted.length - 1, Math.max(0, Math.ceil((p / 100) * sorted.length) - 1))]

let PG: Postgres
let proxy: ChildProxy

before(async () => {
  // A Postgres of our own, with room for SESSIONS (the shared one allows 300 connections).
  PG = await startPostgres({ name: 'pg-load', settings: { max_connections: String(SESSIONS + 200), shared_buffers: '32MB' } })
  proxy = await startChildProxy(`${PG.host}:${PG.port}`, { flags: LIFTED_LIMITS })
})

after(async () => {
  await proxy?.stop()
  await PG?.stop()
})

/**
 * The queries each session cycles through: mostly the one-row parameterized SELECT, with a
 * 20-row result and a simple-protocol query mixed in. Each checks its own answer.
 */
type Check = (rows: any[]) => boolean
const MIX: Array<(i: number) => { text: string; values?: unknown[]; check: Check }> = [
  (i) => ({ text: 'SELECT $1::int AS v', values: [i], check: (r) => r.length === 1 && r[0].v === i }),
  (i) => ({ text: 'SELECT $1::int AS v', values: [i], check: (r) => r.length === 1 && r[0].v === i }),
  (i) => ({ text: 'SELECT $1::int AS v', values: [i], check: (r) => r.length === 1 && r[0].v === i }),
  (i) => ({ text: 'SELECT $1::text AS t, g FROM generate_series(1, 20) g', values: [`s${i}`], check: (r) => r.length === 20 && r[19].g === 20 && r[0].t === `s${i}` }),
  (i) => ({ text: `SELECT ${i} AS v`, check: (r) => r.length === 1 && r[0].v === i }),
]

test(`load: ${SESSIONS} concurrent sessions querying for ${SECONDS} s through the proxy, zero errors`, { timeout: SECONDS * 1000 + 150_000 }, async (t) => {
  const appName = `edgepg-load-${process.pid}`
  const errors: string[] = []
  const clients: Client[] = []
  const logsBefore = proxy.logs.length
  try {
    // Open the sessions, CONNECT_BATCH at a time.
    const t0 = performance.now()
    for (let i = 0; i < SESSIONS; i += CONNECT_BATCH) {
      const batch = Array.from({ length: Math.min(CONNECT_BATCH, SESSIONS - i) }, (_, j) => {
        const c = new Client({
          host: PG.host,
          port: PG.port,
          database: PG.database,
          user: 'scram_user',
          password: PASSWORD,
          application_name: appName,
          webSocketConstructor: WebSocket as any,
          wsProxy: () => proxy.url,
        })
        c.on('error', (err) => errors.push(`session ${i + j}: client error: ${err.message}`))
        clients.push(c)
        return c
      })
      // connect() resolves as soon as the pipelined startup is sent; the first query's answer
      // means the session is established (auth done upstream).
      await within(30_000, `connecting sessions ${i + 1}-${i + batch.length}`, Promise.all(batch.map(async (c) => {
        await c.connect()
        await c.query('SELECT 1')
      })))
    }
    const connectSeconds = (performance.now() - t0) / 1000
    assert.ok((await backends(appName, PG)) <= 20, `${SESSIONS} sessions on at most --pool-size backends (20)`)

    // Every session issues queries back to back until the deadline.
    const latencies: number[] = []
    let wrong = 0
    const cpu0 = proxy.cpuSeconds()
    const start = performance.now()
    const deadline = start + SECONDS * 1000
    const worker = async (c: Client, s: number) => {
      for (let n = 0; performance.now() < deadline && errors.length === 0; n++) {
        const v = (s * 100_003 + n) % 1_000_000_007
        const q = MIX[n % MIX.length](v)
        const q0 = performance.now()
        try {
          const { rows } = await c.query(q.text, q.values)
          latencies.push(performance.now() - q0)
          if (!q.check(rows)) {
            wrong++
            errors.push(`session ${s}: wrong answer to ${q.text} [${q.values ?? ''}]: ${JSON.stringify(rows).slice(0, 200)}`)
          }
        } catch (err) {
          errors.push(`session ${s}: ${q.text}: ${(err as Error).message}`)
        }
      }
    }
    // Bounded even if the proxy stops answering: a stuck query fails the test after 30 s more.
    await within(SECONDS * 1000 + 30_000, 'the load run', Promise.all(clients.map(worker)))
    const elapsed = (performance.now() - start) / 1000
    const proxyCpu = proxy.cpuSeconds() - cpu0

    const sorted = Float64Array.from(latencies).sort()
    const qps = latencies.length / elapsed
    const f = (x: number) => `${x.toFixed(1)} ms`
    t.diagnostic(
      `${SESSIONS} sessions (connected in ${connectSeconds.toFixed(1)} s, ${CONNECT_BATCH} at a time) for ${elapsed.toFixed(1)} s: ` +
        `${latencies.length} queries = ${qps.toFixed(0)} queries/s; latency p50 ${f(percentile(sorted, 50))}, p99 ${f(percentile(sorted, 99))}, ` +
        `p99.9 ${f(percentile(sorted, 99.9))}, max ${f(sorted[sorted.length - 1] ?? NaN)}; proxy CPU ${((proxyCpu / elapsed) * 100).toFixed(0)}% of one core (${((proxyCpu * 1e6) / latencies.length).toFixed(0)} µs per query); ` +
        `errors ${errors.length}`
    )
    assert.deepEqual(errors.slice(0, 10), [], `zero errors allowed (${errors.length} in all, ${wrong} wrong answers)`)
    assert.ok(latencies.length >= SESSIONS * 10, `every session made progress (${latencies.length} queries in all)`)
  } finally {
    await within(30_000, 'closing every session', Promise.all(clients.map((c) => c.end().catch(() => {}))))
  }

  // Nothing leaks: Postgres holds no more than the pool's backends (--pool-size, 20 by default; all
  // sessions here share one key), and the proxy logged each session as closed by its client.
  await eventually(async () => (await backends(appName, PG)) <= 20, 'no backend but the pooled ones once the clients closed', 15_000, 50)
  await eventually(() => proxy.logs.length - logsBefore >= SESSIONS, 'a session log line from the proxy for every session', 10_000, 50)
  const outcomes = new Map<string, number>()
  for (const { outcome } of proxy.logs.slice(logsBefore)) outcomes.set(outcome, (outcomes.get(outcome) ?? 0) + 1)
  assert.deepEqual(Object.fromEntries(outcomes), { 'closed by client': SESSIONS }, 'the proxy saw every session end cleanly')
  assert.deepEqual(errors, [], 'no client errors while closing')
})

/**
 * Section "listen" (issue 50): listening sessions, and notifications from 4 writers delivered to
 * them. Today's way through edgepg-proxy, session mode (a Postgres backend held by each listener),
 * beside pg over TCP (a connection each), as far as Postgres's connection limit lets either go:
 * Postgres backends held, the proxy's RSS per idle listener, and the delay from a writer's NOTIFY
 * (autocommit, stamped as it is sent) to the listener's `notification` event, p50 and p99.
 */
import pg from 'pg'
import { WebSocket } from 'ws'
import { setTimeout as sleep } from 'node:timers/promises'
import { Client } from '../src/index'
import { startChildProxy } from '../test/support/child-proxy'
import { PASSWORD } from '../test/support/stack'
import { ms, percentile, printTable, type Row, type Section } from './lib'

const APP = 'bench-listen'
/** Listeners a channel has. */
const PER_CHANNEL = 10
const WRITERS = 4
/** NOTIFYs a second, all writers together, and for how long. */
const RATE = 200
const SECONDS = 3

interface Listening {
  query(text: string): Promise<unknown>
  on(event: 'notification', f: (n: { payload?: string }) => void): unknown
  end(): Promise<void>
}

export const listen: Section = {
  name: 'listen',
  async run(ctx) {
    const { host, port, database } = ctx.pg
    const admin = new pg.Client(ctx.pgConfig())
    await admin.connect()
    const rows: Row[] = []
    try {
      for (const n of [100, 250]) {
        // (A proxy of its own each time: no idle backend of an earlier run is counted as a listener's.)
        const p = await startChildProxy(`${host}:${port}`, { built: true, flags: ['--pool-mode', 'session', '--max-sessions-per-ip', '100000', '--shutdown-grace', '0'] })
        const edge = await measure(n, APP, () => new Client({ host, port, database, user: 'scram_user', password: PASSWORD, application_name: APP, webSocketConstructor: WebSocket as any, wsProxy: () => p.url } as any), admin, ctx.pgConfig(), () => p.rss()).finally(() => p.stop())
        const tcp = await measure(n, `${APP}-tcp`, () => new pg.Client({ ...ctx.pgConfig(), application_name: `${APP}-tcp` }), admin, ctx.pgConfig())
        rows.push(
          { metric: `${n} listeners: Postgres backends held`, edgepg: String(edge.backends), baseline: String(tcp.backends) },
          { metric: `${n} listeners: proxy RSS per idle listener`, edgepg: `${(edge.rssPerListener! / 1024).toFixed(1)} KiB`, baseline: '' },
          { metric: `${n} listeners, ${RATE * PER_CHANNEL} deliveries/s: NOTIFY to event, p50`, edgepg: ms(edge.p50), baseline: ms(tcp.p50), ratio: edge.p50 / tcp.p50 },
          { metric: `${n} listeners, ${RATE * PER_CHANNEL} deliveries/s: NOTIFY to event, p99`, edgepg: ms(edge.p99), baseline: ms(tcp.p99), ratio: edge.p99 / tcp.p99 }
        )
      }
    } finally {
      await admin.end()
    }
    printTable(`Listening sessions: session mode through edgepg-proxy (a backend each), ${PER_CHANNEL} per channel, ${WRITERS} writers at ${RATE} NOTIFY/s`, rows, 'pg (TCP)', [
      'Transaction pooling with one listening backend per database (issue 50) is to join this table; session mode stops at Postgres max_connections.',
    ])
    return rows
  },
}

/** `n` listeners from `open`, PER_CHANNEL to a channel; then WRITERS writers notify each channel in turn for SECONDS. */
async function measure(n: number, app: string, open: () => Listening & { connect(): Promise<unknown> }, admin: pg.Client, writer: pg.ClientConfig, rss?: () => number) {
  const channels = Math.ceil(n / PER_CHANNEL)
  const before = rss?.()
  const delays: number[] = []
  const clients = await Promise.all(
    Array.from({ length: n }, async (_, i) => {
      const c = open()
      await c.connect()
      await c.query(`LISTEN bench_${i % channels}`)
      c.on('notification', (msg) => delays.push(performance.now() - Number(msg.payload)))
      return c
    })
  )
  await sleep(500)
  const rssPerListener = rss && before !== undefined ? (rss() - before) / n : undefined
  const backends = Number((await admin.query('SELECT count(*) AS n FROM pg_stat_activity WHERE application_name = $1', [app])).rows[0].n)
  const writers = await Promise.all(
    Array.from({ length: WRITERS }, async () => {
      const w = new pg.Client(writer)
      await w.connect()
      return w
    })
  )
  const sends = RATE * SECONDS
  const gap = 1000 / (RATE / WRITERS)
  await Promise.all(
    writers.map(async (w, k) => {
      for (let i = k; i < sends; i += WRITERS) {
        const t0 = performance.now()
        await w.query('SELECT pg_notify($1, $2)', [`bench_${i % channels}`, String(performance.now())])
        await sleep(Math.max(0, gap - (performance.now() - t0)))
      }
    })
  )
  const expected = sends * PER_CHANNEL
  for (let waited = 0; delays.length < expected && waited < 5000; waited += 50) await sleep(50)
  await Promise.all([...writers, ...clients].map((c) => c.end()))
  if (delays.length < expected) console.warn(`listen: ${delays.length} of ${expected} notifications arrived`)
  return { backends, rssPerListener, p50: percentile(delays, 50), p99: percentile(delays, 99) }
}

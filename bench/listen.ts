/**
 * Section "listen" (issue 50): listening sessions, and notifications from 4 writers delivered to
 * them. Transaction pooling (one listening backend for all of them) with 1,000 and 10,000 sessions;
 * then, as far as Postgres's connection limit lets them go, session mode (a backend held by each
 * listener) beside pg over TCP (a connection each). Postgres backends held, the proxy's RSS per idle
 * listener, and the delay from a writer's NOTIFY (autocommit, stamped as it is sent) to the
 * listener's `notification` event, p50 and p99; notifications lost or duplicated; and, with the
 * listening backend killed, how long until every session is told, and listens again. All on one
 * channel, beside the floor for a fan-out: a bare WebSocket server broadcasting to as many sessions.
 */
import pg from 'pg'
import { WebSocket } from 'ws'
import { setTimeout as sleep } from 'node:timers/promises'
import { Client } from '../src/index'
import { startChildProxy, startGcProxy } from '../test/support/child-proxy'
import { offeredLogin } from '../test/support/raw-session'
import { backendReader, queryMessage, TERMINATE } from '../test/support/protocol'
import { PASSWORD } from '../test/support/stack'
import { startWsBroadcast } from './proxy'
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
      for (const n of FAN_OUT) rows.push(...(await fanOut(n, ctx.pg, admin, ctx.pgConfig())))
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
    printTable(`Listening sessions through edgepg-proxy: transaction mode (one listening backend), then session mode (a backend each) beside pg; ${WRITERS} writers`, rows, 'floor / pg (TCP)', [
      `Transaction mode: ${FAN_RATE} NOTIFY/s on ${PER_CHANNEL} listeners a channel (${LOSS_SECONDS} s at 10,000: the loss count), then ${ONE_CHANNEL_DELIVERIES.toLocaleString()} deliveries/s to all on one channel,`,
      `beside the floor: a bare ws server (bench/ws-broadcast.ts) sending each notification to as many lean sessions. Session mode: ${RATE} NOTIFY/s beside pg over TCP; it stops at Postgres max_connections.`,
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

/** Transaction mode: listening sessions, and their workloads' NOTIFY rates. */
const FAN_OUT = (process.env.EDGEPG_BENCH_LISTENERS ?? '1000,10000').split(',').map(Number)
const FAN_RATE = 2000
const FAN_SECONDS = 5
/** At 10,000 listeners the first workload runs this long: 100,000 NOTIFYs, each listener's counted. */
const LOSS_SECONDS = Number(process.env.EDGEPG_BENCH_LISTEN_SECONDS ?? 50)
const ONE_CHANNEL_DELIVERIES = 20_000
/** Listeners opened before the proxy's memory is first measured. */
const WARM = 200

/**
 * A lean listening session: a bare WebSocket that logs in in the upgrade as an edgepg Client does
 * (its subprotocols), sends simple Queries, and reads NotificationResponses and notices, nothing
 * more: so that 10,000 of them in this process measure the proxy, not pg's parser.
 */
class Lean {
  private readonly readies: ((error?: string) => void)[] = []
  /** The SQLSTATE of the error the query under way got, if any. */
  private error?: string
  notices: string[] = []
  onNotification?: (payload: string) => void

  private constructor(private readonly ws: WebSocket) {
    const read = backendReader((type, body) => {
      if (type === 'A') this.onNotification?.(body.toString('utf8', body.indexOf(0, 4) + 1, body.length - 1))
      else if (type === 'N') this.notices.push(code(body))
      else if (type === 'E') this.error ??= code(body)
      else if (type === 'Z') this.readies.shift()?.(this.error), (this.error = undefined)
    })
    ws.on('message', (data, binary) => binary && read(data as Buffer))
    ws.on('error', () => {})
  }

  static async open(url: string, protocols: string[]): Promise<Lean> {
    const lean = new Lean(new WebSocket(url, protocols))
    const ready = new Promise<void>((resolve) => lean.readies.push(() => resolve())) // (the login's)
    await new Promise((resolve, reject) => lean.ws.once('open', resolve).once('error', reject))
    await ready
    return lean
  }

  /** Rejects with the SQLSTATE of Postgres's error, if any. */
  query(sql: string): Promise<void> {
    const done = new Promise<void>((resolve, reject) => this.readies.push((error) => (error ? reject(new Error(`${sql}: ${error}`)) : resolve())))
    this.ws.send(queryMessage(sql))
    return done
  }

  end() {
    this.ws.send(TERMINATE)
    this.ws.close()
  }
}

/** A notice's or error's SQLSTATE. */
const code = (body: Buffer) => /\0C([^\0]*)\0/.exec(body.toString('latin1'))?.[1] ?? ''

/** Each session's `sql`, 500 sessions at a time (the pool's backends take them in turn). */
async function inTurn(sessions: Lean[], sql: (i: number) => string) {
  for (let i = 0; i < sessions.length; i += 500) await Promise.all(sessions.slice(i, i + 500).map((c, k) => c.query(sql(i + k))))
}

/**
 * `n` lean WebSocket sessions through a transaction-mode proxy: first PER_CHANNEL to a channel with
 * the writers at FAN_RATE, then all on one channel at ONE_CHANNEL_DELIVERIES / n NOTIFYs a second;
 * then the listening backend is killed.
 */
async function fanOut(n: number, target: { host: string; port: number; database: string }, admin: pg.Client, writer: pg.ClientConfig): Promise<Row[]> {
  const { host, port, database } = target
  const app = `${APP}-tx`
  const flags = ['--pool-mode', 'transaction', '--max-sessions', '100000', '--max-sessions-per-ip', '100000', '--max-logins-per-ip', '100000', '--shutdown-grace', '0']
  const p = await startGcProxy(`${host}:${port}`, flags, undefined, true)
  const rows: Row[] = []
  const at = `${n.toLocaleString()} listeners`
  let one: Awaited<ReturnType<typeof deliver>> | undefined
  let protocols: string[] = []
  try {
    const config = { host, port, database, user: 'scram_user', password: PASSWORD, application_name: app, wsProxy: () => p.url }
    protocols = await offeredLogin((extra) => ((c) => c.connect().then(() => c))(new Client({ ...config, webSocketConstructor: WebSocket as any, ...extra } as any)))
    const channels = n / PER_CHANNEL
    const sessions: Lean[] = []
    const open = async (upTo: number) => {
      const from = sessions.length
      for (let i = from; i < upTo; i += 250) sessions.push(...(await Promise.all(Array.from({ length: Math.min(250, upTo - i) }, () => Lean.open(p.url, protocols)))))
      await inTurn(sessions.slice(from), (i) => `LISTEN bench_${(from + i) % channels}`)
    }
    // Per idle listener: the proxy's RSS after a full GC, from WARM listeners to n (what the first ones cost once, the heap's growth, is not theirs).
    await open(WARM)
    await sleep(500)
    const before = (await p.memoryAfterGc()).rss
    await open(n)
    await sleep(500)
    const rssPer = ((await p.memoryAfterGc()).rss - before) / (n - WARM)
    const held = await admin.query("SELECT count(*) FILTER (WHERE application_name = $1)::int AS pool, count(*) FILTER (WHERE application_name = 'edgepg-proxy listener: ' || $1)::int AS listening FROM pg_stat_activity", [app])
    rows.push(
      { metric: `transaction mode, ${at}: Postgres backends for listening (and idle in the pool)`, edgepg: `${held.rows[0].listening} (${held.rows[0].pool})`, baseline: '' },
      { metric: `transaction mode, ${at}: proxy RSS per idle listener (after GC, past the first ${WARM})`, edgepg: `${(rssPer / 1024).toFixed(1)} KiB`, baseline: '' }
    )
    const seconds = n >= 10_000 ? LOSS_SECONDS : FAN_SECONDS
    const many = await deliver(sessions, writer, (i) => `bench_${i % channels}`, FAN_RATE, seconds, PER_CHANNEL)
    rows.push(
      { metric: `transaction mode, ${at}, ${channels} channels, ${(FAN_RATE * PER_CHANNEL).toLocaleString()} deliveries/s: p50`, edgepg: ms(many.p50), baseline: '' },
      { metric: `transaction mode, ${at}, ${channels} channels: p99`, edgepg: ms(many.p99), baseline: '' },
      { metric: `transaction mode, ${at}: of ${many.sent.toLocaleString()} NOTIFYs, deliveries lost / duplicated`, edgepg: `${many.lost} / ${many.duplicated}`, baseline: '' }
    )
    await inTurn(sessions, () => 'UNLISTEN *; LISTEN bench_all')
    one = await deliver(sessions, writer, () => 'bench_all', ONE_CHANNEL_DELIVERIES / n, FAN_SECONDS, n)
    // The listening backend killed: how long until every session is told, and until it listens again.
    const killed = performance.now()
    await admin.query("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = 'edgepg-proxy listener: ' || $1", [app])
    const told = await allHave(sessions, '08006', killed)
    const again = await allHave(sessions, '00000', killed)
    rows.push({ metric: `transaction mode, ${at}: listener killed → every session told / listening again`, edgepg: `${ms(told)} / ${ms(again)}`, baseline: '' })
    for (const c of sessions) c.end()
  } finally {
    await p.stop()
  }
  // (The floor runs once the proxy's sessions are gone; its rows go ahead of the kill's.)
  const floor = await broadcastFloor(n, protocols)
  rows.splice(
    -1,
    0,
    { metric: `transaction mode, ${at}, one channel, ${ONE_CHANNEL_DELIVERIES.toLocaleString()} deliveries/s: p50`, edgepg: ms(one!.p50), baseline: ms(floor.p50), ratio: one!.p50 / floor.p50 },
    { metric: `transaction mode, ${at}, one channel: p99`, edgepg: ms(one!.p99), baseline: ms(floor.p99), ratio: one!.p99 / floor.p99 }
  )
  return rows
}

/** The same one-channel workload from a bare WebSocket server that broadcasts (bench/ws-broadcast.ts) to `n` lean sessions. */
async function broadcastFloor(n: number, protocols: string[]) {
  const server = await startWsBroadcast()
  const url = `ws://127.0.0.1:${server.port}`
  const all: Lean[] = []
  try {
    for (let i = 0; i < n + WRITERS; i += 250) all.push(...(await Promise.all(Array.from({ length: Math.min(250, n + WRITERS - i) }, () => Lean.open(url, protocols)))))
    const writers = all.slice(n).map((w) => (_: number, payload: string) => w.query(`NOTIFY_ALL ${payload}`))
    return await paced(all.slice(0, n), writers, ONE_CHANNEL_DELIVERIES / n, FAN_SECONDS, n)
  } finally {
    for (const c of all) c.end()
    await server.stop()
  }
}

/** Until every session has a notice with `code`: the time from `since` (Infinity if some never do, within 10 s). */
async function allHave(sessions: Lean[], code: string, since: number): Promise<number> {
  for (let waited = 0; waited < 10_000; waited += 2) {
    if (sessions.every((c) => c.notices.includes(code))) return performance.now() - since
    await sleep(2)
  }
  return Infinity
}

/** WRITERS writers at `rate` NOTIFYs a second for `seconds`, on `channel(i)` for the i-th: delays, and each session's count against what its channels were sent. */
async function deliver(sessions: Lean[], writer: pg.ClientConfig, channel: (i: number) => string, rate: number, seconds: number, perChannel: number) {
  const clients = await Promise.all(
    Array.from({ length: WRITERS }, async () => {
      const w = new pg.Client(writer)
      await w.connect()
      return w
    })
  )
  try {
    return await paced(sessions, clients.map((w) => (i: number, payload: string) => w.query('SELECT pg_notify($1, $2)', [channel(i), payload])), rate, seconds, perChannel)
  } finally {
    await Promise.all(clients.map((w) => w.end()))
  }
}

/** `writers` sending notification `i` in turn at `rate` a second for `seconds`; what `deliver` answers. */
async function paced(sessions: Lean[], writers: ((i: number, payload: string) => Promise<unknown>)[], rate: number, seconds: number, perChannel: number) {
  const delays: number[] = []
  const seen = sessions.map(() => new Set<string>())
  let duplicated = 0
  sessions.forEach((c, k) => {
    c.onNotification = (payload) => {
      const [id, stamp] = payload.split(' ')
      if (seen[k].has(id)) duplicated++
      seen[k].add(id)
      delays.push(performance.now() - Number(stamp))
    }
  })
  const sends = Math.round(rate * seconds)
  const start = performance.now()
  await Promise.all(
    writers.map(async (send, k) => {
      for (let i = k; i < sends; i += writers.length) {
        await send(i, `${i} ${performance.now()}`)
        await sleep(Math.max(0, start + ((i + writers.length) / rate) * 1000 - performance.now()))
      }
    })
  )
  const expected = sends * perChannel
  for (let waited = 0; delays.length < expected && waited < 10_000; waited += 50) await sleep(50)
  for (const c of sessions) c.onNotification = undefined
  return { sent: sends, lost: expected - (delays.length - duplicated), duplicated, p50: percentile(delays, 50), p99: percentile(delays, 99) }
}

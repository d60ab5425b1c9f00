/**
 * Section "sessions": what a cold session (new Client, connect, SELECT 1, end) costs at the
 * database, with edgepg-proxy's warm backends on and off, against pg over TCP, in one run.
 *
 * - Sessions per second on loopback, one after another and 16 at a time.
 * - Backends Postgres forked for 1,000 sequential sessions (pg_stat_database.sessions).
 * - Connect + first query at 10 ms and 50 ms RTT (a delay relay in front of each proxy, a turn
 *   counter in front of that): round trips, and the local milliseconds beyond them.
 */
import net from 'node:net'
import pg from 'pg'
import { WebSocket } from 'ws'
import { Client } from '../src/index'
import { startDelayRelay } from '../test/support/delay-relay'
import { PASSWORD } from '../test/support/stack'
import { median, printGrid, type BenchContext, type Row, type Section } from './lib'
import { startProxy, startWsEcho } from './proxy'
import { startTurnCounter } from './turn-counter'

const SEQUENTIAL = 300
const CONCURRENT = 16
const CONCURRENT_TOTAL = 480
const FORK_SESSIONS = 1000
const LATENCY_RUNS = 21
const RATE_TARGET = 5 // warm sessions one after another, x pg over TCP
const FLOOR_SHARE_TARGET = 0.7 // warm sessions, x the bare WebSocket floor
const LOCAL_MS_TARGET = 3

type Key = 'warm' | 'off' | 'pg' | 'floor'
const HEADERS: Record<Key, string> = { warm: 'edgepg, warm backends', off: 'edgepg, --no-pool', pg: 'pg (TCP)', floor: 'floor: bare WebSocket' }
const KEYS: readonly Key[] = ['warm', 'off', 'pg', 'floor']

/** A session against the bare WebSocket server: open (offering a subprotocol), its first message, one exchange, close. */
const bareSession = (port: number) => (): Session => {
  let ws: WebSocket
  let next: (() => void) | undefined
  const message = () => new Promise<void>((resolve) => (next = resolve))
  return {
    async connect() {
      ws = new WebSocket(`ws://127.0.0.1:${port}/`, ['edgepg.v2'])
      ws.on('message', () => next?.())
      await message()
    },
    async query() {
      const answered = message()
      ws.send(Buffer.alloc(40))
      await answered
    },
    end: () => new Promise<void>((resolve) => (ws.once('close', () => resolve()), ws.close(1000))),
  }
}

/**
 * A round trip through the delay relay as it really is (its timers fire late): the median of small
 * ping-pongs to an echo server behind it.
 */
async function relayRoundTrip(oneWay: number): Promise<number> {
  const echo = net.createServer((s) => s.pipe(s))
  await new Promise<void>((resolve) => echo.listen(0, '127.0.0.1', resolve))
  const delay = await startDelayRelay({ host: '127.0.0.1', port: (echo.address() as net.AddressInfo).port }, oneWay)
  const socket = net.connect({ host: '127.0.0.1', port: delay.port, noDelay: true })
  await new Promise((resolve) => socket.once('connect', resolve))
  const times: number[] = []
  for (let i = 0; i < LATENCY_RUNS + 1; i++) {
    const started = performance.now()
    await new Promise((resolve) => (socket.once('data', resolve), socket.write('ping')))
    if (i > 0) times.push(performance.now() - started)
  }
  socket.destroy()
  await delay.close()
  echo.close()
  return median(times)
}

interface Session {
  connect(): Promise<unknown>
  query(text: string): Promise<unknown>
  end(): Promise<unknown>
}

async function run(make: () => Session) {
  const client = make()
  await client.connect()
  await client.query('SELECT 1')
  await client.end()
}

/** Sessions per second: `total` sessions, `parallel` at a time. */
async function rate(make: () => Session, total: number, parallel: number): Promise<number> {
  let left = total
  const started = performance.now()
  await Promise.all(
    Array.from({ length: parallel }, async () => {
      while (left-- > 0) await run(make)
    })
  )
  return total / ((performance.now() - started) / 1000)
}

export const sessions: Section = {
  name: 'sessions',
  async run(ctx: BenchContext): Promise<Row[]> {
    const upstream = `${ctx.pg.host}:${ctx.pg.port}`
    const db = { host: ctx.pg.host, port: ctx.pg.port, database: ctx.pg.database, user: 'scram_user', password: PASSWORD, application_name: 'edgepg-bench-sessions' }
    const edge = (port: number) => () => new Client({ ...db, webSocketConstructor: WebSocket as any, wsProxy: () => `ws://127.0.0.1:${port}/v2` })
    const stoppers: (() => Promise<void>)[] = []
    try {
      const warmProxy = await startProxy(upstream, 'child')
      stoppers.push(warmProxy.stop)
      const offProxy = await startProxy(upstream, 'child', { pool: false })
      stoppers.push(offProxy.stop)
      const floor = await startWsEcho()
      stoppers.push(floor.stop)
      const make: Record<Key, () => Session> = { warm: edge(warmProxy.port), off: edge(offProxy.port), pg: () => new pg.Client(db), floor: bareSession(floor.port) }
      // Warm-up, one after another and 16 at a time: the pool then holds the backends 16 sessions at
      // once use (warm backends), and their logins to Postgres fall outside the measured runs. The
      // two sides of the floor ratio run until their processes' JIT is warm (their rates double meanwhile).
      for (const key of KEYS) {
        for (let i = 0; i < 20; i++) await run(make[key])
        await rate(make[key], CONCURRENT * 4, CONCURRENT)
      }
      for (const key of ['warm', 'floor'] as const) await rate(make[key], 500, 1), await rate(make[key], 2000, CONCURRENT)

      const sequential = {} as Record<Key, number>
      const parallel = {} as Record<Key, number>
      /** The server's CPU per sequential session (the proxy's, or the floor's; pg's is Postgres's own). */
      const serverCpu: Partial<Record<Key, number>> = {}
      const servers: Partial<Record<Key, { cpuSeconds(): number }>> = { warm: warmProxy, off: offProxy, floor }
      for (const key of KEYS) {
        const before = servers[key]?.cpuSeconds()
        sequential[key] = await rate(make[key], SEQUENTIAL, 1)
        if (before !== undefined) serverCpu[key] = (servers[key]!.cpuSeconds() - before) / SEQUENTIAL
      }
      for (const key of KEYS) parallel[key] = await rate(make[key], CONCURRENT_TOTAL, CONCURRENT)

      // Backends forked: the distinct backends that served the sessions (each asks for its pid).
      const pids = new Set<number>()
      const forkApp = `edgepg-bench-forks-${process.pid}` // a key of its own: nothing warm from above
      for (let i = 0; i < FORK_SESSIONS; i++) {
        const client = new Client({ ...db, application_name: forkApp, webSocketConstructor: WebSocket as any, wsProxy: () => `ws://127.0.0.1:${warmProxy.port}/v2` })
        await client.connect()
        pids.add((await client.query('SELECT pg_backend_pid() AS pid')).rows[0].pid)
        await client.end()
      }
      const forks = pids.size

      // Latency at 10 and 50 ms RTT.
      const latency: Array<{ rtt: number; key: Key; turns: number; ms: number }> = []
      const measured = new Map<number, number>()
      for (const oneWay of [5, 25]) {
        measured.set(2 * oneWay, await relayRoundTrip(oneWay))
        for (const key of ['warm', 'off', 'floor'] as const) {
          const port = { warm: warmProxy.port, off: offProxy.port, floor: floor.port }[key]
          const delay = await startDelayRelay({ host: '127.0.0.1', port }, oneWay)
          stoppers.push(delay.close)
          const counter = await startTurnCounter({ host: '127.0.0.1', port: delay.port })
          stoppers.push(counter.close)
          const times: number[] = []
          let turns = 0
          for (let i = 0; i < LATENCY_RUNS + 1; i++) {
            const client = key === 'floor' ? bareSession(counter.port)() : edge(counter.port)()
            const started = performance.now()
            await client.connect()
            await client.query('SELECT 1')
            const ms = performance.now() - started
            turns = Math.max(turns, counter.latestTurns())
            await client.end()
            if (i > 0) times.push(ms) // the first warms this path up
          }
          latency.push({ rtt: 2 * oneWay, key, turns, ms: median(times) })
        }
      }

      /** Milliseconds beyond the round trips, each as long as the relay's measured round trip. */
      const local = (m: { rtt: number; turns: number; ms: number }) => m.ms - m.turns * measured.get(m.rtt)!
      const perSecond = (x: number) => `${x.toFixed(0)}/s`
      /** Warm sessions' rate as a share of the floor's, against issue 23's target. */
      const floorShare = (r: Record<Key, number>) => [`${(r.warm / r.floor).toFixed(2)}x`, `>= ${FLOOR_SHARE_TARGET}x`, r.warm / r.floor >= FLOOR_SHARE_TARGET ? 'pass' : 'MISS']
      const rateRatio = sequential.warm / sequential.pg
      printGrid(
        'sessions: cold sessions (new Client, connect, SELECT 1, end) on loopback',
        ['sessions', ...KEYS.map((k) => HEADERS[k]), 'warm / pg', 'target', 'result', 'warm / floor', 'target', 'result'],
        [
          [`${SEQUENTIAL} one after another`, ...KEYS.map((k) => perSecond(sequential[k])), `${rateRatio.toFixed(2)}x`, `>= ${RATE_TARGET}x`, rateRatio >= RATE_TARGET ? 'pass' : 'MISS', ...floorShare(sequential)],
          [`${CONCURRENT_TOTAL}, ${CONCURRENT} at a time`, ...KEYS.map((k) => perSecond(parallel[k])), `${(parallel.warm / parallel.pg).toFixed(2)}x`, '', '', ...floorShare(parallel)],
          ['server CPU per session, one after another', ...KEYS.map((k) => (serverCpu[k] === undefined ? '(Postgres)' : `${Math.round(serverCpu[k]! * 1e6)} µs`)), '', '', '', '', '', ''],
        ],
        [
          `Role scram_user (SCRAM-SHA-256 at Postgres; edgepg-proxy authenticates for edgepg), both proxies in child processes, ` +
            `the same Postgres. pg over TCP forks and authenticates a backend per session; so does edgepg with --no-pool.`,
          `The floor: a bare WebSocket server in a child process (bench/ws-echo.ts) and a bare ws client: open, one message ` +
            `each way, close; no Postgres, no pg. No WebSocket session can be faster here.`,
        ]
      )
      const poolSize = 20 // --pool-size's default: the most one key keeps
      printGrid('sessions: backends Postgres forked for sequential cold sessions through warm backends', ['sessions', 'backends forked', 'target', 'result'], [
        [`${FORK_SESSIONS}`, `${forks}`, `<= ${poolSize} (the pool's size per key)`, forks <= poolSize ? 'pass' : 'MISS'],
      ], ['Each session (new Client, connect, SELECT pg_backend_pid(), end) reports its backend; counted: distinct pids.'])
      printGrid(
        'sessions: connect + first query behind a delay relay: round trips, and local milliseconds beyond them',
        ['RTT (as measured)', 'warm backends', '--no-pool', 'floor: bare WebSocket', 'target (warm)', 'result'],
        [10, 50].map((rtt) => {
          const cell = (key: Key) => {
            const m = latency.find((l) => l.rtt === rtt && l.key === key)!
            return `${m.turns} RT + ${local(m).toFixed(1)} ms`
          }
          const warm = local(latency.find((l) => l.rtt === rtt && l.key === 'warm')!)
          return [`${rtt} ms (${measured.get(rtt)!.toFixed(1)} ms)`, cell('warm'), cell('off'), cell('floor'), `<= ${LOCAL_MS_TARGET} ms`, warm <= LOCAL_MS_TARGET ? 'pass' : 'MISS']
        }),
        [
          `Median of ${LATENCY_RUNS} after one warm-up; round trips counted by a turn counter in front of the delay relay, ` +
            `each worth the relay's round trip as measured (a ping-pong through it: its timers fire late).`,
        ]
      )
      const local50 = latency.find((l) => l.rtt === 50 && l.key === 'warm')!
      return [
        { metric: 'cold sessions one after another, warm backends vs pg (TCP): rate', edgepg: perSecond(sequential.warm), baseline: perSecond(sequential.pg), ratio: sequential.pg / sequential.warm, target: 1 / RATE_TARGET },
        { metric: `backends forked for ${FORK_SESSIONS} sequential sessions`, edgepg: `${forks}`, baseline: '', ratio: forks, target: poolSize },
        { metric: 'connect + first query at 50 ms RTT: ms beyond the round trips', edgepg: `${local50.turns} RT + ${local(local50).toFixed(1)} ms`, baseline: '', ratio: local(local50), target: LOCAL_MS_TARGET },
      ]
    } finally {
      for (const stop of stoppers.reverse()) await stop().catch(() => {})
    }
  },
}

/**
 * Section "proxy" (`npx tsx bench/run.ts proxy`): what going through edgepg-proxy costs, against
 * pg over TCP straight to the same Postgres, on loopback: warm `SELECT 1` latency, 100,000-row results (small rows, and ~1 KB
 * rows, ~100 MB, where the proxy's relaying is most of the work), and whole sessions per second
 * (connect + one query + close), one at a time and 16 at a time. Drivers alternate in rounds so
 * machine noise hits both alike. No targets: this section reports the cost, it does not gate it.
 */
import pg from 'pg'
import { Client } from '../src/index'
import { gc, interleave, median, ms, percentile, printTable, type BenchContext, type Row, type Section } from './lib'

const LATENCY_WARMUP = 200
const LATENCY_ROUNDS = 10
const LATENCY_PER_ROUND = 200 // 10 × 200 = 2,000 measured queries per driver
const ROWS = 100_000
const ROWS_RUNS = 5
const RESULTS = [
  {
    label: `${ROWS.toLocaleString('en-US')} rows x 5 cols`,
    sql: `SELECT g AS id, g::text AS name, g * 1.5 AS score, now() AS ts, (g % 2 = 0) AS flag FROM generate_series(1, ${ROWS}) g`,
  },
  {
    label: `${ROWS.toLocaleString('en-US')} rows x ~1 KB`,
    sql: `SELECT lpad(g::text, 10, '0') || repeat('x', 990) AS line FROM generate_series(1, ${ROWS}) g`,
  },
] as const
const SESSION_WARMUP = 20
const SESSIONS_SEQUENTIAL = 200
const SESSIONS_CONCURRENT = 480
const CONCURRENCY = 16

const DRIVERS = ['edgepg', 'pg'] as const
type Driver = (typeof DRIVERS)[number]

export const proxycost: Section = {
  name: 'proxy',
  async run(ctx: BenchContext): Promise<Row[]> {
    const open = (d: Driver): pg.Client => (d === 'edgepg' ? new Client(ctx.edgeConfig()) : new pg.Client(ctx.pgConfig()))
    const clients: Record<Driver, pg.Client> = { edgepg: open('edgepg'), pg: open('pg') }
    // An idle client's connection error would otherwise be an uncaught 'error' event.
    let failure: Error | undefined
    for (const [name, c] of Object.entries(clients)) c.on('error', (err) => (failure ??= new Error(`proxycost: ${name} client failed: ${err.message}`)))
    const check = () => {
      if (failure) throw failure
    }
    const rows: Row[] = []
    const notes: string[] = []
    try {
      await Promise.all(Object.values(clients).map((c) => c.connect()))

      // Warm SELECT 1 on an open connection.
      const one = async (client: pg.Client) => {
        const t0 = performance.now()
        const { rows } = await client.query('SELECT 1 AS one')
        const dt = performance.now() - t0
        if (rows[0]?.one !== 1) throw new Error(`proxycost: SELECT 1 answered ${JSON.stringify(rows[0])}`)
        return dt
      }
      for (const d of DRIVERS) for (let i = 0; i < LATENCY_WARMUP; i++) await one(clients[d])
      const lat: Record<Driver, number[]> = { edgepg: [], pg: [] }
      await interleave(DRIVERS, LATENCY_ROUNDS, async (d) => {
        check()
        gc()
        for (let i = 0; i < LATENCY_PER_ROUND; i++) lat[d].push(await one(clients[d]))
      })
      for (const [stat, p] of [['median', 50], ['p99', 99]] as const) {
        const e = percentile(lat.edgepg, p)
        const b = percentile(lat.pg, p)
        rows.push({ metric: `warm SELECT 1, ${stat} of ${lat.pg.length}`, edgepg: ms(e), baseline: ms(b), ratio: e / b })
      }
      const extra = median(lat.edgepg) - median(lat.pg)
      notes.push(`Warm SELECT 1: the proxy adds ${(extra * 1000).toFixed(0)} µs at the median.`)

      // 100k-row results, fully parsed into row objects by pg.
      for (const { label, sql } of RESULTS) {
        let bytes = 0
        const big = async (client: pg.Client) => {
          gc()
          const t0 = performance.now()
          const result = await client.query(sql)
          const dt = performance.now() - t0
          if (result.rows.length !== ROWS) throw new Error(`proxycost: expected ${ROWS} rows, got ${result.rows.length}`)
          return dt
        }
        for (const d of DRIVERS) await big(clients[d]) // one warm-up run each
        const runs: Record<Driver, number[]> = { edgepg: [], pg: [] }
        await interleave(DRIVERS, ROWS_RUNS, async (d) => {
          check()
          runs[d].push(await big(clients[d]))
        })
        // Result size on the wire: one more (untimed) run, counting what pg's socket receives.
        const socket = (clients.pg as any).connection.stream as NodeJS.EventEmitter
        const count = (chunk: Buffer) => (bytes += chunk.length)
        socket.on('data', count)
        await big(clients.pg).finally(() => socket.off('data', count))
        const e = median(runs.edgepg)
        const b = median(runs.pg)
        const rate = (msValue: number) => `${((ROWS / msValue) * 1000 / 1e6).toFixed(2)}M rows/s`
        rows.push({ metric: `${label}, median of ${ROWS_RUNS}`, edgepg: `${ms(e)} (${rate(e)})`, baseline: `${ms(b)} (${rate(b)})`, ratio: e / b })
        const mbps = (msValue: number) => `, ${(bytes / 1e6 / (msValue / 1000)).toFixed(0)} MB/s`
        notes.push(`${label} (${(bytes / 1e6).toFixed(1)} MB from Postgres) runs (ms): edgepg [${runs.edgepg.map((x) => x.toFixed(0)).join(', ')}]${mbps(e)}; pg [${runs.pg.map((x) => x.toFixed(0)).join(', ')}]${mbps(b)}`)
      }
      check()
    } finally {
      await Promise.all(Object.values(clients).map((c) => c.end().catch(() => {})))
    }

    // Whole sessions: connect, SELECT 1, close; one at a time, then CONCURRENCY at a time.
    const session = async (d: Driver) => {
      const c = open(d)
      let error: Error | undefined
      c.on('error', (err) => (error ??= err))
      try {
        await c.connect()
        const { rows } = await c.query('SELECT 1 AS one')
        if (rows[0]?.one !== 1) throw new Error(`proxycost: SELECT 1 answered ${JSON.stringify(rows[0])}`)
      } finally {
        await c.end()
      }
      if (error) throw new Error(`proxycost: ${d} session failed: ${error.message}`)
    }
    const sessionsPerSecond = async (d: Driver, total: number, concurrency: number) => {
      gc()
      let next = 0
      const t0 = performance.now()
      await Promise.all(
        Array.from({ length: concurrency }, async () => {
          while (next < total) {
            next++
            await session(d)
          }
        })
      )
      return (total / (performance.now() - t0)) * 1000
    }
    for (const d of DRIVERS) for (let i = 0; i < SESSION_WARMUP; i++) await session(d)
    for (const [label, total, concurrency] of [
      ['one at a time', SESSIONS_SEQUENTIAL, 1],
      [`${CONCURRENCY} at a time`, SESSIONS_CONCURRENT, CONCURRENCY],
    ] as const) {
      // Two alternating halves per driver; the rate is over both.
      const rates: Record<Driver, number[]> = { edgepg: [], pg: [] }
      await interleave(DRIVERS, 2, async (d) => {
        rates[d].push(await sessionsPerSecond(d, total / 2, concurrency))
      })
      const e = 2 / (1 / rates.edgepg[0] + 1 / rates.edgepg[1])
      const b = 2 / (1 / rates.pg[0] + 1 / rates.pg[1])
      const fmt = (r: number) => `${r.toFixed(0)}/s (${ms(1000 / r)})`
      // Ratio of time per session, like every other row: above 1 means edgepg is slower.
      rows.push({ metric: `sessions/s, connect+SELECT 1+close, ${label} (${total})`, edgepg: fmt(e), baseline: fmt(b), ratio: b / e })
    }

    printTable('proxy: the cost of edgepg-proxy vs pg over TCP (loopback)', rows, 'pg (TCP)', [
      `edgepg goes through edgepg-proxy (${ctx.proxy.mode === 'child' ? 'a separate child process, as in production' : 'in this same process'}); ` +
        `pg connects over TCP straight to the same Postgres; role scram_user (the proxy does SCRAM for edgepg, pg does it itself). ` +
        `Ratios are edgepg's time over pg's (above 1: edgepg slower), for rates too. ` +
        `Latency: ${LATENCY_ROUNDS} alternating rounds of ${LATENCY_PER_ROUND} after ${LATENCY_WARMUP} warm-up each. ` +
        `Rows: ${ROWS_RUNS} alternating runs after 1 warm-up each, a full GC before each. ` +
        `Sessions: ${SESSION_WARMUP} warm-up each, then two alternating halves per driver (rate over both), a new connection per session, closed with end().`,
      ...notes,
    ])
    return rows
  },
}

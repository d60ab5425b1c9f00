/**
 * Section "core": warm single-query latency and 100,000-row SELECTs (5 columns; ~1 KB rows), for
 * edgepg through edgepg-proxy and for pg over TCP straight to the same Postgres, interleaved in
 * rounds so machine noise hits both drivers alike. Latency is also judged against its floor: pg
 * through a bare TCP relay process, the cost of one extra hop with no WebSocket at all; and beside
 * it, edgepg's client through a bare WebSocket-to-TCP relay, the cost of the WebSocket itself.
 */
import pg from 'pg'
import { Client } from '../src/index'
import { gc, interleave, median, ms, percentile, printTable, type BenchContext, type Row, type Section } from './lib'
import { startTcpRelay, startWsRelay } from './proxy'

const LATENCY_WARMUP = 100
const LATENCY_ROUNDS = 20
const LATENCY_PER_ROUND = 100 // 20 × 100 = 2,000 measured queries per driver
const ROWS = 100_000
const ROWS_RUNS = 7
const ROWS_SQL = `SELECT g AS id, g::text AS name, g * 1.5 AS score, now() AS ts, (g % 2 = 0) AS flag FROM generate_series(1, ${ROWS}) g`
const WIDE_SQL = `SELECT lpad(g::text, 10, '0') || repeat('x', 990) AS line FROM generate_series(1, ${ROWS}) g`

const LATENCY_TARGET = 1.5
/** Warm latency, at most this many times pg's through a bare TCP relay. */
const RELAY_TARGET = 1.3
const ROWS_TARGET = 1.15
/** ~1 KB rows: at least this share of pg's throughput. */
const WIDE_SHARE_TARGET = 0.9

type Driver = 'edgepg' | 'pg' | 'relay' | 'wsRelay'
const DRIVERS = ['edgepg', 'pg'] as const
const LATENCY_DRIVERS = ['edgepg', 'pg', 'relay', 'wsRelay'] as const

export const core: Section = {
  name: 'core',
  async run(ctx: BenchContext): Promise<Row[]> {
    const relay = await startTcpRelay(`${ctx.pg.host}:${ctx.pg.port}`)
    const wsRelay = await startWsRelay(`${ctx.pg.host}:${ctx.pg.port}`)
    const clients: Record<Driver, pg.Client> = {
      edgepg: new Client(ctx.edgeConfig()),
      pg: new pg.Client(ctx.pgConfig()),
      relay: new pg.Client({ ...ctx.pgConfig(), port: relay.port }),
      // The bare relay knows no login: the client runs SCRAM itself, and waits for each answer.
      wsRelay: new Client({ ...ctx.edgeConfig(), wsProxy: () => `ws://127.0.0.1:${wsRelay.port}/v2`, authOffload: false, pipelineConnect: false }),
    }
    // An idle client's connection error would otherwise be an uncaught 'error' event.
    let failure: Error | undefined
    for (const [name, c] of Object.entries(clients)) c.on('error', (err) => (failure ??= new Error(`core: ${name} client failed: ${err.message}`)))
    const check = () => {
      if (failure) throw failure
    }
    try {
      await Promise.all(Object.values(clients).map((c) => c.connect()))

      // Warm single-query latency.
      let n = 0
      const one = async (client: pg.Client) => {
        const v = ++n % 1_000_000
        const t0 = performance.now()
        const { rows } = await client.query('SELECT $1::int AS v', [v])
        const dt = performance.now() - t0
        if (rows[0].v !== v) throw new Error(`core: expected ${v}, got ${rows[0].v}`)
        return dt
      }
      for (const d of LATENCY_DRIVERS) for (let i = 0; i < LATENCY_WARMUP; i++) await one(clients[d])
      const lat: Record<Driver, number[]> = { edgepg: [], pg: [], relay: [], wsRelay: [] }
      await interleave(LATENCY_DRIVERS, LATENCY_ROUNDS, async (d) => {
        check()
        gc()
        for (let i = 0; i < LATENCY_PER_ROUND; i++) lat[d].push(await one(clients[d]))
      })

      // 100k rows, fully parsed into row objects by pg.
      const big = async (client: pg.Client, sql: string) => {
        gc()
        const t0 = performance.now()
        const { rows } = await client.query(sql)
        const dt = performance.now() - t0
        if (rows.length !== ROWS) throw new Error(`core: expected ${ROWS} rows, got ${rows.length}`)
        return dt
      }
      const bulkOf = async <D extends Driver>(sql: string, drivers: readonly D[]) => {
        for (const d of drivers) await big(clients[d], sql) // one warm-up run each
        const times = Object.fromEntries(drivers.map((d) => [d, [] as number[]])) as Record<D, number[]>
        await interleave(drivers, ROWS_RUNS, async (d) => {
          check()
          times[d].push(await big(clients[d], sql))
        })
        return times
      }
      const bulk = await bulkOf(ROWS_SQL, DRIVERS)
      const wide = await bulkOf(WIDE_SQL, [...DRIVERS, 'wsRelay'] as const)
      check()

      const latMed = { edgepg: median(lat.edgepg), pg: median(lat.pg), relay: median(lat.relay), wsRelay: median(lat.wsRelay) }
      const latP99 = { edgepg: percentile(lat.edgepg, 99), pg: percentile(lat.pg, 99) }
      const bulkMed = { edgepg: median(bulk.edgepg), pg: median(bulk.pg) }
      const wideMed = { edgepg: median(wide.edgepg), pg: median(wide.pg), wsRelay: median(wide.wsRelay) }
      const rows: Row[] = [
        {
          metric: `warm latency, median of ${lat.pg.length} SELECT $1::int`,
          edgepg: ms(latMed.edgepg),
          baseline: ms(latMed.pg),
          ratio: latMed.edgepg / latMed.pg,
          target: LATENCY_TARGET,
        },
        {
          metric: `warm latency, median, vs pg through a bare TCP relay`,
          edgepg: ms(latMed.edgepg),
          baseline: `${ms(latMed.relay)} (relay)`,
          ratio: latMed.edgepg / latMed.relay,
          target: RELAY_TARGET,
        },
        {
          metric: `warm latency, p99 of ${lat.pg.length} SELECT $1::int`,
          edgepg: ms(latP99.edgepg),
          baseline: ms(latP99.pg),
          ratio: latP99.edgepg / latP99.pg,
        },
        {
          metric: `${ROWS.toLocaleString('en-US')} rows x 5 cols, median of ${ROWS_RUNS}`,
          edgepg: ms(bulkMed.edgepg),
          baseline: ms(bulkMed.pg),
          ratio: bulkMed.edgepg / bulkMed.pg,
          target: ROWS_TARGET,
        },
        {
          metric: `${ROWS.toLocaleString('en-US')} rows x ~1 KB (101 MB), median of ${ROWS_RUNS}: time (throughput share ${(wideMed.pg / wideMed.edgepg).toFixed(2)}x, target >= ${WIDE_SHARE_TARGET}x)`,
          edgepg: ms(wideMed.edgepg),
          baseline: ms(wideMed.pg),
          ratio: wideMed.edgepg / wideMed.pg,
          target: 1 / WIDE_SHARE_TARGET,
        },
      ]
      const runs = (xs: number[]) => xs.map((x) => x.toFixed(0)).join(', ')
      printTable('core: edgepg via edgepg-proxy vs pg over TCP', rows, 'pg (TCP)', [
        `edgepg goes through edgepg-proxy (${ctx.proxy.mode === 'child' ? 'a separate child process, as in production' : 'in this same process'}); ` +
          `pg connects over TCP straight to the same Postgres; role scram_user. Latency: ${LATENCY_ROUNDS} rounds of ` +
          `${LATENCY_PER_ROUND} queries per driver in alternating order, after ${LATENCY_WARMUP} warm-up each. ` +
          `Rows: ${ROWS_RUNS} alternating runs after 1 warm-up each, a full GC before each run.`,
        `The hop's floor: pg through a bare Node TCP relay child process (bench/tcp-relay.ts), no WebSocket, interleaved ` +
          `with the others: median ${ms(latMed.relay)} = ${(latMed.relay / latMed.pg).toFixed(2)}x pg direct. ` +
          `The WebSocket's own floor: edgepg's client through a bare WebSocket-to-TCP relay child (bench/ws-relay.ts; no login, ` +
          `no pool, nothing read), median ${ms(latMed.wsRelay)} = ${(latMed.wsRelay / latMed.relay).toFixed(2)}x the TCP relay (edgepg-proxy: ${(latMed.edgepg / latMed.relay).toFixed(2)}x); ` +
          `100k x ~1 KB through it: ${ms(wideMed.wsRelay)}, ${(wideMed.pg / wideMed.wsRelay).toFixed(2)}x pg's throughput (edgepg-proxy: ${(wideMed.pg / wideMed.edgepg).toFixed(2)}x).`,
        `100k x 5 runs (ms): edgepg [${runs(bulk.edgepg)}]; pg [${runs(bulk.pg)}]. 100k x ~1 KB runs (ms): edgepg [${runs(wide.edgepg)}]; pg [${runs(wide.pg)}]; bare WebSocket relay [${runs(wide.wsRelay)}]`,
      ])
      return rows
    } finally {
      await Promise.all(Object.values(clients).map((c) => c.end().catch(() => {})))
      await relay.stop()
      await wsRelay.stop()
    }
  },
}

/**
 * Section "core": warm single-query latency and a 100,000-row × 5-column SELECT, for edgepg
 * through edgepg-proxy and for pg over TCP straight to the same Postgres, interleaved in rounds
 * so machine noise hits both drivers alike.
 */
import pg from 'pg'
import { Client } from '../src/index'
import { interleave, median, ms, percentile, printTable, type BenchContext, type Row, type Section } from './lib'

const LATENCY_WARMUP = 100
const LATENCY_ROUNDS = 10
const LATENCY_PER_ROUND = 100 // 10 × 100 = 1,000 measured queries per driver
const ROWS = 100_000
const ROWS_RUNS = 5
const ROWS_SQL = `SELECT g AS id, g::text AS name, g * 1.5 AS score, now() AS ts, (g % 2 = 0) AS flag FROM generate_series(1, ${ROWS}) g`

const LATENCY_TARGET = 1.5
const ROWS_TARGET = 1.15

type Driver = 'edgepg' | 'pg'
const DRIVERS = ['edgepg', 'pg'] as const

export const core: Section = {
  name: 'core',
  async run(ctx: BenchContext): Promise<Row[]> {
    const clients: Record<Driver, pg.Client> = {
      edgepg: new Client(ctx.edgeConfig()),
      pg: new pg.Client(ctx.pgConfig()),
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
      for (const d of DRIVERS) for (let i = 0; i < LATENCY_WARMUP; i++) await one(clients[d])
      const lat: Record<Driver, number[]> = { edgepg: [], pg: [] }
      await interleave(DRIVERS, LATENCY_ROUNDS, async (d) => {
        for (let i = 0; i < LATENCY_PER_ROUND; i++) lat[d].push(await one(clients[d]))
      })

      // 100k rows × 5 columns, fully parsed into row objects by pg.
      const big = async (client: pg.Client) => {
        const t0 = performance.now()
        const { rows } = await client.query(ROWS_SQL)
        const dt = performance.now() - t0
        if (rows.length !== ROWS) throw new Error(`core: expected ${ROWS} rows, got ${rows.length}`)
        return dt
      }
      for (const d of DRIVERS) await big(clients[d]) // warm-up run each
      const bulk: Record<Driver, number[]> = { edgepg: [], pg: [] }
      await interleave(DRIVERS, ROWS_RUNS, async (d) => void bulk[d].push(await big(clients[d])))

      const latMed = { edgepg: median(lat.edgepg), pg: median(lat.pg) }
      const latP99 = { edgepg: percentile(lat.edgepg, 99), pg: percentile(lat.pg, 99) }
      const bulkMed = { edgepg: median(bulk.edgepg), pg: median(bulk.pg) }
      const rows: Row[] = [
        {
          metric: `warm latency, median of ${lat.pg.length} SELECT $1::int`,
          edgepg: ms(latMed.edgepg),
          baseline: ms(latMed.pg),
          ratio: latMed.edgepg / latMed.pg,
          target: LATENCY_TARGET,
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
      ]
      printTable('core: edgepg via edgepg-proxy vs pg over TCP', rows, 'pg (TCP)', [
        `edgepg goes through edgepg-proxy (${ctx.proxy.mode === 'child' ? 'a separate child process, as in production' : 'in this same process'}); ` +
          `pg connects over TCP straight to the same Postgres. Role scram_user. Drivers alternate in ` +
          `${LATENCY_ROUNDS} rounds of ${LATENCY_PER_ROUND} queries (after ${LATENCY_WARMUP} warm-up each) and ` +
          `${ROWS_RUNS} alternating bulk runs (after 1 warm-up each).`,
        `100k runs (ms): edgepg [${bulk.edgepg.map((x) => x.toFixed(0)).join(', ')}]; pg [${bulk.pg.map((x) => x.toFixed(0)).join(', ')}]`,
      ])
      return rows
    } finally {
      await Promise.all(Object.values(clients).map((c) => c.end().catch(() => {})))
    }
  },
}

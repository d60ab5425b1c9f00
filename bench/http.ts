/**
 * Section "http" (`npx tsx bench/run.ts http`): SQL over HTTP. Warm query latency and requests per
 * second, one at a time and 32 at a time, for edgepg's `httpSql` via edgepg-proxy's POST /sql,
 * `@neondatabase/serverless`'s `neon()` via the same endpoint, and, for reference, a pg.Pool over
 * TCP straight to Postgres. Drivers alternate in rounds so machine noise hits all alike. No
 * targets: this section reports, it does not gate.
 */
import http from 'node:http'
import pg from 'pg'
import { neon, neonConfig } from '@neondatabase/serverless'
import { httpSql } from '../src/index'
import { sqlHandler } from '../proxy/sql'
import { gc, interleave, median, ms, percentile, printGrid, type BenchContext, type Row, type Section } from './lib'

const LATENCY_WARMUP = 100
const LATENCY_ROUNDS = 10
const LATENCY_PER_ROUND = 100 // 1,000 measured queries per driver
const THROUGHPUT_ROUNDS = 3
const THROUGHPUT_QUERIES = { 1: 500, 32: 4000 } as const // per round, per driver
const CONCURRENCY = [1, 32] as const

const DRIVERS = ['edgepg', 'neon', 'pg'] as const
type Driver = (typeof DRIVERS)[number]
const LABELS: Record<Driver, string> = { edgepg: 'edgepg httpSql (HTTP)', neon: 'neon() (HTTP)', pg: 'pg.Pool (TCP)' }

/** edgepg-proxy's /sql if the bench proxy serves it; otherwise the same handler on an in-process server. */
async function sqlEndpoint(ctx: BenchContext, connectionString: string): Promise<{ url: string; where: string; stop(): Promise<void> }> {
  const url = `http://127.0.0.1:${ctx.proxy.port}/sql`
  const probe = await fetch(url, {
    method: 'POST',
    headers: { 'Neon-Connection-String': connectionString, 'Neon-Raw-Text-Output': 'true', 'Neon-Array-Mode': 'true' },
    body: '{"query":"SELECT 1","params":[]}',
  }).catch(() => undefined)
  if (probe?.ok) return { url, where: `edgepg-proxy's /sql (${ctx.proxy.mode === 'child' ? 'a child process, as deployed' : 'in this process'})`, stop: async () => {} }
  const handler = sqlHandler({ upstream: { host: ctx.pg.host, port: ctx.pg.port }, pool: { max: 40 } })
  const server = http.createServer((req, res) => handler.handle(req, res))
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
  const { port } = server.address() as { port: number }
  return {
    url: `http://127.0.0.1:${port}/sql`,
    where: "proxy/sql.ts's handler on a server in this process (the bench proxy does not serve /sql yet)",
    async stop() {
      server.closeAllConnections()
      await new Promise((r) => server.close(r))
      await handler.close()
    },
  }
}

export const httpBench: Section = {
  name: 'http',
  async run(ctx: BenchContext): Promise<Row[]> {
    const cfg = ctx.pgConfig()
    const connectionString = `postgresql://${cfg.user}:${encodeURIComponent(String(cfg.password))}@${cfg.host}:${cfg.port}/${cfg.database}`
    const endpoint = await sqlEndpoint(ctx, connectionString)
    const savedEndpoint = neonConfig.fetchEndpoint
    neonConfig.fetchEndpoint = endpoint.url
    const sql = httpSql(connectionString, { fetchEndpoint: endpoint.url })
    const neonSql = neon(connectionString, { disableWarningInBrowsers: true } as any)
    const pool = new pg.Pool({ ...cfg, max: 32 })
    pool.on('error', () => {})

    let n = 0
    const queries: Record<Driver, (v: number) => Promise<any[]>> = {
      edgepg: (v) => sql`SELECT ${v}::int AS v`,
      neon: (v) => neonSql`SELECT ${v}::int AS v`,
      pg: async (v) => (await pool.query('SELECT $1::int AS v', [v])).rows,
    }
    const one = async (d: Driver) => {
      const v = ++n % 1_000_000
      const t0 = performance.now()
      const rows = await queries[d](v)
      const dt = performance.now() - t0
      if (rows[0]?.v !== v) throw new Error(`http bench: ${d} expected ${v}, got ${JSON.stringify(rows[0])}`)
      return dt
    }
    /** Requests per second for `total` queries with `concurrency` in flight. */
    const throughput = async (d: Driver, concurrency: number, total: number) => {
      let issued = 0
      const t0 = performance.now()
      await Promise.all(
        Array.from({ length: concurrency }, async () => {
          while (issued < total) {
            issued++
            await one(d)
          }
        })
      )
      return total / ((performance.now() - t0) / 1000)
    }

    try {
      // Warm-up: keep-alive connections to the endpoint, the endpoint's pooled connections, pg.Pool's.
      for (const d of DRIVERS) {
        for (let i = 0; i < LATENCY_WARMUP; i++) await one(d)
        await throughput(d, 32, 320)
      }
      const lat: Record<Driver, number[]> = { edgepg: [], neon: [], pg: [] }
      await interleave(DRIVERS, LATENCY_ROUNDS, async (d) => {
        gc()
        for (let i = 0; i < LATENCY_PER_ROUND; i++) lat[d].push(await one(d))
      })
      const rps: Record<number, Record<Driver, number[]>> = {}
      for (const c of CONCURRENCY) {
        rps[c] = { edgepg: [], neon: [], pg: [] }
        await interleave(DRIVERS, THROUGHPUT_ROUNDS, async (d) => {
          gc()
          rps[c][d].push(await throughput(d, c, THROUGHPUT_QUERIES[c]))
        })
      }

      const per = (f: (d: Driver) => string) => DRIVERS.map(f)
      const rate = (x: number) => `${Math.round(x).toLocaleString('en-US')}/s`
      const cells = [
        [`warm latency, median of ${lat.pg.length} SELECT $1::int`, ...per((d) => ms(median(lat[d])))],
        [`warm latency, p99 of ${lat.pg.length}`, ...per((d) => ms(percentile(lat[d], 99)))],
        ...CONCURRENCY.map((c) => [`requests/s, concurrency ${c} (median of ${THROUGHPUT_ROUNDS} x ${THROUGHPUT_QUERIES[c]})`, ...per((d) => rate(median(rps[c][d])))]),
      ]
      printGrid('http: SQL over HTTP (edgepg httpSql, neon()) vs pg.Pool over TCP', ['metric', ...per((d) => LABELS[d])], cells, [
        `Both HTTP drivers POST to ${endpoint.where}, with Node's fetch (keep-alive); every request takes a pooled Postgres ` +
          `connection in the proxy and resets it (DISCARD ALL) after. pg.Pool (max 32) connects over TCP straight to the same ` +
          `Postgres: the reference for what HTTP costs. Role scram_user. ${LATENCY_ROUNDS} alternating rounds of ${LATENCY_PER_ROUND} ` +
          `queries per driver after ${LATENCY_WARMUP} warm-up each.`,
      ])
      const medians = { edgepg: median(lat.edgepg), neon: median(lat.neon), pg: median(lat.pg) }
      return [
        { metric: 'http: warm latency median, edgepg httpSql vs pg.Pool (TCP)', edgepg: ms(medians.edgepg), baseline: ms(medians.pg), ratio: medians.edgepg / medians.pg },
        { metric: 'http: warm latency median, edgepg httpSql vs neon()', edgepg: ms(medians.edgepg), baseline: ms(medians.neon), ratio: medians.edgepg / medians.neon },
        ...CONCURRENCY.map((c) => ({
          metric: `http: requests/s at concurrency ${c}, edgepg httpSql vs pg.Pool (TCP)`,
          edgepg: rate(median(rps[c].edgepg)),
          baseline: rate(median(rps[c].pg)),
        })),
      ]
    } finally {
      neonConfig.fetchEndpoint = savedEndpoint
      await pool.end().catch(() => {})
      await endpoint.stop()
    }
  },
}

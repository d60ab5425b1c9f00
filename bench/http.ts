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
import { sqlHandler } from '../proxy/sql/handler'
import { gc, interleave, median, ms, percentile, printGrid, type BenchContext, type Row, type Section } from './lib'
import { startHttpFloor, startHttpPg } from './proxy'

const LATENCY_WARMUP = 100
const LATENCY_ROUNDS = 10
const LATENCY_PER_ROUND = 100 // 1,000 measured queries per driver
const THROUGHPUT_ROUNDS = 3
const THROUGHPUT_QUERIES = { 1: 500, 32: 4000 } as const // per round, per driver
const CONCURRENCY = [1, 32] as const

const DRIVERS = ['edgepg', 'neon', 'pg'] as const
type Driver = (typeof DRIVERS)[number]
const LABELS: Record<Driver, string> = { edgepg: 'edgepg httpSql (HTTP)', neon: 'neon() (HTTP)', pg: 'pg.Pool (TCP)' }

const LEAN = ['sql', 'floor', 'httpPg', 'pg'] as const
type Lean = (typeof LEAN)[number]
const LEAN_LABELS: Record<Lean, string> = { sql: 'POST /sql (edgepg-proxy)', floor: 'floor: bare HTTP server', httpPg: 'bare HTTP server + pg.Pool', pg: 'pg.Pool query (TCP)' }
const LEAN_ROUNDS = 10
const LEAN_PER_ROUND = 200
const LEAN_CONCURRENCY = 32
const LEAN_TOTAL = 4000
/** /sql's cost over the floor, at most this many pg.Pool queries. */
const OVER_FLOOR_TARGET = 2
/** /sql's rate at 32 in flight, at least this share of the floor's. */
const RATE_SHARE_TARGET = 0.6

/** POSTs with http.request on a keep-alive agent: a server's cost, without fetch's own (~1 ms a request here). */
export function leanPoster(url: string, headers: Record<string, string>) {
  const agent = new http.Agent({ keepAlive: true, maxSockets: LEAN_CONCURRENCY })
  const { hostname, port, pathname } = new URL(url)
  return {
    post: (body: string) =>
      new Promise<string>((resolve, reject) => {
        const req = http.request({ host: hostname, port, path: pathname, method: 'POST', agent, headers: { ...headers, 'content-length': Buffer.byteLength(body) } }, (res) => {
          let text = ''
          res.setEncoding('utf8')
          res.on('data', (chunk) => (text += chunk))
          res.on('end', () => (res.statusCode === 200 ? resolve(text) : reject(new Error(`HTTP ${res.statusCode}: ${text}`))))
        })
        req.on('error', reject)
        req.end(body)
      }),
    close: () => agent.destroy(),
  }
}

/**
 * POST /sql as a server, with a lean client: latency one at a time and the rate at 32 in flight,
 * against a bare HTTP server answering the same body (the floor) and the same query on pg.Pool.
 */
async function leanServer(url: string, connectionString: string, pool: pg.Pool): Promise<Row[]> {
  const headers = { 'neon-connection-string': connectionString, 'neon-raw-text-output': 'true', 'neon-array-mode': 'true', 'content-type': 'application/json' }
  const request = (v: number) => JSON.stringify({ query: 'SELECT $1::int AS v', params: [v] })
  const sql = leanPoster(url, headers)
  const sample = await sql.post(request(7))
  const floorServer = await startHttpFloor(sample)
  const floor = leanPoster(`http://127.0.0.1:${floorServer.port}/sql`, headers)
  const httpPgServer = await startHttpPg(connectionString)
  const httpPg = leanPoster(`http://127.0.0.1:${httpPgServer.port}/sql`, headers)
  let n = 0
  const one: Record<Lean, () => Promise<unknown>> = {
    sql: async () => {
      const v = ++n % 1_000_000
      const text = await sql.post(request(v))
      if (!text.includes(`[["${v}"]]`)) throw new Error(`http bench: /sql answered ${text}`)
    },
    floor: () => floor.post(request(++n)),
    httpPg: async () => {
      const v = ++n % 1_000_000
      const text = await httpPg.post(request(v))
      if (!text.includes(`[[${v}]]`)) throw new Error(`http bench: http + pg.Pool answered ${text}`)
    },
    pg: () => pool.query('SELECT $1::int AS v', [++n % 1_000_000]),
  }
  const rate = async (key: Lean) => {
    let issued = 0
    const t0 = performance.now()
    await Promise.all(Array.from({ length: LEAN_CONCURRENCY }, async () => {
      while (issued++ < LEAN_TOTAL) await one[key]()
    }))
    return LEAN_TOTAL / ((performance.now() - t0) / 1000)
  }
  try {
    for (const key of LEAN) for (let i = 0; i < 200; i++) await one[key]()
    const lat: Record<Lean, number[]> = { sql: [], floor: [], httpPg: [], pg: [] }
    await interleave(LEAN, LEAN_ROUNDS, async (key) => {
      gc()
      for (let i = 0; i < LEAN_PER_ROUND; i++) {
        const t0 = performance.now()
        await one[key]()
        lat[key].push(performance.now() - t0)
      }
    })
    const rps: Record<Lean, number[]> = { sql: [], floor: [], httpPg: [], pg: [] }
    await interleave(LEAN, 3, async (key) => {
      gc()
      rps[key].push(await rate(key))
    })
    const m = Object.fromEntries(LEAN.map((k) => [k, median(lat[k])])) as Record<Lean, number>
    const r = Object.fromEntries(LEAN.map((k) => [k, median(rps[k])])) as Record<Lean, number>
    const over = m.sql - m.floor
    const share = r.sql / r.floor
    const perSecond = (x: number) => `${Math.round(x).toLocaleString('en-US')}/s`
    printGrid(
      'http: POST /sql as a server, with a lean client (http.request, keep-alive)',
      ['metric', ...LEAN.map((k) => LEAN_LABELS[k]), '/sql over the floor', 'target', 'result'],
      [
        [`latency, median of ${lat.sql.length} (one at a time)`, ...LEAN.map((k) => ms(m[k])), `${ms(over)} = ${(over / m.pg).toFixed(2)}x a pg query`, `<= ${OVER_FLOOR_TARGET}x`, over <= OVER_FLOOR_TARGET * m.pg ? 'pass' : 'MISS'],
        [`requests/s, ${LEAN_CONCURRENCY} in flight (median of 3 x ${LEAN_TOTAL})`, ...LEAN.map((k) => perSecond(r[k])), `${share.toFixed(2)}x the floor's rate`, `>= ${RATE_SHARE_TARGET}x`, share >= RATE_SHARE_TARGET ? 'pass' : 'MISS'],
      ],
      [
        `The floor is a bare Node HTTP server in a child process that reads the request and answers /sql's own response body ` +
          `(${sample.length} bytes); /sql runs in edgepg-proxy's child process; pg.Pool (max 32) queries Postgres over TCP. ` +
          `The client is Node's http.request on a keep-alive agent (32 sockets). ${LEAN_ROUNDS} alternating rounds of ${LEAN_PER_ROUND}.`,
        `The least a hand-written SQL-over-HTTP endpoint does (bench/http-pg.ts: parse the JSON, pg.Pool query, answer the rows; no ` +
          `credentials per request, limits, timeouts or types) costs ${ms(m.httpPg - m.floor)} over the floor = ${((m.httpPg - m.floor) / m.pg).toFixed(2)}x a pg query, ` +
          `and runs at ${(r.httpPg / r.floor).toFixed(2)}x the floor's rate at ${LEAN_CONCURRENCY} in flight.`,
      ]
    )
    return [
      { metric: 'http: /sql as a server, cost over the bare-HTTP floor, in pg.Pool queries', edgepg: ms(over), baseline: ms(m.pg), ratio: over / m.pg, target: OVER_FLOOR_TARGET },
      { metric: `http: /sql at ${LEAN_CONCURRENCY} in flight, the floor's rate over /sql's`, edgepg: perSecond(r.sql), baseline: perSecond(r.floor), ratio: r.floor / r.sql, target: 1 / RATE_SHARE_TARGET },
    ]
  } finally {
    sql.close()
    floor.close()
    httpPg.close()
    await floorServer.stop()
    await httpPgServer.stop()
  }
}

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
    where: "proxy/sql/handler.ts's handler on a server in this process (the bench proxy does not serve /sql yet)",
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
        `Both HTTP drivers POST to ${endpoint.where}, with Node's fetch (keep-alive), as a Node user of httpSql sees it (fetch alone ` +
          `costs about 1 ms a request here; the server alone is measured below); every request takes a warm backend in the proxy. pg.Pool (max 32) connects over TCP straight to the same ` +
          `Postgres: the reference for what HTTP costs. Role scram_user. ${LATENCY_ROUNDS} alternating rounds of ${LATENCY_PER_ROUND} ` +
          `queries per driver after ${LATENCY_WARMUP} warm-up each.`,
      ])
      const medians = { edgepg: median(lat.edgepg), neon: median(lat.neon), pg: median(lat.pg) }
      return [
        ...(await leanServer(endpoint.url, connectionString, pool)),
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

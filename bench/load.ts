/**
 * Section "load": 500 sessions querying back to back, the shape of the load test, and what the
 * process in the middle spends per query. edgepg through edgepg-proxy (warm backends) against its
 * floor: pg through a bare Node TCP relay (bench/tcp-relay.ts), which does nothing per message but
 * read and write. Both are child processes; their CPU is read from /proc. A Postgres of its own,
 * with room for the sessions.
 */
import pg from 'pg'
import { WebSocket } from 'ws'
import { Client } from '../src/index'
import { startPostgres, pgConfig } from '../test/support/stack'
import { interleave, printGrid, type Row, type Section } from './lib'
import { startProxy, startTcpRelay, type RunningRelay } from './proxy'

const SESSIONS = 500
const CONNECT_BATCH = 50
const ROUNDS = 2
const SECONDS = 6

type Middle = 'edgepg-proxy' | 'tcp relay'
const MIDDLES = ['edgepg-proxy', 'tcp relay'] as const

export const loadBench: Section = {
  name: 'load',
  async run(): Promise<Row[]> {
    const db = await startPostgres({ name: 'bench-load', settings: { max_connections: String(2 * SESSIONS + 50), shared_buffers: '32MB' } })
    const upstream = `${db.host}:${db.port}`
    const config = pgConfig('scram_user', db)
    const middles: Record<Middle, RunningRelay> = {
      'edgepg-proxy': await startProxy(upstream, 'child', { flags: ['--max-sessions', '5000', '--max-sessions-per-ip', '5000'] }),
      'tcp relay': await startTcpRelay(upstream),
    }
    const open = (m: Middle): pg.Client =>
      m === 'edgepg-proxy'
        ? new Client({ ...config, webSocketConstructor: WebSocket as any, wsProxy: () => `ws://127.0.0.1:${middles[m].port}/v2` })
        : new pg.Client({ ...config, port: middles[m].port })
    const sessions: Record<Middle, pg.Client[]> = { 'edgepg-proxy': [], 'tcp relay': [] }
    try {
      for (const m of MIDDLES) {
        for (let i = 0; i < SESSIONS; i += CONNECT_BATCH) {
          const batch = Array.from({ length: CONNECT_BATCH }, () => open(m))
          sessions[m].push(...batch)
          await Promise.all(batch.map(async (c) => (await c.connect(), await c.query('SELECT 1'))))
        }
      }
      const totals: Record<Middle, { queries: number; seconds: number; cpu: number }> = {
        'edgepg-proxy': { queries: 0, seconds: 0, cpu: 0 },
        'tcp relay': { queries: 0, seconds: 0, cpu: 0 },
      }
      await interleave(MIDDLES, ROUNDS, async (m) => {
        const cpu0 = middles[m].cpuSeconds()
        const t0 = performance.now()
        const deadline = t0 + SECONDS * 1000
        let queries = 0
        await Promise.all(
          sessions[m].map(async (c, s) => {
            for (let i = 0; performance.now() < deadline; i++) {
              const v = s * 100_000 + i
              const { rows } = await c.query('SELECT $1::int AS v', [v])
              if (rows[0].v !== v) throw new Error(`load: expected ${v}, got ${rows[0].v}`)
              queries++
            }
          })
        )
        totals[m].queries += queries
        totals[m].seconds += (performance.now() - t0) / 1000
        totals[m].cpu += middles[m].cpuSeconds() - cpu0
      })
      const perQuery = (m: Middle) => (totals[m].cpu * 1e6) / totals[m].queries
      const rate = (m: Middle) => totals[m].queries / totals[m].seconds
      const cells = MIDDLES.map((m) => [m, `${rate(m).toFixed(0)}/s`, `${perQuery(m).toFixed(1)} µs`, `${((totals[m].cpu / totals[m].seconds) * 100).toFixed(0)}%`])
      const ratio = perQuery('edgepg-proxy') / perQuery('tcp relay')
      printGrid(`load: ${SESSIONS} sessions back to back, CPU of the process in the middle`, ['middle', 'queries', 'CPU per query', 'of one core'], cells, [
        `${SESSIONS} sessions per middle, SELECT $1::int back to back, ${ROUNDS} alternating rounds of ${SECONDS} s. edgepg-proxy with warm backends; ` +
          `pg through the bare TCP relay is the floor for any process relaying the same queries: edgepg-proxy spends ${ratio.toFixed(2)}x its CPU per query.`,
      ])
      return [
        {
          metric: `proxy CPU per query, ${SESSIONS} sessions, vs a bare TCP relay's`,
          edgepg: `${perQuery('edgepg-proxy').toFixed(1)} µs`,
          baseline: `${perQuery('tcp relay').toFixed(1)} µs (relay)`,
          ratio,
        },
      ]
    } finally {
      await Promise.all(Object.values(sessions).flat().map((c) => c.end().catch(() => {})))
      for (const m of MIDDLES) await middles[m].stop()
      await db.stop()
    }
  },
}

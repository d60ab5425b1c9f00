/**
 * Section "workers" (issue 23): how far a second worker carries. Proxy-bound throughput through
 * edgepg-proxy children (as shipped, dist/cli.mjs) with --workers 1 and --workers 2, in alternating
 * rounds of one run: warm queries from many sessions back to back, and cold sessions (new Client,
 * connect, SELECT 1, end) 16 at a time. The load generator shares the machine: its cores and load
 * are printed with the table.
 */
import os from 'node:os'
import { WebSocket } from 'ws'
import { Client, type ClientConfig } from '../src/index'
import { startChildProxy, type ChildProxy } from '../test/support/child-proxy'
import { interleave, median, printGrid, type BenchContext, type Row, type Section } from './lib'

const WARM_SESSIONS = 64
const COLD_AT_ONCE = 16
const ROUND_MS = 3000
const ROUNDS = 3
const QUERY = 'SELECT 1'
type Side = 'one' | 'two'
const SIDES = ['one', 'two'] as const
const FLAGS: Record<Side, string> = { one: '1', two: '2' }

export const workers: Section = {
  name: 'workers',
  async run(ctx) {
    const upstream = `${ctx.pg.host}:${ctx.pg.port}`
    const proxies: Partial<Record<Side, ChildProxy>> = {}
    const warm: Record<Side, number[]> = { one: [], two: [] }
    const cold: Record<Side, number[]> = { one: [], two: [] }
    const cpu: Record<Side, number> = { one: 0, two: 0 }
    const load = os.loadavg()
    try {
      for (const side of SIDES) {
        proxies[side] = await startChildProxy(upstream, { built: true, env: { EDGEPG_WORKERS: FLAGS[side] }, flags: ['--max-sessions-per-ip', '10000', '--shutdown-grace', '0'] })
      }
      const config = (side: Side): ClientConfig => ({ ...ctx.edgeConfig(), webSocketConstructor: WebSocket as any, wsProxy: () => proxies[side]!.url })
      const sessions = Object.fromEntries(
        await Promise.all(SIDES.map(async (side) => [side, await Promise.all(Array.from({ length: WARM_SESSIONS }, async () => { const c = new Client(config(side)); await c.connect(); return c }))]))
      ) as Record<Side, Client[]>
      await interleave(SIDES, ROUNDS, async (side) => {
        const until = performance.now() + ROUND_MS
        let queries = 0
        const t0 = performance.now()
        await Promise.all(sessions[side].map(async (c) => { while (performance.now() < until) await c.query(QUERY), queries++ }))
        warm[side].push(queries / ((performance.now() - t0) / 1000))
        let opened = 0
        const c0 = performance.now()
        const coldUntil = c0 + ROUND_MS
        await Promise.all(Array.from({ length: COLD_AT_ONCE }, async () => {
          while (performance.now() < coldUntil) {
            const c = new Client(config(side))
            await c.connect()
            await c.query(QUERY)
            await c.end()
            opened++
          }
        }))
        cold[side].push(opened / ((performance.now() - c0) / 1000))
      })
      for (const side of SIDES) await Promise.all(sessions[side].map((c) => c.end()))
    } finally {
      for (const side of SIDES) await proxies[side]?.stop()
    }
    const rate = (r: Record<Side, number[]>, side: Side) => `${Math.round(median(r[side])).toLocaleString('en-US')}/s`
    const ratio = (r: Record<Side, number[]>) => `${(median(r.two) / median(r.one)).toFixed(2)}x`
    printGrid(
      'workers: proxy-bound throughput, --workers 1 and --workers 2',
      ['load', '--workers 1', '--workers 2', 'two over one'],
      [
        [`${WARM_SESSIONS} sessions, "${QUERY}" back to back`, rate(warm, 'one'), rate(warm, 'two'), ratio(warm)],
        [`cold sessions, ${COLD_AT_ONCE} at a time`, rate(cold, 'one'), rate(cold, 'two'), ratio(cold)],
      ],
      [
        `Median of ${ROUNDS} alternating rounds of ${ROUND_MS / 1000} s per load. The machine: ${os.availableParallelism()} cores, load average ${load.map((l) => l.toFixed(2)).join(' ')} at the start; ` +
          `the load generator (this process), the proxy's processes and Postgres all run on it, so a second worker can only take what the others leave.`,
      ]
    )
    return [] as Row[]
  },
}

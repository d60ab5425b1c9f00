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
import { cpuSecondsOf, startChildProxy, type ChildProxy } from '../test/support/child-proxy'
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
    /** The proxy's cores busy (its processes' CPU over the round's time), per round. */
    const busy: Record<'warm' | 'cold', Record<Side, number[]>> = { warm: { one: [], two: [] }, cold: { one: [], two: [] } }
    const load = os.loadavg()
    try {
      for (const side of SIDES) {
        proxies[side] = await startChildProxy(upstream, { built: true, env: { EDGEPG_WORKERS: FLAGS[side] }, flags: ['--max-sessions-per-ip', '10000', '--shutdown-grace', '0'] })
      }
      const config = (side: Side): ClientConfig => ({ ...ctx.edgeConfig(), webSocketConstructor: WebSocket as any, wsProxy: () => proxies[side]!.url })
      const sessions = Object.fromEntries(
        await Promise.all(SIDES.map(async (side) => [side, await Promise.all(Array.from({ length: WARM_SESSIONS }, async () => { const c = new Client(config(side)); await c.connect(); return c }))]))
      ) as Record<Side, Client[]>
      // The CPU of the processes that serve (the workers; a primary only counts).
      const cpuOf = (side: Side) => proxies[side]!.lines.filter((l) => l.listening).reduce((sum, l) => sum + cpuSecondsOf(l.pid), 0)
      await interleave(SIDES, ROUNDS, async (side) => {
        const until = performance.now() + ROUND_MS
        let queries = 0
        const t0 = performance.now()
        let cpu0 = cpuOf(side)
        await Promise.all(sessions[side].map(async (c) => { while (performance.now() < until) await c.query(QUERY), queries++ }))
        warm[side].push(queries / ((performance.now() - t0) / 1000))
        busy.warm[side].push((cpuOf(side) - cpu0) / ((performance.now() - t0) / 1000))
        let opened = 0
        cpu0 = cpuOf(side)
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
        busy.cold[side].push((cpuOf(side) - cpu0) / ((performance.now() - c0) / 1000))
      })
      for (const side of SIDES) await Promise.all(sessions[side].map((c) => c.end()))
    } finally {
      for (const side of SIDES) await proxies[side]?.stop()
    }
    const rate = (r: Record<Side, number[]>, side: Side) => `${Math.round(median(r[side])).toLocaleString('en-US')}/s`
    const ratio = (r: Record<Side, number[]>) => `${(median(r.two) / median(r.one)).toFixed(2)}x`
    const cores = (load: 'warm' | 'cold', side: Side) => median(busy[load][side]).toFixed(2)
    printGrid(
      'workers: proxy-bound throughput, --workers 1 and --workers 2',
      ['load', '--workers 1', '--workers 2', 'two over one', "proxy's cores busy, 1 / 2 workers"],
      [
        [`${WARM_SESSIONS} sessions, "${QUERY}" back to back`, rate(warm, 'one'), rate(warm, 'two'), ratio(warm), `${cores('warm', 'one')} / ${cores('warm', 'two')}`],
        [`cold sessions, ${COLD_AT_ONCE} at a time`, rate(cold, 'one'), rate(cold, 'two'), ratio(cold), `${cores('cold', 'one')} / ${cores('cold', 'two')}`],
      ],
      [
        `Median of ${ROUNDS} alternating rounds of ${ROUND_MS / 1000} s per load. The machine: ${os.availableParallelism()} cores, load average ${load.map((l) => l.toFixed(2)).join(' ')} at the start; ` +
          `the load generator (this process), the proxy's processes and Postgres all run on it, so a second worker can only take what the others leave.`,
        `Cores busy: the proxy's CPU time over the round's (one worker is saturated at 1.00); while it stays below, the proxy is not what bounds the rate here.`,
      ]
    )
    return [] as Row[]
  },
}

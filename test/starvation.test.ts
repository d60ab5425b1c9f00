/**
 * No one user starves the rest (transaction pooling, the default proxy: two workers, --pool-size 20):
 * 1,460 sessions query at a steady pace, first alone, then while another client (from 127.0.0.2) holds
 * 20 sessions that keep state and 20 idle inside a transaction, then alone again. The others get every
 * answer and no error; the other client keeps no more backends than its caps allow (a quarter of the
 * pool pinned, a quarter in transactions while others wait), and none that it keeps serves anyone
 * else meanwhile. Their latencies, alone and beside it, are printed (timing is the benchmarks' to
 * judge). The proxy runs as it ships (dist/cli.mjs, in a child process), so the load (this process)
 * does not share its event loop.
 */
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { WebSocket } from 'ws'
import { Client } from '../src/index'
import { startChildProxy, type ChildProxy } from './support/child-proxy'
import { edgeConfig, eventually, testPostgres, within } from './support/helpers'

const GOOD = 1460
const KEEPING_STATE = 20
const IDLE_IN_TRANSACTION = 20
/** The proxy's default --pool-size. */
const POOL_SIZE = 20
/** Each good session's queries in a phase, at moments drawn at random over PHASE_MS (a steady load overall). */
const QUERIES = 3
const PHASE_MS = 4500

let proxy: ChildProxy
before(async () => {
  const { host, port } = testPostgres()
  proxy = await startChildProxy(`${host}:${port}`, { built: true, env: { EDGEPG_WORKERS: '2' }, flags: ['--max-sessions-per-ip', '5000', '--shutdown-grace', '0'] })
  // (Until both listen, every session goes to the first.)
  await eventually(() => new Set(proxy.lines.filter((l) => l.listening).map((l) => l.pid)).size === 2, 'both workers listening', 15_000)
})
after(() => proxy?.stop())

class FromElsewhere extends WebSocket {
  constructor(url: string, protocols?: string | string[]) {
    super(url, protocols, { localAddress: '127.0.0.2' })
  }
}

const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms))
const median = (xs: number[]) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)]

/** Codes of the errors sessions were ended with (53400: past --max-pinned-sessions). */
const ended: string[] = []

function session(elsewhere = false): Client {
  const c = new Client(edgeConfig(proxy.port, 'scram_user', { ...(elsewhere && { webSocketConstructor: FromElsewhere as any }), application_name: 'edgepg-starvation' }))
  c.on('error', (err: Error & { code?: string }) => ended.push(err.code ?? err.message))
  return c
}

/** Every good session runs `queries` queries at random moments over `ms` (each after the last, if that is late): their latencies, errors and the backends that answered. */
async function phase(clients: Client[], queries = QUERIES, ms = PHASE_MS): Promise<{ latencies: number[]; errors: string[]; pids: Set<number> }> {
  const latencies: number[] = []
  const errors: string[] = []
  const pids = new Set<number>()
  await Promise.all(
    clients.map(async (c, s) => {
      const start = performance.now()
      const moments = Array.from({ length: queries }, () => Math.random() * ms).sort((a, b) => a - b)
      for (const moment of moments) {
        await sleep(moment - (performance.now() - start))
        const t0 = performance.now()
        try {
          const { rows } = await c.query('SELECT $1::int AS v, pg_backend_pid() AS pid', [s])
          if (rows[0].v !== s) errors.push(`session ${s}: wrong answer`)
          latencies.push(performance.now() - t0)
          pids.add(rows[0].pid)
        } catch (err) {
          errors.push(`session ${s}: ${(err as Error & { code?: string }).code} ${(err as Error).message}`)
        }
      }
    })
  )
  return { latencies, errors, pids }
}

const pidOf = async (c: Client): Promise<number> => (await c.query('SELECT pg_backend_pid() AS pid')).rows[0].pid

test(`${GOOD} sessions keep their pace while one client holds ${KEEPING_STATE} sessions with state and ${IDLE_IN_TRANSACTION} idle in a transaction`, { timeout: 180_000 }, async (t) => {
  const good: Client[] = []
  const bad: Client[] = []
  try {
    for (let i = 0; i < GOOD; i += 50) {
      const batch = Array.from({ length: Math.min(50, GOOD - i) }, () => session())
      good.push(...batch)
      await within(30_000, 'connecting', Promise.all(batch.map((c) => c.connect().then(() => c.query('SELECT 1')))))
    }
    // Each measured run follows a shorter one at the same pace: the first measures warm code; the one
    // after the other client came, the settling (its sessions idle in a transaction ended for the others').
    const settling = () => phase(good, QUERIES / 3, PHASE_MS / 3)
    await settling()
    const before = await phase(good)
    assert.deepEqual(before.errors.slice(0, 5), [], 'no errors without the other client')

    // The other client: sessions that keep state (pinned, as far as --max-pinned-sessions lets them;
    // the rest are closed with 53400) and sessions idle after BEGIN (past --max-backends-per-client,
    // ended for the others' sake with 25P03 once they wait), each with the backend it holds. Measured
    // once each has its outcome: its 40 logins' SCRAM, in this process, would otherwise be counted as
    // the others' latency.
    const keeps = ['CREATE TEMP TABLE kept (x int)', 'SELECT pg_advisory_lock(9100 + pg_backend_pid())']
    const holding = new Map<Client, number>()
    const outcomes = new Map<string, number>()
    const count = (what: string) => outcomes.set(what, (outcomes.get(what) ?? 0) + 1)
    await within(30_000, "the other client's sessions", Promise.all(
      Array.from({ length: KEEPING_STATE + IDLE_IN_TRANSACTION }, async (_, i) => {
        const c = session(true)
        bad.push(c)
        try {
          await c.connect()
          await c.query(i < KEEPING_STATE ? keeps[i % keeps.length] : 'BEGIN')
          holding.set(c, await pidOf(c))
          count(i < KEEPING_STATE ? 'kept state' : 'idle in a transaction')
        } catch (err) {
          count(`refused ${(err as Error & { code?: string }).code}`)
        }
      })
    ))
    const settled = await settling()
    const held = await phase(good)
    for (const code of ended) count(`then ended ${code}`)
    // Those of its sessions still open kept their backends all along, and no one else ran on them.
    const kept: number[] = []
    for (const [c, pid] of holding) {
      const now = await pidOf(c).catch(() => undefined) // (ended meanwhile)
      if (now === undefined) continue
      assert.equal(now, pid, 'a session that holds state stays on its backend')
      kept.push(pid)
    }
    t.diagnostic(`the other client: ${JSON.stringify(Object.fromEntries(outcomes))}; still holding ${kept.length} backends`)
    t.diagnostic(`p50 while the other client's sessions were being ended ${median(settled.latencies).toFixed(2)} ms`)
    for (const run of [settled, held]) assert.deepEqual(run.errors.slice(0, 5), [], `no errors for the others (${run.errors.length} in all)`)
    assert.equal(held.latencies.length, GOOD * QUERIES)
    assert.ok(kept.length > 0, 'the other client holds backends')
    assert.ok(kept.length <= POOL_SIZE / 2, `the other client holds ${kept.length} of the pool's ${POOL_SIZE} backends: at most its quarter pinned and its quarter in transactions`)
    assert.deepEqual(kept.filter((pid) => held.pids.has(pid)), [], "no one else's statement ran on a backend the other client held")

    await within(30_000, "closing the other client's sessions", Promise.all(bad.map((c) => c.end().catch(() => {}))))
    await settling()
    const after = await phase(good)
    assert.deepEqual(after.errors.slice(0, 5), [], 'no errors after the other client left')

    const p50Alone = median([...before.latencies, ...after.latencies])
    const p50Held = median(held.latencies)
    t.diagnostic(`p50 alone ${median(before.latencies).toFixed(2)} ms before, ${median(after.latencies).toFixed(2)} ms after; with the other client holding ${p50Held.toFixed(2)} ms (${(p50Held / p50Alone).toFixed(2)}x)`)
  } finally {
    await within(30_000, 'closing', Promise.all([...good, ...bad].map((c) => c.end().catch(() => {}))))
  }
})

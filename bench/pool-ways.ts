/**
 * Section "pool-ways" (issue 48, "one pool, every core"): what each way of sharing one pool between
 * worker processes costs per backend that moves, measured on an idle, logged-in Postgres connection
 * between two worker processes and this one (the primary, through which workers speak, as in cluster):
 * - run: `SELECT 1` on a connection the worker holds (the floor: the parent's ask and the answer);
 * - hand over: the connection's socket passed from one worker to the other through the primary
 *   (its descriptor, as cluster passes a client's), then `SELECT 1` there;
 * - log in anew: a worker closes its connection and logs another in (a shared budget of backend
 *   slots: a place given up on one worker is taken on the other), then `SELECT 1`.
 * Each per move, median and p99 of the wall time, and the CPU of all three processes.
 */
import { fork, type ChildProcess } from 'node:child_process'
import { once } from 'node:events'
import { ms, median, percentile, printGrid, type Section } from './lib'

const MOVES = 400

type Reply = { op: string; id?: number; cpu?: NodeJS.CpuUsage }

function startWorker(url: string): ChildProcess {
  return fork(new URL('./pool-ways-worker.ts', import.meta.url).pathname, [url], { execArgv: ['--import', 'tsx'], serialization: 'json' })
}
const reply = (w: ChildProcess, op: string) => new Promise<[Reply, unknown]>((resolve) => {
  const on = (m: Reply, handle: unknown) => m.op === op && (w.off('message', on), resolve([m, handle]))
  w.on('message', on)
})
const ask = async (w: ChildProcess, m: object, handle?: any) => {
  const done = reply(w, 'done')
  w.send(m, handle)
  await done
}
const cpuOf = async (w: ChildProcess) => {
  const got = reply(w, 'cpu')
  w.send({ op: 'cpu' })
  const c = (await got)[0].cpu!
  return c.user + c.system
}

export const poolWays: Section = {
  name: 'pool-ways',
  async run(ctx) {
    const c = ctx.pgConfig()
    const url = `postgres://${encodeURIComponent(String(c.user))}:${encodeURIComponent(String(c.password))}@${c.host}:${c.port}/${c.database}`
    const workers = [startWorker(url), startWorker(url)]
    await Promise.all(workers.map((w) => reply(w, 'ready')))
    const results: { name: string; median: number; p99: number; cpu: number }[] = []
    try {
      await ask(workers[0], { op: 'login', id: 1 })
      const measure = async (name: string, move: (i: number) => Promise<void>) => {
        for (let i = 0; i < 20; i++) await move(i) // (warm)
        const cpu0 = process.cpuUsage()
        const w0 = await Promise.all(workers.map(cpuOf))
        const times: number[] = []
        for (let i = 0; i < MOVES; i++) {
          const t0 = performance.now()
          await move(i)
          times.push(performance.now() - t0)
        }
        const w1 = await Promise.all(workers.map(cpuOf))
        const own = process.cpuUsage(cpu0)
        const cpu = (own.user + own.system + w1[0] - w0[0] + w1[1] - w0[1]) / MOVES
        results.push({ name, median: median(times), p99: percentile(times, 99), cpu })
      }
      let at = 0 // (the worker holding connection 1)
      await measure('run: SELECT 1 where it is', () => ask(workers[at], { op: 'run', id: 1 }))
      await measure('hand over: its socket to the other worker, then SELECT 1', async () => {
        const given = reply(workers[at], 'given')
        workers[at].send({ op: 'give', id: 1 })
        const [, handle] = await given
        at ^= 1
        await ask(workers[at], { op: 'take', id: 1 }, handle)
      })
      await measure('log in anew: close it, log another in, SELECT 1', () => ask(workers[at], { op: 'relogin', id: 1 }))
    } finally {
      for (const w of workers) w.send({ op: 'end' })
      await Promise.all(workers.map((w) => once(w, 'exit')))
    }
    const [run] = results // (no move: what each move is measured against)
    const cells = results.map((r) => [r.name, ms(r.median), ms(r.p99), `${(r.median / run.median).toFixed(1)}x`, `${r.cpu.toFixed(0)} µs`, `${(r.cpu / run.cpu).toFixed(1)}x`])
    printGrid(`pool-ways: moving a logged-in backend between two workers (${MOVES} moves)`, ['way', 'median', 'p99', 'median over run', 'CPU per move (3 processes)', 'CPU over run'], cells, [
      'Each move is timed from the primary\'s ask to the worker\'s word that SELECT 1 was answered there; "run" is the same round without a move.',
    ])
    return []
  },
}

/**
 * `--workers n`: the primary process. It runs no proxy itself: it forks n workers that accept on one
 * port (node:cluster hands each connection to one), replaces one that dies, passes SIGTERM and
 * SIGHUP on to all, answers /metrics for the whole proxy (prom-client's cluster aggregation), and
 * keeps the session counts that --max-sessions and --max-sessions-per-ip bound for the proxy as a
 * whole (proxy/cluster/worker.ts asks before each session opens).
 */
import cluster, { type Worker } from 'node:cluster'
import { AggregatorRegistry } from 'prom-client'
import type { ToPrimary, ToWorker } from './worker'

export interface PrimaryOptions {
  workers: number
  maxSessions: number
  maxSessionsPerIp: number
  log: (entry: object) => void
}

export function runPrimary(o: PrimaryOptions) {
  const metrics = new AggregatorRegistry()
  const sessions = { total: 0, perIp: new Map<string, number>() }
  /** Each worker's open sessions, by client address: released when it dies. */
  const held = new Map<Worker, Map<string, number>>()
  let stopping = false
  let exitCode = 0

  const count = (worker: Worker, peer: string, by: number) => {
    sessions.total += by
    const n = (sessions.perIp.get(peer) ?? 0) + by
    n > 0 ? sessions.perIp.set(peer, n) : sessions.perIp.delete(peer)
    const mine = held.get(worker)!
    const m = (mine.get(peer) ?? 0) + by
    m > 0 ? mine.set(peer, m) : mine.delete(peer)
  }
  const send = (worker: Worker, message: ToWorker) => worker.isConnected() && worker.send(message)

  const fork = (index: number) => {
    const worker = cluster.fork({ EDGEPG_WORKER_INDEX: String(index) })
    held.set(worker, new Map())
    worker.on('message', (m: ToPrimary) => {
      if (m?.edgepg === 'enter') {
        const refused = sessions.total >= o.maxSessions ? 'too_many_sessions' : (sessions.perIp.get(m.peer) ?? 0) >= o.maxSessionsPerIp ? 'too_many_sessions_per_ip' : undefined
        if (!refused) count(worker, m.peer, 1)
        send(worker, { edgepg: 'entered', id: m.id, refused })
      } else if (m?.edgepg === 'leave') count(worker, m.peer, -1)
      else if (m?.edgepg === 'metrics') {
        metrics.clusterMetrics().then(
          (body) => send(worker, { edgepg: 'metrics', id: m.id, body }),
          (err: Error) => send(worker, { edgepg: 'metrics', id: m.id, error: err.message })
        )
      }
    })
    worker.once('exit', (code, signal) => {
      for (const [peer, n] of held.get(worker)!) count(worker, peer, -n)
      held.delete(worker)
      // Exit code 2 is the CLI's own refusal (it cannot listen, say): a replacement would fail alike.
      if (code === 2 && !stopping) stop(2)
      if (stopping) return void (held.size === 0 && process.exit(exitCode))
      const next = fork(index)
      o.log({ worker: index, exited: { pid: worker.process.pid, code, signal }, replacedBy: next.process.pid })
    })
    return worker
  }
  // The workers accept on the shared socket themselves (the kernel wakes one): the primary passing
  // each connection over IPC (round robin) cost cold sessions a third of their rate.
  cluster.schedulingPolicy = cluster.SCHED_NONE
  for (let i = 0; i < o.workers; i++) fork(i)
  o.log({ primary: process.pid, workers: o.workers })

  function stop(code: number) {
    stopping = true
    exitCode = code
    for (const worker of held.keys()) worker.process.kill('SIGTERM')
  }
  for (const signal of ['SIGINT', 'SIGTERM'] as const) {
    process.on(signal, () => {
      if (stopping) return
      o.log({ shutdown: signal, workers: held.size })
      stop(0)
    })
  }
  process.on('SIGHUP', () => {
    for (const worker of held.keys()) worker.process.kill('SIGHUP')
  })
}

/**
 * `--workers n`: the primary process. It runs no proxy itself: it forks n workers that accept on one
 * port (node:cluster hands each connection to one), replaces one that dies, passes SIGTERM and
 * SIGHUP on to all, replaces them one at a time on SIGUSR2 (a handover), answers /metrics for the
 * whole proxy (prom-client's cluster aggregation), keeps the counts of the limits a worker has
 * filled its share of (proxy/cluster/places.ts), passes the keys a worker logs in on to the
 * others, each keying its pool with the same secret, and holds each key's one listening backend
 * for every worker's sessions (proxy/cluster/listening.ts).
 */
import cluster, { type Worker } from 'node:cluster'
import { randomBytes } from 'node:crypto'
import { AggregatorRegistry } from 'prom-client'
import { PlacesKeeper } from './places'
import { ListeningKeeper } from './listening'
import type { UpstreamTls } from '../upstream/connection'
import type { ToPrimary, ToWorker } from './worker'
import type { Socket } from 'node:net'

export interface PrimaryOptions {
  workers: number
  /** For the listening backends it holds (proxy/cluster/listening.ts). */
  upstreamTls?: UpstreamTls
  log: (entry: object) => void
}

export function runPrimary(o: PrimaryOptions) {
  const metrics = new AggregatorRegistry()
  /** The live workers, by index. */
  const live = new Map<number, Worker>()
  let stopping = false
  let exitCode = 0

  const send = (worker: Worker, message: ToWorker) => worker.isConnected() && worker.send(message)
  const places = new PlacesKeeper(o.workers, (index, m) => {
    const worker = live.get(index)
    if (worker) send(worker, m)
  })

  const listening = new ListeningKeeper(o.upstreamTls, (index, m) => {
    const worker = live.get(index)
    if (worker) send(worker, m)
  })

  const poolSecret = randomBytes(32).toString('base64')

  const fork = (index: number) => {
    const worker = cluster.fork({ EDGEPG_WORKER_INDEX: String(index) })
    live.set(index, worker)
    worker.on('message', (m: ToPrimary, handle?: Socket) => {
      if (m?.edgepg === 'backend') {
        if (m.op === 'want') for (const [other, w] of live) other !== index && send(w, { ...m, from: index })
        // (A backend for a worker gone meanwhile goes back to its giver, its `freed` too.)
        else {
          const to = live.get(m.to) ?? worker
          if (to.isConnected()) to.send(m, handle)
          else handle?.destroy()
        }
      } else if (m?.edgepg === 'places') {
        if (m.op === 'hello') send(worker, { edgepg: 'pool', secret: poolSecret })
        places.hear(index, m)
      } else if (m?.edgepg === 'key') {
        listening.known(m)
        for (const [other, w] of live) if (other !== index) send(w, m)
      } else if (m?.edgepg === 'listen') {
        listening.hear(index, m)
      } else if (m?.edgepg === 'signal') {
        const to = live.get(m.to)
        if (to) send(to, m)
      }
      else if (m?.edgepg === 'metrics') {
        metrics.clusterMetrics().then(
          (body) => send(worker, { edgepg: 'metrics', id: m.id, body }),
          (err: Error) => send(worker, { edgepg: 'metrics', id: m.id, error: err.message })
        )
      }
    })
    worker.once('exit', (code, signal) => {
      live.delete(index)
      places.gone(index)
      listening.gone(index)
      // Exit code 2 is the CLI's own refusal (it cannot listen, say): a replacement would fail alike.
      if (code === 2 && !stopping) stop(2)
      if (stopping) return void (live.size === 0 && (listening.close(), process.exit(exitCode)))
      const next = fork(index)
      o.log({ worker: index, exited: { pid: worker.process.pid, code, signal }, replacedBy: next.process.pid })
      next.once('listening', () => replaced.get(index)?.())
    })
    return worker
  }
  /** Handovers waiting for worker `index`'s replacement to listen. */
  const replaced = new Map<number, () => void>()
  // The workers accept on the shared socket themselves (the kernel wakes one): the primary passing
  // each connection over IPC (round robin) cost cold sessions a third of their rate.
  cluster.schedulingPolicy = cluster.SCHED_NONE
  for (let i = 0; i < o.workers; i++) fork(i)
  o.log({ primary: process.pid, workers: o.workers })

  function stop(code: number) {
    stopping = true
    exitCode = code
    for (const worker of live.values()) worker.process.kill('SIGTERM')
  }
  for (const signal of ['SIGINT', 'SIGTERM'] as const) {
    process.on(signal, () => {
      if (stopping) return
      o.log({ shutdown: signal, workers: live.size })
      stop(0)
    })
  }
  process.on('SIGHUP', () => {
    for (const worker of live.values()) worker.process.kill('SIGHUP')
  })
  // A handover (a new version installed, say): each worker in turn stops accepting and drains while
  // the others accept, and is replaced from the code on disk; the next goes once its replacement listens.
  let handingOver = false
  process.on('SIGUSR2', async () => {
    if (handingOver || stopping) return o.log({ handover: handingOver ? 'already under way' : 'not while stopping' })
    handingOver = true
    o.log({ handover: 'started', workers: live.size })
    for (const index of [...live.keys()]) {
      const worker = live.get(index)
      if (!worker || stopping) break
      await new Promise<void>((resolve) => {
        replaced.set(index, resolve)
        worker.once('exit', () => stopping && resolve())
        send(worker, { edgepg: 'retire' })
      })
      replaced.delete(index)
    }
    handingOver = false
    o.log({ handover: stopping ? 'cut short: stopping' : 'done', workers: live.size })
  })
}

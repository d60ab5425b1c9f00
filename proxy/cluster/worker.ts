/**
 * `--workers n`: what a worker asks its primary (proxy/cluster/primary.ts), over node:cluster's IPC:
 * whether a session may open (the proxy-wide session limits), and the whole proxy's metrics.
 */
import { AggregatorRegistry, type Registry } from 'prom-client'

export type ToPrimary = { edgepg: 'enter'; id: number; peer: string } | { edgepg: 'leave'; peer: string } | { edgepg: 'metrics'; id: number }
export type ToWorker = { edgepg: 'entered'; id: number; refused?: SessionRefusal } | { edgepg: 'metrics'; id: number; body?: string; error?: string }
export type SessionRefusal = 'too_many_sessions' | 'too_many_sessions_per_ip'

/** Sessions counted for the whole proxy: `enter` before a session opens, `leave` once it (or its upgrade) ends. */
export interface Admission {
  enter(peer: string): Promise<SessionRefusal | undefined>
  leave(peer: string): void
}

/** This worker's side of the primary's counts and metrics (`report` names the registry the primary reads). */
export function workerLink() {
  let next = 0
  const waiting = new Map<number, (m: ToWorker) => void>()
  process.on('message', (m: ToWorker) => {
    if (m?.edgepg !== 'entered' && m?.edgepg !== 'metrics') return
    waiting.get(m.id)?.(m)
    waiting.delete(m.id)
  })
  const ask = (message: ToPrimary & { id: number }) => new Promise<ToWorker>((resolve) => (waiting.set(message.id, resolve), process.send!(message)))
  const admission: Admission = {
    enter: async (peer) => ((await ask({ edgepg: 'enter', id: next++, peer })) as { refused?: SessionRefusal }).refused,
    leave: (peer) => void process.send!({ edgepg: 'leave', peer } satisfies ToPrimary),
  }
  const metrics = async () => {
    const m = (await ask({ edgepg: 'metrics', id: next++ })) as { body?: string; error?: string }
    if (m.error !== undefined) throw new Error(m.error)
    return m.body!
  }
  const report = (registry: Registry) => {
    AggregatorRegistry.setRegistries([registry])
    new AggregatorRegistry() // (its listener answers the primary's requests for this worker's metrics)
  }
  return { admission, metrics, report }
}

/**
 * `--workers n`: what a worker asks its primary (proxy/cluster/primary.ts), over node:cluster's IPC:
 * whether a session may open (the proxy-wide session limits), and the whole proxy's metrics.
 */
import { AggregatorRegistry, type Registry } from 'prom-client'
import type { ProxyOptions } from '../index'

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

/** A limit shared among `n` workers: worker `index`'s part (the parts add up to `total`; each is at least 1). */
export const shareOf = (total: number, n: number, index: number) => Math.max(1, Math.floor(total / n) + (index < total % n ? 1 : 0))

/**
 * A worker's options: its part of each limit the primary does not count (a key's backends, logins,
 * cancels, /sql requests, buffered bytes), so that the parts add up to the proxy's.
 */
export function workerPart(o: ProxyOptions, n: number, index: number): ProxyOptions {
  const part = (total: number | undefined, fallback: number) => shareOf(total ?? fallback, n, index)
  return {
    ...o,
    maxSessions: Infinity, // (the primary's count)
    maxSessionsPerIp: Infinity,
    maxLogins: part(o.maxLogins, 64),
    maxLoginsPerIp: part(o.maxLoginsPerIp, 8),
    maxCancelsPerIp: part(o.maxCancelsPerIp, 20),
    maxClientBufferBytes: part(o.maxClientBufferBytes, 256 << 20),
    pool: { ...o.pool, size: part(o.pool?.size, 20), maxBackends: part(o.pool?.maxBackends, 100) },
    sql: o.sql === false ? false : { ...o.sql, maxRequests: part(o.sql?.maxRequests, 500), maxRequestsPerIp: part(o.sql?.maxRequestsPerIp, 50) },
  }
}

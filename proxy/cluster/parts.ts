/** `--workers n`: each worker's part of the limits the primary does not count (proxy/cluster/primary.ts counts sessions). */
import type { ProxyOptions } from '../index'

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

/** `--workers n`: each worker's part of the limits the workers do not share (proxy/cluster/places.ts shares the others). */
import type { ProxyOptions } from '../index'
import { pinnedCap } from '../pool/pin'

/** A limit split among `n` workers: worker `index`'s part (the parts add up to `total`; each is at least 1). */
export const partOf = (total: number, n: number, index: number) => Math.max(1, Math.floor(total / n) + (index < total % n ? 1 : 0))

/**
 * A worker's options: its part of a key's backends (which move to where sessions wait, see
 * proxy/pool/lender.ts) and of buffered bytes. Pinned sessions are counted over all workers (places).
 */
export function workerPart(o: ProxyOptions, n: number, index: number): ProxyOptions {
  const part = (total: number | undefined, fallback: number) => partOf(total ?? fallback, n, index)
  return {
    ...o,
    maxClientBufferBytes: part(o.maxClientBufferBytes, 256 << 20),
    pool: {
      ...o.pool,
      size: part(o.pool?.size, 20),
      maxBackends: part(o.pool?.maxBackends, 100),
      maxPerClient: o.pool?.maxPerClient && part(o.pool.maxPerClient, 0),
      maxPinned: o.pool?.maxPinned ?? pinnedCap(o.pool?.size ?? 20),
      // (In transaction pooling a worker may hold every backend of a key, moved to it; its lender holds it to its part.)
      maxIdlePerKey: o.pool?.maxIdlePerKey ?? (o.pool?.mode === 'session' ? undefined : (o.pool?.size ?? 20)),
    },
  }
}

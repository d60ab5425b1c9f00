/** `--workers n`: each worker's part of the limits the workers do not share (proxy/cluster/places.ts shares the others). */
import type { ProxyOptions } from '../index'

/** A limit split among `n` workers: worker `index`'s part (the parts add up to `total`; each is at least 1). */
export const partOf = (total: number, n: number, index: number) => Math.max(1, Math.floor(total / n) + (index < total % n ? 1 : 0))

/** A worker's options: its part of a key's backends (each worker keeps its own) and of buffered bytes. */
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
      maxPinned: o.pool?.maxPinned && part(o.pool.maxPinned, 0),
    },
  }
}

/**
 * `--workers n`: a worker's link to its primary (proxy/cluster/primary.ts), over node:cluster's IPC:
 * the proxy-wide limits (proxy/cluster/places.ts), the whole proxy's metrics, and the keys each
 * worker's sessions log in with.
 */
import { AggregatorRegistry, type Registry } from 'prom-client'
import { SharedPlaces, type PlacesOf, type PlacesToPrimary, type PlacesToWorker } from './places'
import type { SignalMessage } from '../ws/signals'
import type { HostPort } from '../upstream/address'

/**
 * A key a worker's session has just logged in with, for the other workers to log a backend in ahead
 * of need: what a login of it needs (its startup packet, base64, and password; the TLS it asked for),
 * and whose it is, for the share of keys one client keeps warm (proxy/pool/backends.ts).
 */
export interface KeyMessage {
  edgepg: 'key'
  key: string
  target: HostPort
  packet: string
  password?: string
  tls?: unknown
  client: string
}

export type ToPrimary = PlacesToPrimary | { edgepg: 'metrics'; id: number } | SignalMessage | KeyMessage
export type ToWorker = PlacesToWorker | { edgepg: 'metrics'; id: number; body?: string; error?: string } | SignalMessage | { edgepg: 'retire' } | { edgepg: 'pool'; secret: string } | KeyMessage

/** What a proxy in a worker asks its primary for. */
export interface ClusterLink {
  /** Places under `limit` for the whole proxy, counted by name. */
  places: PlacesOf
  /** The whole proxy's metrics, as /metrics serves them. */
  metrics(): Promise<string>
  /** This worker's index, among --workers. */
  index: number
  /** A signal for a session of another worker (proxy/ws/signals.ts), through the primary. */
  signal(m: SignalMessage): void
  /** Signals other workers send this one's sessions. */
  onSignal?: (m: SignalMessage) => void
  /** The primary replaces this worker (a handover): it stops accepting and drains, and another takes its place once it has exited. */
  onRetire?: () => void
  /** What every worker keys the pool with (proxy/pool/backends.ts: a password's HMAC): a key names the same login in each. */
  poolSecret: Buffer
  /** Tells the other workers a key just logged in here. */
  announce(m: KeyMessage): void
  /** A key another worker's session just logged in with. */
  onKey?: (m: KeyMessage) => void
}

/** This worker's link, once the primary has told it what a replacement worker needs to know. */
export async function workerLink(workers: number, index: number) {
  const send = (m: ToPrimary) => void process.send!(m)
  const limits = new Map<string, SharedPlaces>()
  let leases: Extract<PlacesToWorker, { op: 'known' }>['leases'] = []
  let nextMetrics = 0
  const metricsWaiting = new Map<number, (m: Extract<ToWorker, { edgepg: 'metrics' }>) => void>()
  let known!: () => void
  const hello = new Promise<void>((resolve) => (known = resolve))
  let poolSecret: Buffer | undefined
  process.on('message', (m: ToWorker) => {
    if (m?.edgepg === 'pool') poolSecret = Buffer.from(m.secret, 'base64')
    else if (m?.edgepg === 'key') link.onKey?.(m)
    else if (m?.edgepg === 'metrics') {
      metricsWaiting.get(m.id)?.(m)
      metricsWaiting.delete(m.id)
    } else if (m?.edgepg === 'signal') link.onSignal?.(m)
    else if (m?.edgepg === 'retire') link.onRetire?.()
    else if (m?.edgepg === 'places') {
      if (m.op !== 'known') return limits.get(m.name)?.hear(m)
      leases = m.leases
      known()
    }
  })
  send({ edgepg: 'places', op: 'hello' })
  await hello // (the pool's secret comes ahead of it)
  if (!poolSecret) throw new Error('edgepg-proxy: the primary sent this worker no pool secret')

  const link: ClusterLink = {
    index,
    signal: send,
    poolSecret,
    announce: send,
    places(name, limit) {
      const places = new SharedPlaces(name, limit, workers, index, send)
      for (const [of, key, lease] of leases) if (of === name) places.lease(key, lease)
      limits.set(name, places)
      return places
    },
    async metrics() {
      const id = nextMetrics++
      const m = await new Promise<Extract<ToWorker, { edgepg: 'metrics' }>>((resolve) => (metricsWaiting.set(id, resolve), send({ edgepg: 'metrics', id })))
      if (m.error !== undefined) throw new Error(m.error)
      return m.body!
    },
  }
  /** Names the registry the primary reads for the whole proxy's metrics. */
  const report = (registry: Registry) => {
    AggregatorRegistry.setRegistries([registry])
    new AggregatorRegistry() // (its listener answers the primary's requests for this worker's metrics)
  }
  return Object.assign(link, { report }) // (one object: the proxy sets its onSignal)
}

/**
 * `--workers n`: a worker's link to its primary (proxy/cluster/primary.ts), over node:cluster's IPC:
 * the proxy-wide limits (proxy/cluster/places.ts), the whole proxy's metrics, and the keys each
 * worker's sessions log in with.
 */
import { AggregatorRegistry, type Registry } from 'prom-client'
import { SharedPlaces, type PlacesOf, type PlacesToPrimary, type PlacesToWorker } from './places'
import type { SignalMessage } from '../ws/signals'
import type { HostPort } from '../upstream/address'
import type { Socket } from 'node:net'
import type { BackendMoves } from '../pool/lenders'
import { SharedListening, type ListenToPrimary, type ListenToWorker } from './listening'

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

/**
 * Backends move to the worker whose sessions wait for one (proxy/pool/lender.ts): a worker asks the
 * others for one of a key's (`want`, sent on by the primary with who asked); one with a backend to
 * spare hands its socket over (`give`, with the socket as the message's handle; without one where
 * it could not move, as over TLS). The place in --pool-size goes with it.
 *
 * `freed` follows each `give`. Node closes a socket it passed on in the process that passed it only
 * once the next process has acknowledged it, and until then that process may read, and lose, what
 * Postgres sends. It also sends nothing more on a channel until that acknowledgement: so once
 * `freed` (sent behind the socket by the giver, and on by the primary) arrives, no other process
 * reads the socket, and the backend may run statements.
 */
export type WantMessage = { edgepg: 'backend'; op: 'want'; key: string; from?: number }
export type GiveMessage = { edgepg: 'backend'; op: 'give'; id: string; key: string; to: number; target: HostPort; answer: string; born: number }
export type FreedMessage = { edgepg: 'backend'; op: 'freed'; id: string; to: number }
type BackendMessage = WantMessage | GiveMessage | FreedMessage

export type ToPrimary = PlacesToPrimary | { edgepg: 'metrics'; id: number } | SignalMessage | KeyMessage | BackendMessage | ListenToPrimary
export type ToWorker = PlacesToWorker | { edgepg: 'metrics'; id: number; body?: string; error?: string } | SignalMessage | { edgepg: 'retire' } | { edgepg: 'pool'; secret: string } | KeyMessage | BackendMessage | ListenToWorker

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
  /** Backends to and from the other workers. */
  moves: BackendMoves
  /** Another worker's sessions wait for a backend of `key`. */
  onWanted?: (key: string, from: number) => void
  /** A backend another worker handed over: its socket (none: it could not move). */
  onGiven?: (m: GiveMessage, socket?: Socket) => void
  /** Where this worker's sessions listen: the primary's one backend per key. */
  listening: SharedListening
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
  /** Backends handed over, until they are freed (see FreedMessage). */
  const arriving = new Map<string, [GiveMessage, Socket | undefined]>()
  let given = 0
  process.on('message', (m: ToWorker, handle?: Socket) => {
    if (m?.edgepg === 'backend') {
      if (m.op === 'give') arriving.set(m.id, [m, handle])
      else if (m.op === 'want') link.onWanted?.(m.key, m.from!)
      else {
        const [give, socket] = arriving.get(m.id) ?? []
        arriving.delete(m.id)
        if (give) link.onGiven ? link.onGiven(give, socket) : socket?.destroy()
      }
    } else if (m?.edgepg === 'listen') link.listening.hear(m)
    else if (m?.edgepg === 'pool') poolSecret = Buffer.from(m.secret, 'base64')
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
    listening: new SharedListening(send),
    announce: send,
    moves: {
      want: (key) => send({ edgepg: 'backend', op: 'want', key }),
      give(m, socket) {
        const id = `${index}.${given++}`
        process.send!({ edgepg: 'backend', op: 'give', id, ...m }, socket)
        send({ edgepg: 'backend', op: 'freed', id, to: m.to })
      },
    },
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

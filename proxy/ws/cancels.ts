import type { WebSocket } from 'ws'
import type { BackendPool } from '../pool/backends'
import { cancelRequest, type BackendKey } from '../wire/startup'
import { SUBPROTOCOL_CANCEL, SUBPROTOCOL_POSITIONS } from '../../src/config'
import { limitKey } from '../listen/client-address'
import { localPlaces, type Places, type PlacesOf } from '../cluster/places'
import type { Routed } from '../login/in-band'

/**
 * The statement a `cancel <n>` text frame names (SUBPROTOCOL_CANCEL): the one after the client's
 * n-th ReadyForQuery since its login. Undefined for any other frame, or a session without it.
 */
export function cancelNamed(ws: WebSocket, data: Buffer): number | undefined {
  if ((ws.protocol !== SUBPROTOCOL_CANCEL && ws.protocol !== SUBPROTOCOL_POSITIONS) || data.length > 24) return undefined
  const named = /^cancel (\d{1,10})$/.exec(data.toString('latin1'))
  return named ? Number(named[1]) : undefined
}

/**
 * CancelRequests from clients. One goes on to Postgres only when it names a key the proxy handed
 * out: a pooled backend's (the pool maps the session's secret to the backend's own key), or one
 * Postgres gave a session the proxy relays in plaintext. Keys inside TLS the proxy cannot read:
 * while a session with TLS inside the socket is open to an upstream, a cancel naming no key the
 * proxy knows may be that session's, and goes on. Every cancel counts against its client address's
 * rate (at most so many in any second), known key or not, so none can make Postgres fork at a
 * stranger's pace.
 */
export class Cancels {
  /** Keys of sessions relayed in plaintext, by `upstream pid`. */
  private readonly issued = new Map<string, Buffer>()
  /** Sessions with TLS inside the socket, by upstream. */
  private readonly hidden = new Map<string, number>()
  /** Sessions on lent backends, by `upstream pid secret` as they were told: what runs their statement now. */
  private readonly lent = new Map<string, () => BackendKey | undefined>()
  /** Cancels of the last second, by client address: each gives its place back a second on. */
  private readonly recent: Places

  constructor(private readonly pool: BackendPool, readonly perPeerPerSecond: number, places: PlacesOf = localPlaces) {
    this.recent = places('cancelsPerIp', perPeerPerSecond)
  }

  /** A session's key, known from now until the returned function is called. */
  issue(upstream: string, key: BackendKey): () => void {
    const id = `${upstream} ${key.pid}`
    this.issued.set(id, key.secret)
    return () => void (this.issued.get(id) === key.secret && this.issued.delete(id))
  }

  /**
   * A session on lent backends (transaction pooling) is known by the key it was told, until the
   * returned function is called: its cancel goes to whichever backend runs its statement now.
   */
  follow(upstream: string, told: BackendKey, running: () => BackendKey | undefined): () => void {
    const id = `${upstream} ${told.pid} ${told.secret.toString('hex')}`
    this.lent.set(id, running)
    return () => void this.lent.delete(id)
  }

  /** A session whose key the proxy cannot see is open, until the returned function is called. */
  hide(upstream: string): () => void {
    this.hidden.set(upstream, (this.hidden.get(upstream) ?? 0) + 1)
    return () => {
      const n = this.hidden.get(upstream)! - 1
      n ? this.hidden.set(upstream, n) : this.hidden.delete(upstream)
    }
  }

  /** The CancelRequest to send Postgres for `packet`, or why none goes. */
  route(upstream: string, packet: Buffer, address: string): Routed | Promise<Routed> {
    const peer = limitKey(address)
    const placed = this.recent.take(peer)
    return placed === true || placed === false ? this.counted(placed, upstream, packet, peer) : placed.then((ok) => this.counted(ok, upstream, packet, peer))
  }

  private counted(placed: boolean, upstream: string, packet: Buffer, peer: string): Routed {
    if (!placed) return { refused: `more than ${this.perPeerPerSecond} cancels a second from ${peer}` }
    setTimeout(() => this.recent.give(peer), 1000).unref()
    if (packet.length < 16) return { refused: 'a malformed CancelRequest' }
    const pooled = this.pool.cancelRequest(upstream, packet)
    if (pooled) return { packet: pooled }
    const running = this.lent.get(`${upstream} ${packet.readInt32BE(8)} ${packet.subarray(12).toString('hex')}`)
    if (running) {
      const key = running()
      return key ? { packet: cancelRequest(key) } : { refused: 'its session runs nothing now' }
    }
    if (this.issued.get(`${upstream} ${packet.readInt32BE(8)}`)?.equals(packet.subarray(12)) || this.hidden.has(upstream)) return { packet }
    return { refused: 'a key edgepg-proxy never issued' }
  }
}

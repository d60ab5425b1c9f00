import type { BackendPool } from '../pool/backends'
import type { BackendKey } from '../wire/startup'

/**
 * CancelRequests from clients. One goes on to Postgres only when it names a key the proxy handed
 * out: a pooled backend's (the pool maps the session's secret to the backend's own key), or one
 * Postgres gave a session the proxy relays in plaintext. Keys inside TLS the proxy cannot read:
 * while a session with TLS inside the socket is open to an upstream, a cancel naming no key the
 * proxy knows may be that session's, and goes on. Every cancel counts against its client address's
 * rate, known key or not, so none can make Postgres fork at a stranger's pace.
 */
export class Cancels {
  /** Keys of sessions relayed in plaintext, by `upstream pid`. */
  private readonly issued = new Map<string, Buffer>()
  /** Sessions with TLS inside the socket, by upstream. */
  private readonly hidden = new Map<string, number>()
  private readonly recent = new Map<string, number>()
  private window = 0

  constructor(private readonly pool: BackendPool, readonly perPeerPerSecond: number) {}

  /** A session's key, known from now until the returned function is called. */
  issue(upstream: string, key: BackendKey): () => void {
    const id = `${upstream} ${key.pid}`
    this.issued.set(id, key.secret)
    return () => void (this.issued.get(id) === key.secret && this.issued.delete(id))
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
  route(upstream: string, packet: Buffer, peer: string): { packet: Buffer } | { refused: string } {
    const now = Math.floor(Date.now() / 1000)
    if (now !== this.window) this.recent.clear(), (this.window = now)
    const count = (this.recent.get(peer) ?? 0) + 1
    this.recent.set(peer, count)
    if (count > this.perPeerPerSecond) return { refused: `more than ${this.perPeerPerSecond} cancels a second from ${peer}` }
    if (packet.length < 16) return { refused: 'a malformed CancelRequest' }
    const pooled = this.pool.cancelRequest(upstream, packet)
    if (pooled) return { packet: pooled }
    if (this.issued.get(`${upstream} ${packet.readInt32BE(8)}`)?.equals(packet.subarray(12)) || this.hidden.has(upstream)) return { packet }
    return { refused: 'a key edgepg-proxy never issued' }
  }
}

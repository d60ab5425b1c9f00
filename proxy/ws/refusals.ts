/**
 * Upgrades refused in the last seconds, by client and URL: what a browser's client asks about when
 * its WebSocket did not open (browsers show a refused upgrade's answer to no one). Bounded whatever
 * a client sends: so many refusals, each key and reason cut short (a client reads 1 KiB of it).
 */
const KEPT_MS = 10_000
const KEPT = 1000
const KEY_CHARS = 512
const REASON_CHARS = 1024

export class Refusals {
  private readonly kept = new Map<string, { status: number; reason: string; at: number }>()

  remember(peer: string, url: string, status: number, reason: string) {
    const key = keyOf(peer, url)
    this.kept.delete(key) // (to the end: the map's order is the refusals')
    this.kept.set(key, { status, reason: reason.slice(0, REASON_CHARS), at: Date.now() })
    if (this.kept.size > KEPT) this.kept.delete(this.kept.keys().next().value!)
  }

  /** The refusal `peer` got at `url` in the last 10 s, if any. */
  last(peer: string, url: string): [status: number, reason: string] | undefined {
    const last = this.kept.get(keyOf(peer, url))
    return last && Date.now() - last.at < KEPT_MS ? [last.status, last.reason] : undefined
  }
}

const keyOf = (peer: string, url: string) => `${peer} ${url}`.slice(0, KEY_CHARS)

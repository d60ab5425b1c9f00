/**
 * Logins waiting on Postgres. From the moment the proxy connects to Postgres for a client until
 * Postgres accepts the login (ReadyForQuery), that connection belongs to someone not yet known: a
 * client that never answers Postgres's authentication request holds it until Postgres's own
 * `authentication_timeout` (60 s). So such logins are bounded, per client address and in all;
 * one past either bound waits its turn, in order of arrival (its handshake timeout still runs).
 */
export interface LoginTicket {
  /** Resolves when the login may connect to Postgres. */
  admitted: Promise<void>
  /** Still waiting for a place. */
  readonly waiting: boolean
  /** The login is over (accepted, refused, or its client gone), or will not be made: frees its place. */
  release(): void
}

interface Waiter {
  peer: string
  admit(): void
}

export class LoginGate {
  private running = 0
  private readonly perPeer = new Map<string, number>()
  private readonly waiting: Waiter[] = []

  constructor(readonly max: number, readonly maxPerPeer: number) {}

  /** Logins under way, and those waiting for a place. */
  get counts(): { running: number; waiting: number } {
    return { running: this.running, waiting: this.waiting.length }
  }

  admit(peer: string): LoginTicket {
    let state: 'waiting' | 'running' | 'done' = 'waiting'
    let admit!: () => void
    const admitted = new Promise<void>((resolve) => (admit = resolve))
    const waiter: Waiter = {
      peer,
      admit: () => {
        state = 'running'
        this.running++
        this.perPeer.set(peer, (this.perPeer.get(peer) ?? 0) + 1)
        admit()
      },
    }
    this.fits(peer) ? waiter.admit() : this.waiting.push(waiter)
    return {
      admitted,
      get waiting() {
        return state === 'waiting'
      },
      release: () => {
        if (state === 'waiting') this.waiting.splice(this.waiting.indexOf(waiter), 1)
        else if (state === 'running') this.leave(peer)
        state = 'done'
      },
    }
  }

  private fits(peer: string): boolean {
    return this.running < this.max && (this.perPeer.get(peer) ?? 0) < this.maxPerPeer
  }

  private leave(peer: string) {
    this.running--
    const n = this.perPeer.get(peer)! - 1
    n ? this.perPeer.set(peer, n) : this.perPeer.delete(peer)
    for (let i = 0; i < this.waiting.length && this.running < this.max; ) {
      const next = this.waiting[i]
      if (!this.fits(next.peer)) i++
      else this.waiting.splice(i, 1), next.admit()
    }
  }
}

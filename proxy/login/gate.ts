/**
 * Logins waiting on Postgres. From the moment the proxy connects to Postgres for a client until
 * Postgres accepts the login (ReadyForQuery), that connection belongs to someone not yet known: a
 * client that never answers Postgres's authentication request holds it until Postgres's own
 * `authentication_timeout` (60 s). So such logins are bounded, per client address and in all;
 * one past either bound waits its turn, in order of arrival (its handshake timeout still runs).
 */
import { giveAll, localPlaces, takeAll, type Places, type PlacesOf } from '../cluster/places'

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
  /** In the line (not admitted, not given up). */
  queued: boolean
  /** Its places are taken: it runs (or, if it gave up meanwhile, gives them back). */
  admit(): void
}

/** How often the line asks again: with --workers n, places freed by other workers are not announced. */
const RETRY_MS = 100

export class LoginGate {
  private running = 0
  private readonly waiting: Waiter[] = []
  private readonly inAll: Places
  private readonly perPeer: Places
  private serving = false
  private again = false
  private retry?: NodeJS.Timeout

  constructor(readonly max: number, readonly maxPerPeer: number, places: PlacesOf = localPlaces) {
    this.inAll = places('logins', max)
    this.perPeer = places('loginsPerIp', maxPerPeer)
  }

  /** Logins under way (in this process), and those waiting for a place. */
  get counts(): { running: number; waiting: number } {
    return { running: this.running, waiting: this.waiting.length }
  }

  admit(peer: string): LoginTicket {
    let state: 'waiting' | 'running' | 'done' = 'waiting'
    let admit!: () => void
    const admitted = new Promise<void>((resolve) => (admit = resolve))
    const waiter: Waiter = {
      peer,
      queued: false,
      admit: () => {
        if (state !== 'waiting') return this.give(peer)
        state = 'running'
        this.running++
        admit()
      },
    }
    // Places at once if there are (whoever waits for another address's), else a place in the line.
    const taken = this.take(peer)
    const first = (full: number) => (full < 0 ? waiter.admit() : state === 'waiting' && this.enqueue(waiter))
    typeof taken === 'number' ? first(taken) : taken.then(first)
    return {
      admitted,
      get waiting() {
        return state === 'waiting'
      },
      release: () => {
        if (waiter.queued) this.waiting.splice(this.waiting.indexOf(waiter), 1), (waiter.queued = false)
        if (state === 'running') this.running--, this.give(peer), void this.serve()
        state = 'done'
      },
    }
  }

  private enqueue(waiter: Waiter) {
    waiter.queued = true
    this.waiting.push(waiter)
    this.schedule()
  }

  /**
   * Admits waiting logins that now have places, in order of arrival: one question to the primary at
   * a time (with --workers n), none for an address already refused in this pass, and none once the
   * proxy has no place at all. Synchronous where the places are this process's.
   */
  private async serve() {
    if (this.serving) return void (this.again = true)
    this.serving = true
    do {
      this.again = false
      const refused = new Set<string>()
      for (const waiter of [...this.waiting]) {
        if (!waiter.queued || refused.has(waiter.peer)) continue
        const taken = this.take(waiter.peer)
        const full = typeof taken === 'number' ? taken : await taken
        if (full === 0) break
        if (full === 1) refused.add(waiter.peer)
        else {
          if (waiter.queued) this.waiting.splice(this.waiting.indexOf(waiter), 1), (waiter.queued = false)
          waiter.admit()
        }
      }
    } while (this.again)
    this.serving = false
    this.schedule()
  }

  /** A pass in RETRY_MS while anyone waits (not pushed back by later arrivals, which would starve it). */
  private schedule() {
    if (this.retry || !this.waiting.length) return
    this.retry = setTimeout(() => ((this.retry = undefined), void this.serve()), RETRY_MS).unref()
  }

  /** -1 with places for `peer`, or which was full (0: in all, 1: its address's). */
  private take(peer: string) {
    return takeAll([[this.inAll, ''], [this.perPeer, peer]])
  }

  private give(peer: string) {
    giveAll([[this.inAll, ''], [this.perPeer, peer]])
  }
}

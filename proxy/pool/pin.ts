/**
 * A session's pin (transaction pooling): it keeps its backend for state it made, counted against its
 * key's --max-pinned-sessions (KeyPins; with --workers over all of them). Past the cap, the pin waits up to PIN_WAIT_MS for a
 * pinned session that may leave (one running something, or whose backend is being asked again what
 * it keeps: its answer, releasing a lock, can reach the proxy after that of the session that took
 * the lock), rather than be refused for a pin about to go; refused, the session is closed.
 */
import type { Lender } from './lender'

/** The longest a pin past --max-pinned-sessions waits for a pinned session that may leave. */
const PIN_WAIT_MS = 1000

/**
 * --max-pinned-sessions by default: a quarter of --pool-size, but at least two where there are three
 * or more (pg's own suite keeps two sessions with temp tables at once).
 */
export const pinnedCap = (size: number) => (size < 3 ? 1 : Math.max(2, Math.ceil(size / 4)))

/** Where a key's pinned sessions are counted: this process, or with --workers the whole proxy (proxy/cluster/places.ts). */
export interface PinCount {
  /** A place: true, false when the cap is reached, or a promise of either. */
  take(key: string): boolean | Promise<boolean>
  give(key: string): void
}

/** A key's pinned sessions in this process: counted in a PinCount, and the pins that wait for one that may leave. */
export class KeyPins {
  /** Places the count granted while pins waited for its answer: the next pins' to take. */
  private granted = 0
  /** The count refused a pin: the next asks no more, and waits for a pinned session here that may leave. */
  private refused = false
  /** Pinned sessions that may leave: running something, or their backend being asked again what they keep. */
  private leaving = 0
  /** Pins waiting for them. */
  private deferred: Array<() => void> = []

  constructor(private readonly count: PinCount, private readonly key: string) {}

  /**
   * A session would keep its backend for state it holds: true if there is room for one more pinned
   * session (then it counts until `unpin`); false when --max-pinned-sessions are already, and none of
   * them may leave; 'later' when one may (it runs something, or its backend is being asked again what
   * it keeps: as when it released the lock the session just took), or the count answers from the
   * primary: `retry` is then called as each such one settles, to ask again.
   */
  pin(retry?: () => void): boolean | 'later' {
    if (this.granted) return this.granted--, true
    if (!this.refused) {
      const got = this.count.take(this.key)
      if (got === true) return true
      if (got !== false) {
        if (!retry) return void got.then((ok) => ok && this.count.give(this.key)), false
        got.then((ok) => {
          if (ok) this.granted++
          else this.refused = true
          retry()
          this.refused = false
          if (this.granted) this.granted--, this.count.give(this.key) // (the session no longer needs it)
        })
        return 'later'
      }
    }
    if (!this.leaving || !retry) return false
    this.deferred.push(retry)
    return 'later'
  }

  unpin() {
    this.count.give(this.key)
    this.retry()
  }

  /** A pinned session may leave soon (`may`), or has settled (still pinned, or gone: see unpin). */
  mayLeave(may: boolean) {
    this.leaving += may ? 1 : -1
    if (!may) this.retry()
  }

  private retry() {
    const deferred = this.deferred
    this.deferred = []
    for (const retry of deferred) retry()
  }
}

export class SessionPin {
  /** What the session keeps its backend for (undefined: nothing). */
  reason?: string
  /** It set what no catalog shows (proxy/isolation/reader.ts `unseen`): pinned to its end. */
  forGood = false
  /** It keeps its backend, but is not counted yet: its pin waits for a pinned session that may leave. */
  private due = false
  private wait?: NodeJS.Timeout
  /** Counted as a pinned session that may leave (KeyPins.mayLeave). */
  private leaving = false

  constructor(
    private readonly lender: Lender,
    /** Past the cap: the session is closed, with this message. */
    private readonly refused: (message: string) => void
  ) {}

  /** It keeps its backend for `reason` (`final`: no more waiting for a pinned session that may leave). */
  pin(reason: string, final = false) {
    if (this.reason && !this.due) return
    const { lender } = this
    const room = lender.pins.pin(final ? undefined : () => this.due && this.pin(reason))
    if (room === 'later') {
      // (It keeps its backend meanwhile, uncounted.)
      this.reason = reason
      if (!this.due) (this.due = true), (this.wait = setTimeout(() => this.due && this.pin(reason, true), PIN_WAIT_MS))
      return
    }
    this.settle()
    if (!room) {
      this.reason = undefined
      const what = reason === 'unseen' ? 'a setting no reset takes back' : reason
      return this.refused(`edgepg-proxy: this session left ${what} on its backend, and ${lender.shares.pinned} sessions of this user and database already keep theirs (--max-pinned-sessions): the session is closed, its backend cleaned. Keep such state in session pooling (--pool-mode session)`)
    }
    this.reason = reason
    lender.events.pinned(reason)
  }

  /** Its backend was found clean (or the session ended): it keeps it no more. */
  unpin() {
    if (!this.reason) return
    this.reason = undefined
    if (this.due) this.settle() // (never counted)
    else this.lender.pins.unpin() // (first: a pin waiting for this one takes its place)
    this.mayLeave(false)
  }

  /** Whether the session, pinned and counted, may leave soon: what it runs may release what it keeps, or its backend is being asked. */
  mayLeave(may: boolean) {
    if (may === this.leaving || (may && (!this.reason || this.due))) return
    this.leaving = may
    this.lender.pins.mayLeave(may)
  }

  private settle() {
    this.due = false
    clearTimeout(this.wait)
  }
}

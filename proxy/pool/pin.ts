/**
 * A session's pin (transaction pooling): it keeps its backend for state it made, counted against its
 * key's --max-pinned-sessions (Lender.pin). Past the cap, the pin waits up to PIN_WAIT_MS for a
 * pinned session that may leave (one running something, or whose backend is being asked again what
 * it keeps: its answer, releasing a lock, can reach the proxy after that of the session that took
 * the lock), rather than be refused for a pin about to go; refused, the session is closed.
 */
import type { Lender } from './lender'

/** The longest a pin past --max-pinned-sessions waits for a pinned session that may leave. */
const PIN_WAIT_MS = 1000

export class SessionPin {
  /** What the session keeps its backend for (undefined: nothing). */
  reason?: string
  /** It set what no catalog shows (proxy/isolation/reader.ts `unseen`): pinned to its end. */
  forGood = false
  /** It keeps its backend, but is not counted yet: its pin waits for a pinned session that may leave. */
  private due = false
  private wait?: NodeJS.Timeout
  /** Counted as a pinned session that may leave (Lender.mayLeave). */
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
    const room = lender.pin(final ? undefined : () => this.due && this.pin(reason))
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
    else this.lender.unpin() // (first: a pin waiting for this one takes its place)
    this.mayLeave(false)
  }

  /** Whether the session, pinned and counted, may leave soon: what it runs may release what it keeps, or its backend is being asked. */
  mayLeave(may: boolean) {
    if (may === this.leaving || (may && (!this.reason || this.due))) return
    this.leaving = may
    this.lender.mayLeave(may)
  }

  private settle() {
    this.due = false
    clearTimeout(this.wait)
  }
}

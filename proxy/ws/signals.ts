/**
 * Transaction pooling's processIDs: each session is told one no backend can have, and
 * pg_cancel_backend / pg_terminate_backend on it, run by any session of the same role, reach that
 * session (in this worker or another of --workers), as they would reach its connection: a cancel
 * stops its running statement, a terminate ends it.
 */

/** What a session does for a signal. */
export interface SignalTarget {
  /** Upstream and user: only a session of the same role may signal it (as Postgres allows). */
  role: string
  cancel(): void
  terminate(): void
}

export type SignalKind = 'cancel' | 'terminate'
/** A signal for a session in another worker, through the primary. */
export interface SignalMessage {
  edgepg: 'signal'
  to: number
  kind: SignalKind
  pid: number
  role: string
}

/** Above Linux's largest pid_max (2^22): no backend has such a pid. */
const FIRST = 2 ** 30
/** ProcessIDs per worker: the worker's index is in the bits above. */
const PER_WORKER = 2 ** 24

export class Signals {
  private readonly sessions = new Map<number, SignalTarget>()
  private next = 0

  constructor(
    private readonly worker = 0,
    /** Sends a signal on to another worker (--workers). */
    private readonly relay?: (m: SignalMessage) => void
  ) {}

  /** A processID for a login: this worker's next one that no session holds. */
  issue(): number {
    let pid: number
    do pid = FIRST + this.worker * PER_WORKER + (this.next++ % PER_WORKER)
    while (this.sessions.has(pid))
    return pid
  }

  /** The session told `pid` is `target` until the returned function is called. */
  attach(pid: number, target: SignalTarget): () => void {
    this.sessions.set(pid, target)
    return () => void (this.sessions.get(pid) === target && this.sessions.delete(pid))
  }

  /** Whether `pid` is one of the processIDs sessions are told. */
  static told(pid: number): boolean {
    return Number.isInteger(pid) && pid >= FIRST && pid < 2 ** 31
  }

  /** `kind` for the session told `pid`, from a session of `role`: here, or sent to its worker. */
  send(kind: SignalKind, pid: number, role: string) {
    if (!Signals.told(pid)) return
    const to = Math.floor((pid - FIRST) / PER_WORKER)
    if (to === this.worker) this.hear({ edgepg: 'signal', to, kind, pid, role })
    else this.relay?.({ edgepg: 'signal', to, kind, pid, role })
  }

  /** A signal for a session of this worker. */
  hear(m: SignalMessage) {
    const target = this.sessions.get(m.pid)
    if (!target || target.role !== m.role) return
    if (m.kind === 'cancel') target.cancel()
    else target.terminate()
  }
}

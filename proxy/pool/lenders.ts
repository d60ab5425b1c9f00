/**
 * Transaction pooling's lenders, one per pool key, shared by WebSocket sessions and POST /sql: a
 * key's first login makes its lender, and the key's other logins wait for it rather than each
 * log in a backend of its own. A lender answers logins for `lifetimeMs`; the next one after that
 * makes a fresh lender (its backends' answer may have aged: a changed setting, a new server version).
 */
import type { Upstream } from '../upstream/connection'
import type { LoginOutcome } from '../login/in-upgrade'
import type { Backend, BackendPool } from './backends'
import { Lender, type LendingMetrics, type Shares } from './lender'
import { parseStartupPacket } from '../wire/startup'
import type { Reading } from '../isolation/reader'

export interface LendingOptions {
  /** Backends per key, idle or lent (--pool-size). */
  size: number
  /** Longest wait for one (--pool-timeout). */
  timeoutMs: number
  /** Named statements each backend keeps (--pool-statements). */
  statements: number
  /** How long a lender answers logins with its first backend's answer. */
  lifetimeMs: number
  /** What statements may leave behind, by their text (proxy/isolation/reader.ts). */
  reader: (sql: string) => Reading
  shares: Shares
}

/** Transaction pooling: the backends of one upstream, user and database (in the metrics, keys that differ otherwise are summed). */
export interface KeyBackends {
  upstream: string
  user: string
  database: string
  idle: number
  lent: number
}

type Login = () => Promise<{ upstream: Upstream; outcome: LoginOutcome }>
/** A login that gave no backend (refused, or the pool had no room): the caller's to answer. */
export type Unlent = { upstream: Upstream; backend?: Backend; outcome: LoginOutcome }

export class Lenders {
  private readonly byKey = new Map<string, Lender>()
  private readonly firstLogins = new Map<string, Promise<unknown>>()

  constructor(private readonly pool: BackendPool, readonly o: LendingOptions, private readonly events: LendingMetrics) {}

  /** The key's lender, while it answers logins. */
  get(key: string): Lender | undefined {
    const lender = this.byKey.get(key)
    return lender && Date.now() - lender.born < this.o.lifetimeMs ? lender : undefined
  }

  /**
   * The key's lender, or, when there is none yet, what `open` makes of the key's first login (a
   * warm backend or a fresh login, through the pool): the lender it makes, or the login's outcome
   * when it gave no backend. `relogin` logs in more of the key's backends later; `made` hears that
   * this login made the key's lender.
   */
  async lenderFor(key: string, open: () => Promise<Unlent>, relogin: Login, made?: () => void): Promise<Lender | Unlent> {
    for (let first; !this.get(key) && (first = this.firstLogins.get(key)); ) await first
    const known = this.get(key)
    if (known) return known
    const opening = open()
    const settled = opening.then(() => this.firstLogins.delete(key), () => this.firstLogins.delete(key))
    this.firstLogins.set(key, settled)
    const opened = await opening
    if (!opened.backend) return opened
    const existing = this.get(key)
    if (existing) return existing.spare(opened.backend), existing
    const lender = new Lender(this.pool, key, opened.backend, this.o.size, this.o.timeoutMs, relogin, this.events, this.o.reader, this.o.shares)
    this.forgetExpired()
    this.byKey.set(key, lender)
    made?.()
    return lender
  }

  /** Lenders past their lifetime with nothing lent are forgotten (their idle backends stay the pool's): keys come and go. */
  private forgetExpired() {
    for (const [key, lender] of this.byKey) if (!this.get(key) && !lender.lentCount) this.byKey.delete(key), this.pool.stopRenewing(key)
  }

  /** Each key's backends, idle and lent, by what its key says of the login (never the password). */
  get keys(): KeyBackends[] {
    return [...this.byKey.values()].map((lender) => ({ ...describe(lender.key), idle: this.pool.idleCount(lender.key), lent: lender.lentCount }))
  }

  /** Backends lent now, and sessions and requests waiting for one, over all keys. */
  get counts(): { lent: number; waiting: number } {
    let lent = 0
    let waiting = 0
    for (const lender of this.byKey.values()) (lent += lender.lentCount), (waiting += lender.waitingCount)
    return { lent, waiting }
  }
}

/** What a pool key says of its login (never the password). */
function describe(key: string): { upstream: string; user: string; database: string } {
  const [upstream, , startup] = JSON.parse(key) as [string, unknown, string]
  const login = parseStartupPacket(Buffer.from(startup, 'base64'))
  const { user, database } = login.kind === 'startup' ? login : { user: '', database: '' }
  return { upstream, user, database }
}

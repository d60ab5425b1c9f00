/**
 * Transaction pooling's lenders, one per pool key, shared by WebSocket sessions and POST /sql: a
 * key's first login makes its lender, and the key's other logins wait for it rather than each
 * log in a backend of its own. A lender answers logins for `lifetimeMs`; the next one after that
 * makes a fresh lender (its backends' answer may have aged: a changed setting, a new server version).
 */
import { Upstream } from '../upstream/connection'
import type { Socket } from 'node:net'
import type { HostPort } from '../upstream/address'
import type { LoginOutcome } from '../login/in-upgrade'
import type { Backend, BackendPool } from './backends'
import { CLEAN, Lender, LoginRefused, type LendingMetrics, type Shares } from './lender'
import type { PinCount } from './pin'
import { parseStartupPacket } from '../wire/startup'
import type { Reading } from '../isolation/reader'
import { Hub } from '../notify/hub'
import type { ListenerEvents, ListeningBackend } from '../notify/listener'

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
  /** Where pinned sessions are counted, by key (with --workers, over all of them). */
  pins: PinCount
  /** --workers: where a key's sessions listen (the primary's one backend, proxy/cluster/listening.ts); else a backend of the worker's own. */
  listenThrough?: (key: string, events: ListenerEvents) => ListeningBackend
}

/** --workers: how a key's backends travel to the worker whose sessions wait for one (proxy/cluster/worker.ts carries them). */
export interface BackendMoves {
  /** Asks the other workers for a backend of `key`. */
  want(key: string): void
  /** Hands a backend of `key` to worker `to`: its socket (undefined: it could not move, and was closed), and what its login said. */
  give(m: { key: string; to: number; target: HostPort; answer: string; born: number }, socket: Socket | undefined): void
}

/** Backend.user of a backend handed over by another worker: whatever its last session left, its next one resets it. */
const MOVED = {}

/** Transaction pooling: the backends of one upstream, user and database (in the metrics, keys that differ otherwise are summed). */
export interface KeyBackends {
  upstream: string
  user: string
  database: string
  idle: number
  lent: number
}

type Login = () => Promise<{ upstream: Upstream; outcome: LoginOutcome }>

/** A backend logged in and ready for a query, else Postgres's refusal (a LoginRefused). */
export const ready = (login: Login) => async (): Promise<Upstream> => {
  const { upstream, outcome } = await login()
  if (outcome.kind === 'ready') return upstream
  upstream.close()
  throw new LoginRefused(outcome.kind === 'refused' ? outcome.message : 'Postgres did not take the login', outcome.kind === 'refused' ? outcome.code : '08006')
}

/** A login that gave no backend (refused, or the pool had no room): the caller's to answer. */
export type Unlent = { upstream: Upstream; backend?: Backend; outcome: LoginOutcome }

export class Lenders {
  private readonly byKey = new Map<string, Lender>()
  private readonly firstLogins = new Map<string, Promise<unknown>>()
  /** --workers: what keys without a lender hold of --pool-size, where backends moved (see Lender.size). */
  private readonly held = new Map<string, number>()

  constructor(private readonly pool: BackendPool, readonly o: LendingOptions, private readonly events: LendingMetrics, private readonly moves?: BackendMoves) {}

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
    // (A key's lender made anew holds what the last held: backends may have moved.)
    const size = this.byKey.get(key)?.size ?? this.held.get(key) ?? this.o.size
    this.held.delete(key)
    const lender = new Lender(this.pool, key, opened.backend, size, this.o.timeoutMs, relogin, this.events, this.o.reader, this.o.shares, this.o.pins, this.movesOf(key))
    lender.notifications = this.hubOf(key, relogin)
    this.forgetExpired()
    this.byKey.set(key, lender)
    made?.()
    return lender
  }

  /** Each key's one listening backend (proxy/notify/hub.ts), logged in as the key's backends are, none of the pool's. */
  private readonly hubs = new Map<string, Hub>()
  private hubOf(key: string, relogin: Login): Hub {
    let hub = this.hubs.get(key)
    const { listenThrough } = this.o
    if (!hub) this.hubs.set(key, (hub = new Hub(ready(relogin), listenThrough && ((events) => listenThrough(key, events)))))
    return hub
  }

  /** The listening backends close (the pool's are the pool's to close). */
  close() {
    for (const hub of this.hubs.values()) hub.close()
  }

  private movesOf(key: string) {
    const { moves, pool } = this
    return (
      moves && {
        want: () => moves.want(key),
        give: (backend: Backend, to: number) =>
          moves.give({ key, to, target: backend.upstream.target, answer: backend.answerWith(backend.key.secret).toString('base64'), born: backend.born }, pool.handOff(backend)),
      }
    )
  }

  /** --workers: worker `from`'s sessions wait for a backend of `key`. */
  wanted(key: string, from: number) {
    this.byKey.get(key)?.wanted(from)
  }

  /**
   * --workers: a backend of `key` another worker handed over, and its place in --pool-size (no
   * socket: it could not move, or the pool here has no room for it: one is logged in here instead).
   */
  received(m: { key: string; target: HostPort; answer: string; born: number }, socket?: Socket) {
    const upstream = socket && new Upstream(m.target, undefined, socket)
    const backend = upstream && this.pool.adopt(m.key, upstream, Buffer.from(m.answer, 'base64'), m.born)
    if (backend) backend.user = MOVED
    else upstream?.close()
    const lender = this.byKey.get(m.key)
    if (lender) return lender.receive(backend)
    // (Its lender gone meanwhile: the next holds the place; the backend waits idle.)
    this.held.set(m.key, (this.held.get(m.key) ?? this.o.size) + 1)
    if (backend) this.pool.giveBack(backend, CLEAN)
  }

  /** Lenders past their lifetime with nothing lent are forgotten (their idle backends stay the pool's): keys come and go. */
  private forgetExpired() {
    for (const [key, lender] of this.byKey) {
      if (this.get(key) || lender.lentCount) continue
      this.byKey.delete(key)
      this.pool.stopRenewing(key)
      if (lender.size !== this.o.size) this.held.set(key, lender.size)
    }
  }

  /** Each key's backends, idle and lent, by what its key says of the login (never the password). */
  get keys(): KeyBackends[] {
    return [...this.byKey.values()].map((lender) => ({ ...describe(lender.key), idle: this.pool.idleCount(lender.key), lent: lender.lentCount }))
  }

  /** Backends lent now, sessions and requests waiting for one, and sessions listening, over all keys. */
  get counts(): { lent: number; waiting: number; listening: number } {
    let lent = 0
    let waiting = 0
    let listening = 0
    for (const lender of this.byKey.values()) (lent += lender.lentCount), (waiting += lender.waitingCount)
    for (const hub of this.hubs.values()) listening += hub.sessions
    return { lent, waiting, listening }
  }
}

/** What a pool key says of its login (never the password). */
function describe(key: string): { upstream: string; user: string; database: string } {
  const [upstream, , startup] = JSON.parse(key) as [string, unknown, string]
  const login = parseStartupPacket(Buffer.from(startup, 'base64'))
  const { user, database } = login.kind === 'startup' ? login : { user: '', database: '' }
  return { upstream, user, database }
}

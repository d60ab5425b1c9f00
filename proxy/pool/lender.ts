/**
 * Transaction pooling: the backends of one pool key (upstream, TLS, startup parameters, password),
 * lent to sessions one transaction at a time. At most `size` exist, idle or lent; a session that
 * needs one while all are lent waits its turn, first come first served, for up to `timeoutMs`.
 * Idle ones are the BackendPool's (kept warm, evicted when idle too long or too old).
 *
 * Logins for the key are answered from the first login's answer, each with a cancel secret of its
 * own: a session holds no backend until it runs something.
 */
import { randomBytes } from 'node:crypto'
import type { BackendKey } from '../wire/startup'
import type { Backend, BackendPool } from './backends'
import { Holders, type Holder } from './holders'
import type { LoginOutcome } from '../login/in-upgrade'
import type { Upstream } from '../upstream/connection'
import { TxStatus } from '../wire/codes'
import type { Ending } from './idle-watch'
import { parseStartupPacket } from '../wire/startup'
import type { Reading } from '../isolation/reader'
import { verification } from '../isolation/verify'
import { KeyPins, type PinCount } from './pin'
import { Asks, type Moves } from './asks'
import type { Hub } from '../notify/hub'

/** Random bytes for cancel secrets, drawn from a pool refilled 4 KiB at a time (one call per ~1,000 logins, not one each). */
let randomPool = Buffer.alloc(0)
function randomSecret(n: number): Buffer {
  if (randomPool.length < n) randomPool = randomBytes(4096)
  const secret = Buffer.from(randomPool.subarray(0, n))
  randomPool = randomPool.subarray(n)
  return secret
}

/** How a session leaves a backend whose transaction ended cleanly: idle, kept as it is (its next taker resets it, see Backend.user). */
export const CLEAN: Ending = { pending: 0, status: TxStatus.Idle, reusable: true, clean: true }

/** Transaction pooling's events, for the metrics. */
export interface LendingMetrics {
  /** A session got a backend, after waiting `seconds` (0: at once). */
  lent(seconds: number): void
  /** A session waited past --pool-timeout. */
  timedOut(): void
  /** A session keeps its backend: its transactions left `reason` behind (what the backend's verification found first). */
  pinned(reason: string): void
  /** The proxy asked a backend what a transaction that did more than plain reads and writes left (proxy/isolation/verify.ts). */
  verified(): void
  /** A backend changed hands, reset ahead of its next session's messages (`refused`: Postgres refused the reset, and they went elsewhere). */
  handedOver(outcome: 'reset' | 'refused'): void
  /** A named statement prepared again on another backend than its session's last. */
  preparedAgain(): void
  /** --workers: a backend went to another worker, whose sessions waited for one. */
  moved(): void
}

export class PoolTimeout extends Error {
  readonly code = '53300'
}

/** Postgres refused one of the key's logins: its SQLSTATE and message. */
export class LoginRefused extends Error {
  constructor(message: string, readonly code: string) {
    super(message)
  }
}

interface Waiter {
  resolve(backend: Backend): void
  reject(err: Error): void
  /** When it asked, and when it has waited --pool-timeout (performance.now()). */
  started: number
  deadline: number
  holder?: Holder
  client?: string
}

/** How far one client may take a key's backends (proxy/config.ts: --max-backends-per-client, --max-pinned-sessions). */
export interface Shares {
  /**
   * Backends one client (a token's subject, else its address) holds, parked ones aside, before
   * others' waiting sessions go first and may end its sessions idle in a transaction: alone, a
   * client may have them all.
   */
  perClient: number
  /** Sessions kept on their backends for state they hold, at once. */
  pinned: number
}

export class Lender {
  /** Lent now (parked ones among them). */
  private readonly lent = new Set<Backend>()
  /**
   * Lent backends whose session's transaction ended cleanly, left with it until another session
   * needs one (so that a busy session keeps running where it is): each with how to take it back.
   */
  private readonly parked = new Map<Backend, () => void>()
  /** Being logged in, or taken from the pool. */
  private opening = 0
  private readonly waiting: Waiter[] = []
  /** Waiters by client. */
  private readonly waitingBy = new Map<string | undefined, number>()
  /** The verification for this key's backends (proxy/isolation/verify.ts). */
  readonly verification: Buffer

  /** The client each lent backend is lent to (none: not counted, as a /sql request's). */
  private readonly holders = new Holders()
  /** Its sessions pinned now, and the pins that wait for one that may leave (proxy/pool/pin.ts). */
  readonly pins: KeyPins
  /** Upstream and user: who may signal whom (proxy/ws/signals.ts). */
  readonly role: string

  /** Backends whose close this lender watches. */
  private readonly watched = new WeakSet<Backend>()

  /** --workers: this worker's asks for more of the key's backends, and the others' (proxy/pool/asks.ts). */
  private readonly asks?: Asks

  /** With the key's first backend, just logged in: idle, the first to be lent. */
  constructor(
    private readonly pool: BackendPool,
    readonly key: string,
    /** The first login's (or the newest renewal's): every later login of the key is answered with its answer. */
    private answer: Backend,
    /** Its backends, idle or lent: --pool-size, or with --workers what this worker holds of it now (backends move: proxy/pool/asks.ts). */
    public size: number,
    readonly timeoutMs: number,
    private readonly login: () => Promise<{ upstream: Upstream; outcome: LoginOutcome }>,
    readonly events: LendingMetrics,
    /** What statements may leave behind, by their text. */
    readonly read: (sql: string) => Reading,
    readonly shares: Shares,
    /** Where sessions pinned now are counted, by key (--max-pinned-sessions: over all workers). */
    pinCount: PinCount,
    /** --workers: how backends move to the worker whose sessions wait for one. */
    moves?: Moves
  ) {
    this.pins = new KeyPins(pinCount, key)
    this.asks = moves && new Asks(moves, () => this.waiting.length > 0, () => this.short)
    const [upstream, , loginB64] = JSON.parse(key) as string[]
    const startup = parseStartupPacket(Buffer.from(loginB64, 'base64'))
    const user = startup.kind === 'startup' ? startup.user : ''
    this.role = `${upstream} ${user}`
    this.verification = verification(user)
    // A backend logged in afresh ahead of need answers logins from now on: the answer is no older than it.
    pool.renewWith(key, login, (renewed) => ((this.answer = renewed), (this.born = Date.now())))
    pool.giveBack(answer, CLEAN)
    this.afterReset(answer)
  }

  /** When its answer was Postgres's: it answers logins for the pool's lifetime from then. */
  born = Date.now()

  /** Where the key's sessions listen (proxy/notify/hub.ts): the key's, outliving its lenders. */
  notifications?: Hub

  /** A login of this key, answered as the first was, with a processID and a cancel secret of its own: the answer, and the key it tells. */
  welcome(pid: number): { outcome: LoginOutcome; told: BackendKey } {
    const secret = randomSecret(this.answer.key.secret.length)
    return { outcome: { kind: 'ready', answer: this.answer.answerWith(secret, pid) }, told: { pid, secret } }
  }

  /**
   * A backend to run on: an idle one, a new one while there are fewer than `size`, or the next one
   * given back. If it has to wait in line, `waits` gets how to leave it (the wait then rejects with
   * the reason given), for a caller that gives up.
   */
  acquire(waits?: (leave: (reason: Error) => void) => void, holder?: Holder): Promise<Backend> {
    return new Promise((resolve, reject) => this.request(resolve, reject, waits, holder))
  }

  /** As acquire, with callbacks (`got` may be called synchronously, from another session's giveBack): no promise on a path every statement of a session takes. */
  request(got: (backend: Backend) => void, failed: (err: Error) => void, waits?: (leave: (reason: Error) => void) => void, holder?: Holder) {
    const started = performance.now()
    const waiter: Waiter = { resolve: got, reject: failed, started, deadline: started + this.timeoutMs, holder, client: holder?.client }
    if (this.waiting.length) return this.line(waiter, waits)
    const now = this.takeNow()
    if (now) return this.hand(waiter, now)
    this.take().then((backend) => (backend ? this.hand(waiter, backend) : this.line(waiter, waits)), failed)
  }

  /** `backend` is `waiter`'s. */
  private hand(waiter: Waiter, backend: Backend) {
    this.events.lent((performance.now() - waiter.started) / 1000)
    waiter.resolve(this.holdFor(backend, waiter.holder))
  }

  /** Into the line for the next backend given back. */
  private line(waiter: Waiter, waits: ((leave: (reason: Error) => void) => void) | undefined) {
    const { client, reject } = waiter
    waits?.((reason) => this.unqueue(waiter) && reject(reason))
    this.waiting.push(waiter)
    this.waitingBy.set(client, (this.waitingBy.get(client) ?? 0) + 1)
    this.timer ??= setTimeout(this.expire, this.timeoutMs)
    this.serve() // (a parked backend may be taken back for it)
    this.makeRoom(waiter)
    this.asks?.lined()
  }

  /** Sessions wait, and no backend can be had here. */
  private get short(): boolean {
    return this.waiting.length > 0 && !this.parked.size && !this.pool.idleCount(this.key) && this.busy >= this.size
  }

  /**
   * Worker `from`'s sessions wait for one of this key's backends: one this worker has no use for,
   * idle or parked with an idle session, goes there now, else the next one given back or reset
   * with no one waiting here, while the ask stands.
   */
  wanted(from: number) {
    this.asks?.heard(from)
    this.giveAway()
  }

  private giveAway() {
    const to = this.asks?.first()
    if (to === undefined || this.waiting.length) return
    const backend = this.pool.takeNow(this.key, false) ?? this.reclaim()
    if (backend) this.handOff(backend, to)
  }

  /** To worker `to`: one backend fewer here. */
  private handOff(backend: Backend, to: number) {
    this.lent.delete(backend)
    this.size--
    this.events.moved()
    this.asks!.give(backend, to)
  }

  /**
   * A backend another worker handed over, for this worker's sessions (undefined: it could not move,
   * as over TLS, and was closed there: one is logged in here in its place).
   */
  receive(backend?: Backend) {
    this.size++
    if (!backend) return this.serve()
    this.lend(backend)
    this.giveBack(backend)
    this.asks?.again()
  }

  /** One timer for the line, set for its oldest waiter (the first: every waiter waits as long), not one per wait. */
  private timer?: NodeJS.Timeout

  private readonly expire = () => {
    this.timer = undefined
    const now = performance.now()
    while (this.waiting.length && this.waiting[0].deadline <= now) {
      const { client, reject } = this.waiting[0]
      this.unqueue(this.waiting[0])
      this.events.timedOut()
      const { perClient } = this.shares
      const within = `no backend for this user and database within ${this.timeoutMs} ms`
      reject(new PoolTimeout(!this.mayTake(client) && this.busy < this.size
        ? `${within}: this client holds ${perClient} of its ${this.size} backends already, as many as one client may (--max-backends-per-client)`
        : this.busy < this.size && this.pool.full
          ? `${within}: ${this.busy} of its ${this.size} are busy, and the proxy's ${this.pool.maxBackends} backends over all users are lent (raise --pool-max-backends, if Postgres has room)`
          : `${within}: all ${this.size} ${this.asks ? "of this worker's are busy, and the other workers had none to spare" : 'are busy'} (raise --pool-size, or --pool-timeout)`))
    }
    if (this.waiting.length) this.timer = setTimeout(this.expire, this.waiting[0].deadline - now)
  }

  /** A session of this key sits idle inside a transaction: the first waiter within its share may end it (see makeRoom). */
  idleInTransaction() {
    const first = this.waiting.find((w) => this.mayTake(w.client))
    if (first) this.makeRoom(first)
  }

  /** Out of the line: false if it was not in it. */
  private unqueue(waiter: Waiter): boolean {
    const at = this.waiting.indexOf(waiter)
    if (at < 0) return false
    this.waiting.splice(at, 1)
    const n = this.waitingBy.get(waiter.client)! - 1
    if (n) this.waitingBy.set(waiter.client, n)
    else this.waitingBy.delete(waiter.client)
    if (!this.waiting.length) clearTimeout(this.timer), (this.timer = undefined)
    return true
  }

  /**
   * A waiter within its client's share finds every backend lent: a session of a client past its
   * share that sits idle inside a transaction is ended for it (its backend, rolled back, is next).
   */
  private makeRoom(waiter: Waiter) {
    if (!this.mayTake(waiter.client) || this.busy + this.pool.idleCount(this.key) < this.size) return
    const over = this.holders.over(this.shares.perClient, waiter.client)
    over?.evict(
      `terminating connection: idle in a transaction while its client holds more than ${this.shares.perClient} of this user's ${this.size} backends and another client waits (--max-backends-per-client; the transaction was rolled back)`
    )
  }

  /** Sessions and requests waiting for a backend now. */
  get waitingCount(): number {
    return this.waiting.length
  }

  /** Lent now. */
  get lentCount(): number {
    return this.lent.size
  }

  /** A transaction ended cleanly on `backend`, leaving nothing: to the next in line, or back to the pool. */
  giveBack(backend: Backend) {
    this.parked.delete(backend)
    if (!this.lent.has(backend)) return
    this.holders.delete(backend)
    const next = this.nextWaiter()
    if (next && !backend.upstream.gone) {
      // Straight to the next in line: clean, and still lent.
      return this.hand(next, backend)
    }
    const to = backend.upstream.gone ? undefined : this.asks?.first()
    if (to !== undefined) return this.handOff(backend, to)
    this.lent.delete(backend)
    this.pool.giveBack(backend, CLEAN)
    this.afterReset(backend)
  }

  /** A backend of the key logged in by a session that found no lender yet: kept if there is room, else closed. */
  spare(backend: Backend) {
    const room = this.busy + this.pool.idleCount(this.key) < this.size
    this.pool.giveBack(backend, room ? CLEAN : { ...CLEAN, reusable: false })
    this.afterReset(backend)
  }

  /**
   * The session holding `backend` ended, leaving it as `ending` says (undefined: busy): the pool
   * resets or closes it (`reset`: the session sent the reset itself, as in BackendPool.giveBack).
   */
  endSession(backend: Backend, ending: Ending | undefined, reset?: Promise<boolean | undefined>) {
    this.parked.delete(backend)
    this.holders.delete(backend)
    if (!this.lent.delete(backend)) return
    this.pool.giveBack(backend, ending, reset)
    this.afterReset(backend)
  }

  private afterReset(backend: Backend) {
    void (backend.resetting ?? Promise.resolve()).then(() => this.serve())
  }

  /** A backend that broke: gone, and its place free. */
  lost(backend: Backend) {
    this.parked.delete(backend)
    this.holders.delete(backend)
    if (this.lent.delete(backend)) this.pool.giveBack(backend, undefined)
    this.serve()
  }

  /**
   * A clean transaction ended on `backend`, and no one waits: it stays with its session, until
   * another needs it (`surrender` then detaches it from the session, synchronously). False when
   * someone waits: then the session gives it back.
   */
  park(backend: Backend, surrender: () => void): boolean {
    if (this.waiting.length || this.asks?.first() !== undefined || !this.lent.has(backend)) return false
    this.parked.set(backend, surrender)
    this.holders.counted(backend, false) // (another may take it)
    return true
  }

  /** The session runs on its parked backend again. */
  unpark(backend: Backend) {
    this.parked.delete(backend)
    this.holders.counted(backend, true)
  }

  /** Lent now, and being logged in: what counts against `size` beside the pool's idle ones. */
  get busy(): number {
    return this.lent.size + this.opening
  }

  /** Whether `client` may have one more backend now: within its share, or with no other client waiting. */
  private mayTake(client: string | undefined): boolean {
    return client === undefined || this.holders.count(client) < this.shares.perClient || this.waiting.length === (this.waitingBy.get(client) ?? 0)
  }

  private holdFor(backend: Backend, holder: Holder | undefined): Backend {
    this.holders.set(backend, holder)
    if (holder) backend.client = holder.client
    return backend
  }

  /**
   * Out of the line: the first whose client may have one more backend, else the first (a free
   * backend serves someone: the share orders the line, it never leaves a backend idle).
   */
  private nextWaiter(): Waiter | undefined {
    const next = this.waiting.find((w) => this.mayTake(w.client)) ?? this.waiting[0]
    if (next) this.unqueue(next)
    return next
  }

  /** The next waiter's turn, if a backend can be had. */
  private serve() {
    if (!this.waiting.length) return this.giveAway()
    if (!this.parked.size && !this.pool.idleCount(this.key) && this.lent.size + this.opening >= this.size) return // (none to be had: the next given back goes to it)
    void this.take().then(
      (backend) => {
        if (!backend) return
        const waiter = this.nextWaiter()
        if (!waiter) return this.giveBack(backend)
        this.hand(waiter, backend)
      },
      (err: Error) => {
        this.nextWaiter()?.reject(err)
      }
    )
  }

  /** What take finds without waiting (no promise on the path most statements take): an idle backend not being reset, or at `size`, a parked one. */
  private takeNow(): Backend | undefined {
    const warm = this.pool.takeNow(this.key)
    if (warm) return this.lend(warm)
    if (!this.pool.idleCount(this.key) && this.lent.size + this.opening >= this.size) return this.reclaim()
    return undefined
  }

  private async take(): Promise<Backend | undefined> {
    if (this.pool.idleCount(this.key)) {
      this.opening++ // (counted while its reset may still be under way)
      const warm = await this.pool.take(this.key, false).finally(() => this.opening--)
      if (warm) return this.lend(warm)
    }
    if (this.lent.size + this.opening + this.pool.idleCount(this.key) >= this.size || !this.pool.reserve()) return this.reclaim()
    this.opening++
    try {
      const { upstream, outcome } = await this.login()
      const backend = outcome.kind === 'ready' ? this.pool.adopt(this.key, upstream, outcome.answer) : undefined
      if (!backend) upstream.close()
      // Postgres refused a login it took before (too many connections, shutting down): a parked
      // backend then, or else Postgres's word, not a wait.
      if (outcome.kind === 'refused') {
        const parked = this.reclaim()
        if (!parked) throw new LoginRefused(outcome.message, outcome.code)
        return parked
      }
      return backend && this.lend(backend)
    } finally {
      this.opening--
      this.pool.unreserve()
    }
  }

  /** The longest-parked backend, taken from its session for another (it stays lent). */
  private reclaim(): Backend | undefined {
    for (const [backend, surrender] of this.parked) {
      this.parked.delete(backend)
      this.holders.delete(backend)
      surrender()
      return backend
    }
    return undefined
  }

  private lend(backend: Backend): Backend {
    this.lent.add(backend)
    if (!this.watched.has(backend)) {
      this.watched.add(backend)
      backend.upstream.on('close', () => this.lost(backend))
    }
    return backend
  }
}

/**
 * Warm backends. A Postgres connection whose login the proxy ran is kept when its session ends
 * idle: reset (ROLLBACK if a transaction was left open, then DISCARD ALL: SET, temp tables,
 * prepared statements, cursors, LISTEN, advisory locks, role; and a fresh seed for random()), and handed to the next session
 * whose login matches exactly: same upstream, TLS, StartupMessage (user, database and every
 * parameter) and password. That session's login is answered from the backend's own state
 * (AuthenticationOk, its ParameterStatus values, its BackendKeyData, ReadyForQuery): no fork, no
 * authentication at Postgres. POST /sql draws from the same pool (proxy/sql/lease.ts): its requests
 * log in as a default pg Client would, so they share keys with sessions.
 *
 * Passwords are compared as HMACs under a per-process key; a login whose password differs misses
 * and goes to Postgres, which judges it. Each session on a pooled backend is given a cancel secret
 * of its own (the backend's real process ID), so a late CancelRequest from an earlier session
 * cannot cancel a later one's query. Before a backend is handed out it has answered: its reset, if
 * that is just under way (a session right behind another), else a ping (a Sync), so one that died
 * while idle is never given to anyone. (A /sql request sends its ping with its statement, and runs
 * elsewhere if it goes unanswered.)
 */
import { createHmac, randomBytes } from 'node:crypto'
import type { Reading } from '../isolation/reader'
import { reseed } from '../isolation/verify'
import { serialize } from 'pg-protocol'
import { ByteQueue, EMPTY, messages } from '../wire/bytes'
import { cancelRequest, type BackendKey } from '../wire/startup'
import type { Upstream } from '../upstream/connection'
import type { Socket } from 'node:net'
import type { Ending } from './idle-watch'
import type { LoginOutcome } from '../login/in-upgrade'
import { ServerMessage, TxStatus } from '../wire/codes'

export interface PoolOptions {
  /** Keep backends for later sessions (default true); false: each session forks its own. */
  enabled?: boolean
  /** Idle backends kept per key (upstream, TLS, startup parameters, password). Default 10 here; the proxy's: `size`. */
  maxIdlePerKey?: number
  /** Backends the pool owns in all, idle or lent; sessions beyond it get backends of their own. Default 100. */
  maxBackends?: number
  /** Close a backend idle this long (ms). Default 60 s. */
  idleTimeoutMs?: number
  /** Close a backend this old (ms) rather than pool it again: a changed password stops being honoured within it. Default 30 min. */
  maxLifetimeMs?: number
  /**
   * Keep one backend of each key used this recently (ms) past the idle timeout, and log a fresh one
   * in before its lifetime ends (where the key's lender said how: renewWith), so that no login after
   * the first pays the link to Postgres. Default 0 here (none); the proxy's: 1 h (--pool-keep-warm).
   */
  keepWarmMs?: number
  /**
   * 'transaction' (the default): a WebSocket session whose login the proxy runs, and a /sql request,
   * holds a backend only while it runs something (proxy/ws/lent-session.ts). 'session': a session
   * holds one from its login to its end.
   */
  mode?: 'session' | 'transaction'
  /** Backends per key: in transaction mode all, idle or lent; in session mode those kept idle, and /sql requests at once. Default 20. */
  size?: number
  /** Transaction mode: longest wait for a backend before SQLSTATE 53300 (ms). Default 5000. */
  timeoutMs?: number
  /** Transaction mode: named statements each backend keeps for the sessions it serves. Default 100. */
  statements?: number
  /** Transaction mode: backends one client (a token's subject, else its address) holds while another client waits, and keys it keeps warm. Default a quarter of `size`. */
  maxPerClient?: number
  /** Transaction mode: sessions kept on their backend for state they hold, at once. Default a quarter of `size`. */
  maxPinned?: number
  /** Transaction mode: end a session idle inside a transaction this long (ms; 0: never). Default 60 s. */
  idleInTransactionMs?: number
  /** Transaction mode: bytes of notifications a listening session may fall behind by (--listen-buffer; default 1 MiB). */
  listenBufferBytes?: number
  /** Transaction mode: the function that says whether a token session may LISTEN on a channel (--listen-policy; a qualified name). */
  listenPolicy?: string
  /** Transaction mode: the first reading of what statements leave (default proxy/isolation/reader.ts; tests put a wrong one here). */
  reader?: (sql: string) => Reading
  /** What a key's password is known by, an HMAC with this (default: random; with --workers, the same in each, proxy/cluster/worker.ts). */
  hmacKey?: Buffer
}

export type PoolEvent = 'hit' | 'miss' | 'reset' | 'discard' | 'renew'

/** Longest wait for Postgres's answer to a reset or a ping. */
const ANSWER_TIMEOUT_MS = 5000
const SYNC = serialize.sync()
/** How a backend is left whose login just finished, by a session that never started. */
export const UNUSED: Ending = { pending: 0, status: TxStatus.Idle, reusable: true }

const ROLLBACK = serialize.query('ROLLBACK')
const DISCARD_ALL = serialize.query('DISCARD ALL')

/** A Postgres connection that finished a login, and what its login said. */
export class Backend {
  readonly key: BackendKey
  /** The login's answer, message by message; ParameterStatus kept current. */
  private answer: Buffer[]
  /** The cancel secret of the session it is lent to. */
  lentSecret?: Buffer
  /** While pooled: what Postgres sends. */
  queue?: ByteQueue
  /** Its reset, while under way: whether it succeeded. */
  resetting?: Promise<boolean>
  /** Resets given to it so far (each drops its prepared statements, for those who keep count of them). */
  resets = 0
  /**
   * Transaction pooling: whose state it may hold, the session (or request) it was last lent to; none
   * once Postgres has answered a reset. Any other taker resets it first (proxy/isolation/verify.ts HANDOVER).
   */
  user?: object
  idleTimer?: NodeJS.Timeout
  /** When a session last took it or left it (ms): a full pool closes the idle one used longest ago first. */
  lastUsed = Date.now()
  /** The client (a token's subject, else an address) it was last lent to, where known: its keys kept warm count against that client's share. */
  client?: string
  /** Kept past the idle timeout, its key's last (keepWarmMs). */
  kept = false

  /** `born`: when its login was (another worker's, for a backend handed over). */
  constructor(readonly upstream: Upstream, readonly poolKey: string, answer: Buffer[], readonly born = Date.now()) {
    this.answer = answer.map((m) => Buffer.from(m))
    const k = this.answer.find((m) => m[0] === ServerMessage.BackendKeyData)!
    this.key = { pid: k.readInt32BE(5), secret: k.subarray(9) }
  }

  /** Postgres's login answer as a session on this backend sees it: with its own cancel secret (and processID, in transaction pooling). */
  answerWith(secret: Buffer, pid?: number): Buffer {
    const keyData = (m: Buffer) => {
      const head = Buffer.from(m.subarray(0, 9))
      if (pid !== undefined) head.writeInt32BE(pid, 5)
      return Buffer.concat([head, secret])
    }
    return Buffer.concat(this.answer.map((m) => (m[0] === ServerMessage.BackendKeyData ? keyData(m) : m)))
  }

  /** A ParameterStatus Postgres sent after the login (a reset, a configuration reload). */
  noteParameter(msg: Buffer) {
    const name = msg.subarray(5, msg.indexOf(0, 5)).toString()
    const at = this.answer.findIndex((m) => m[0] === ServerMessage.ParameterStatus && m.subarray(5, m.indexOf(0, 5)).toString() === name)
    if (at >= 0) this.answer[at] = Buffer.from(msg)
  }
}

export class BackendPool {
  readonly enabled: boolean
  private readonly idle = new Map<string, Backend[]>()
  /** Backends owned, idle or lent, by upstream and process ID (for cancel requests). */
  private readonly owned = new Map<string, Backend>()
  private readonly hmacKey: Buffer
  /** Passwords' HMACs, kept (a cold session's login then costs no HMAC): a few distinct ones, bounded. */
  private readonly secrets = new Map<string, string>()

  private remember(password: string): string {
    const secret = createHmac('sha256', this.hmacKey).update(password).digest('base64')
    if (this.secrets.size >= 1000) this.secrets.clear()
    this.secrets.set(password, secret)
    return secret
  }
  private readonly maxIdlePerKey: number
  readonly maxBackends: number
  private readonly idleTimeoutMs: number
  private readonly maxLifetimeMs: number
  private readonly keepWarmMs: number
  /** Keys one client may keep warm, and connections it may have to Postgres outside the pool while it is full (maxPerClient). */
  readonly perClient: number
  /** Logins under way that the pool will adopt (see reserve). */
  private reserved = 0
  /** When each key last served a login or a lend. */
  private readonly lastUsed = new Map<string, number>()
  /** How to log in another backend of a key, to replace its last before it ages out; and who hears of it. */
  private readonly renewers = new Map<string, { login: () => Promise<{ upstream: Upstream; outcome: LoginOutcome }>; renewed?: (backend: Backend) => void }>()
  private closed = false

  constructor(options: PoolOptions = {}, private readonly onEvent: (event: PoolEvent) => void = () => {}) {
    this.enabled = options.enabled !== false
    this.maxIdlePerKey = options.maxIdlePerKey ?? 10
    this.maxBackends = options.maxBackends ?? 100
    this.idleTimeoutMs = options.idleTimeoutMs ?? 60_000
    this.maxLifetimeMs = options.maxLifetimeMs ?? 30 * 60_000
    this.keepWarmMs = options.keepWarmMs ?? 0
    this.perClient = options.maxPerClient ?? Math.ceil((options.size ?? 20) / 4)
    this.hmacKey = options.hmacKey ?? randomBytes(32)
  }

  /** How a key's backends are logged in: keepWarmMs replaces its last one this way before it ages out, then tells `renewed`. */
  renewWith(key: string, login: () => Promise<{ upstream: Upstream; outcome: LoginOutcome }>, renewed?: (backend: Backend) => void) {
    this.renewers.set(key, { login, renewed })
  }

  /** The key's lender is forgotten: its backends are no longer replaced, and a key with none idle is forgotten here too. */
  stopRenewing(key: string) {
    this.renewers.delete(key)
    if (!this.idle.has(key)) this.lastUsed.delete(key)
  }

  /** Backends owned, and how many of them are idle. */
  get size(): { pooled: number; idle: number } {
    let idle = 0
    for (const list of this.idle.values()) idle += list.length
    return { pooled: this.owned.size, idle }
  }

  /** Idle backends kept for `key` (some perhaps still being reset). */
  idleCount(key: string): number {
    return this.idle.get(key)?.length ?? 0
  }

  /**
   * The pool key of a login: never the password itself. Logins by token (`forTokens`) have keys of
   * their own: their backends carry claims (proxy/auth/claims.ts), set anew for each session.
   */
  key(upstream: string, tls: unknown, startup: Buffer, password: string | undefined, forTokens = false): string {
    const secret = password === undefined ? '' : this.secrets.get(password) ?? this.remember(password)
    return JSON.stringify([upstream, tls ?? null, startup.toString('base64'), secret, ...(forTokens ? ['tokens'] : [])])
  }

  /**
   * As take without a ping, where it need not wait: an idle backend of `key` not being reset
   * (undefined: none, or the next is being reset, which take waits for). `use`: false where it is
   * taken to go to another worker, not for a session here.
   */
  takeNow(key: string, use = true): Backend | undefined {
    const list = this.idle.get(key)
    while (list?.length && !list[list.length - 1].resetting) {
      const backend = list.pop()!
      if (!list.length) this.idle.delete(key)
      clearTimeout(backend.idleTimer)
      if (this.expired(backend)) {
        this.discard(backend)
        continue
      }
      return use ? this.taken(key, backend) : backend
    }
    return undefined
  }

  /**
   * A backend taken from the pool or lent, to go to another worker (proxy/pool/asks.ts): no longer
   * this pool's. Its socket; undefined over TLS, which cannot move (the backend is closed).
   */
  handOff(backend: Backend): Socket | undefined {
    clearTimeout(backend.idleTimer)
    backend.queue = undefined
    this.forget(backend)
    const socket = backend.upstream.release()
    if (!socket) backend.upstream.close()
    return socket
  }

  private taken(key: string, backend: Backend): Backend {
    this.lastUsed.set(key, (backend.lastUsed = Date.now()))
    backend.kept = false
    this.onEvent('hit')
    return backend
  }

  /**
   * An idle backend for `key`, or undefined (a miss): one still being reset once that is done (a
   * session right behind another need not fork), else one that answers a ping (unless `ping` is
   * false: the caller sends its own ahead of its statements, and retries elsewhere if it goes
   * unanswered).
   */
  async take(key: string, ping: boolean): Promise<Backend | undefined> {
    const list = this.idle.get(key)
    while (list?.length) {
      const backend = list.pop()!
      if (!list.length) this.idle.delete(key)
      clearTimeout(backend.idleTimer)
      const ok = backend.resetting ? await backend.resetting : !this.expired(backend) && (!ping || (await this.ping(backend)))
      if (!ok) {
        this.discard(backend)
        continue
      }
      return this.taken(key, backend)
    }
    this.onEvent('miss')
    return undefined
  }

  /**
   * A logged-in backend for a login: a warm one for `key` (when given), else what `login` makes of a
   * fresh connection, kept by the pool when the login succeeded and there is room. The outcome is
   * Postgres's answer, for a session: a pooled backend's with the session's own cancel secret.
   * Without `session` (for the proxy's own statements) a pooled backend's answer is left empty and a
   * warm one is not pinged (`warm`: the caller pings it in its first write).
   */
  async open(
    key: string | undefined,
    login: () => Promise<{ upstream: Upstream; outcome: LoginOutcome }>,
    session = true
  ): Promise<{ upstream: Upstream; backend?: Backend; outcome: LoginOutcome; warm?: boolean }> {
    const warm = key ? await this.take(key, session) : undefined
    if (warm) return { upstream: warm.upstream, backend: warm, outcome: { kind: 'ready', answer: this.lend(warm, session) }, warm: true }
    const reserved = key !== undefined && this.reserve()
    try {
      const { upstream, outcome } = await login()
      const backend = key && outcome.kind === 'ready' ? this.adopt(key, upstream, outcome.answer) : undefined
      return { upstream, backend, outcome: backend ? { kind: 'ready', answer: this.lend(backend, session) } : outcome }
    } finally {
      if (reserved) this.unreserve()
    }
  }

  /**
   * Room for a login the pool will adopt, made before it reaches Postgres: where the pool is full,
   * the idle backend used longest ago (whatever its key) is closed for it. False when every backend
   * is lent. Whoever reserves gives the place up (unreserve) once its login is adopted or has failed.
   */
  reserve(): boolean {
    while (this.owned.size + this.reserved >= this.maxBackends) if (!this.closeOldest()) return false
    this.reserved++
    return true
  }

  unreserve() {
    this.reserved--
  }

  /** Every backend the pool may own is lent, or being logged in. */
  get full(): boolean {
    return this.owned.size + this.reserved >= this.maxBackends && !this.size.idle
  }

  /** Closes the idle backend used longest ago, of those `which` picks (all): false if there is none. */
  private closeOldest(which: (backend: Backend) => boolean = () => true): boolean {
    let oldest: Backend | undefined
    for (const list of this.idle.values()) for (const backend of list) if (which(backend) && (!oldest || backend.lastUsed < oldest.lastUsed)) oldest = backend
    if (oldest) this.evict(oldest)
    return !!oldest
  }

  /**
   * A backend a session just logged in: the pool owns it from now on, if there is room (and it
   * has a cancel key, without which a lent one could not be cancelled).
   */
  adopt(key: string, upstream: Upstream, answer: Buffer, born?: number): Backend | undefined {
    const answered = messages(answer)
    if (!this.enabled || this.closed || !answered.some((m) => m[0] === ServerMessage.BackendKeyData)) return undefined
    if (this.owned.size >= this.maxBackends && !this.closeOldest()) return undefined
    const backend = new Backend(upstream, key, answered, born)
    this.owned.set(`${upstream.name} ${backend.key.pid}`, backend)
    this.lastUsed.set(key, Date.now())
    upstream.on('close', () => {
      this.forget(backend)
      backend.queue?.fail(new Error('Postgres closed the connection'))
    })
    return backend
  }

  /** Lends a backend (to a session: Postgres's login answer, with a cancel secret for that session alone). */
  private lend(backend: Backend, session: boolean): Buffer {
    backend.queue = undefined
    if (!session) return EMPTY
    backend.lentSecret = randomBytes(backend.key.secret.length)
    return backend.answerWith(backend.lentSecret)
  }

  /**
   * The session is over. A backend it left idle, or about to be (its last ReadyForQuery on the
   * way), is reset once that is in and kept (available at once: a take() waits for the reset); a
   * busy one is closed, its running query cancelled; one a reset cannot clean (see IdleWatch) is
   * closed. `reset`: the caller sent the reset itself (behind its last statement), and this says
   * how it went (undefined: it could not, as a transaction was open, and the pool resets it once
   * the caller's answers are in); or, with `ending.clean`, what it asked before the backend is kept
   * as it is.
   */
  giveBack(backend: Backend, ending: Ending | undefined, reset?: Promise<boolean | undefined>) {
    backend.lentSecret = undefined
    backend.lastUsed = Date.now()
    if (!ending) return this.discard(backend, true)
    const list = this.idle.get(backend.poolKey) ?? []
    if (!ending.reusable || this.closed || this.expired(backend) || backend.upstream.gone || list.length >= this.maxIdlePerKey) return this.discard(backend)
    list.push(backend)
    this.idle.set(backend.poolKey, list)
    if (!ending.clean) backend.resets++
    const own = () => this.exchange(backend, ending.pending === 0 && ending.status === TxStatus.Idle ? [DISCARD_ALL, reseed()] : [ROLLBACK, DISCARD_ALL, reseed()], ending.pending)
    const done = reset
      ? reset.then((ok) => (ok === undefined ? own() : ok && (this.watchIdle(backend), true)))
      : ending.clean
        ? Promise.resolve((this.watchIdle(backend), true))
        : own()
    backend.resetting = done.then((ok) => {
      backend.resetting = undefined
      if (!ok) return this.evict(backend, true), false // (a query of the session's may still be running)
      if (!ending.clean) this.onEvent('reset'), (backend.user = undefined)
      this.idleFor(backend, this.idleTimeoutMs)
      return true
    })
  }

  /** The CancelRequest to send for one a client sent, when it names the session now holding a pooled backend. */
  cancelRequest(upstream: string, packet: Buffer): Buffer | undefined {
    const backend = this.owned.get(`${upstream} ${packet.readInt32BE(8)}`)
    return backend?.lentSecret?.equals(packet.subarray(12)) ? cancelRequest(backend.key) : undefined
  }

  close() {
    this.closed = true
    for (const list of this.idle.values()) for (const backend of [...list]) this.discard(backend)
    this.idle.clear()
  }

  private expired(backend: Backend) {
    return Date.now() - backend.born >= this.maxLifetimeMs
  }

  /** An idle backend's next look, `ms` from now or at its lifetime's end (a kept one: when it is due to be replaced). */
  private idleFor(backend: Backend, ms: number) {
    const ageLeft = backend.born + this.maxLifetimeMs - Date.now()
    const due = this.keepWarmMs && this.renewers.has(backend.poolKey) ? ageLeft - this.renewAhead : ageLeft
    backend.idleTimer = setTimeout(() => this.idleLong(backend), Math.max(0, Math.min(ms, due))).unref()
  }

  /** Before a kept backend's lifetime ends, its replacement logs in: a tenth of the lifetime ahead, at most a minute. */
  private get renewAhead() {
    return Math.min(60_000, this.maxLifetimeMs / 10)
  }

  /**
   * An idle backend's idle timeout, or its lifetime, is up: closed, unless it is its key's last and
   * the key was used within keepWarmMs; then kept, and replaced by a fresh login before it ages out.
   */
  private idleLong(backend: Backend) {
    const key = backend.poolKey
    const used = this.lastUsed.get(key) ?? 0
    const now = Date.now()
    if (this.closed || this.idleCount(key) !== 1 || now - used >= this.keepWarmMs) {
      if (this.idleCount(key) === 1 && now - used >= this.keepWarmMs) this.renewers.delete(key), this.lastUsed.delete(key) // (a key gone quiet)
      return this.evict(backend)
    }
    if (!backend.kept && ((backend.kept = true), !this.keptWithinShare(backend))) return
    const ageLeft = backend.born + this.maxLifetimeMs - now
    const renew = this.renewers.get(key)
    if (renew && ageLeft <= this.renewAhead) return void this.renew(key, renew.login).then(
      (fresh) => (fresh && renew.renewed?.(fresh), this.evict(backend)),
      () => this.evict(backend)
    )
    if (ageLeft <= 0) return this.evict(backend)
    this.idleFor(backend, used + this.keepWarmMs - now)
  }

  /**
   * One client keeps at most perClient keys warm (a client that varies its startup parameters
   * makes a key of each): past that, the one it used longest ago is closed. False if that was `backend`.
   */
  private keptWithinShare(backend: Backend): boolean {
    const { client } = backend
    if (client === undefined) return true
    const theirs = (b: Backend) => b.kept && b.client === client
    let n = 0
    for (const list of this.idle.values()) for (const b of list) if (theirs(b)) n++
    for (; n > this.perClient; n--) this.closeOldest(theirs)
    return !!this.idle.get(backend.poolKey)?.includes(backend)
  }

  /** A fresh backend for `key`, logged in ahead of need and kept idle. */
  private async renew(key: string, login: () => Promise<{ upstream: Upstream; outcome: LoginOutcome }>): Promise<Backend | undefined> {
    const { upstream, outcome } = await login().catch(() => ({ upstream: undefined, outcome: undefined }))
    const used = this.lastUsed.get(key) ?? 0
    const backend = upstream && outcome?.kind === 'ready' ? this.adopt(key, upstream, outcome.answer) : undefined
    if (!backend) return void upstream?.close()
    this.lastUsed.set(key, used) // (a renewal is no use of the key)
    this.giveBack(backend, { pending: 0, status: TxStatus.Idle, reusable: true, clean: true })
    this.onEvent('renew')
    return backend
  }

  /**
   * Sends `sent` and reads Postgres's answers up to as many ReadyForQuery, after `pending` ones
   * still due to the session (whatever they say); true if all went well and it is idle.
   */
  private exchange(backend: Backend, sent: Buffer[], pending = 0): Promise<boolean> {
    if (backend.upstream.gone) return Promise.resolve(false) // (its close came and went: nothing would answer)
    const queue = (backend.queue = new ByteQueue())
    const early = backend.upstream.relay((chunk) => queue.push(chunk))
    if (early.length) queue.push(early)
    backend.upstream.resume()
    backend.upstream.write(Buffer.concat(sent))
    const timeout = setTimeout(() => queue.fail(new Error('no answer')), ANSWER_TIMEOUT_MS)
    const read = async () => {
      let ok = true
      for (let left = pending + sent.length; left > 0; ) {
        const msg = await queue.message(1 << 20)
        if (msg.type === 'E' && left <= sent.length) ok = false
        else if (msg.type === 'S') backend.noteParameter(msg.raw)
        else if (msg.raw[0] === ServerMessage.ReadyForQuery) {
          left--
          if (!left && msg.body[0] !== TxStatus.Idle) ok = false
        }
      }
      return ok
    }
    return read().then(
      (ok) => {
        clearTimeout(timeout)
        if (ok) this.watchIdle(backend, queue)
        return ok
      },
      () => (clearTimeout(timeout), false)
    )
  }

  /** A pinged backend still speaks: Sync, answered by ReadyForQuery (idle). */
  private ping(backend: Backend): Promise<boolean> {
    return this.exchange(backend, [SYNC])
  }

  /** While idle, Postgres may report a changed setting, or a notification (its last session listened there: proxy/notify/); anything else (a FATAL, say) ends the backend. */
  private watchIdle(backend: Backend, queue = new ByteQueue()) {
    if (backend.upstream.gone) queue.fail(new Error('Postgres closed the connection'))
    if (backend.queue !== queue) {
      backend.queue = queue
      queue.push(backend.upstream.relay((chunk) => queue.push(chunk)))
    }
    const next = (): Promise<void> =>
      queue.message(1 << 20).then(
        (msg) => {
          if (backend.queue !== queue) return
          if (msg.type === 'S') backend.noteParameter(msg.raw)
          if (msg.type === 'S' || msg.type === 'N' || msg.type === 'A') return next()
          this.evict(backend)
        },
        () => void (backend.queue === queue && this.evict(backend))
      )
    next()
  }

  /** An idle backend leaves the pool and is closed. */
  private evict(backend: Backend, cancel = false) {
    const list = this.idle.get(backend.poolKey)
    const at = list?.indexOf(backend) ?? -1
    if (at < 0) return
    list!.splice(at, 1)
    if (!list!.length) this.idle.delete(backend.poolKey)
    this.discard(backend, cancel)
  }

  private discard(backend: Backend, cancel = false) {
    clearTimeout(backend.idleTimer)
    backend.queue = undefined
    this.forget(backend)
    backend.upstream.close(cancel ? backend.key : undefined)
    this.onEvent('discard')
  }

  private forget(backend: Backend) {
    const id = `${backend.upstream.name} ${backend.key.pid}`
    if (this.owned.get(id) === backend) this.owned.delete(id)
  }
}

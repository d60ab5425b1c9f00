/**
 * Backends for POST /sql requests, from the proxy's one pool: a request logs in as a default pg
 * Client would, so it finds the backends WebSocket sessions left (and leaves its own for them). At
 * most `perKey` requests per credentials hold a backend at once; the rest wait their turn.
 */
import { DatabaseError, serialize } from 'pg-protocol'
import { Parser } from 'pg-protocol/dist/parser'
import { formatHostPort, type HostPort } from '../upstream/address'
import type { Backend, BackendPool } from '../pool/backends'
import { Lender, LoginRefused, PoolTimeout } from '../pool/lender'
import type { Lenders } from '../pool/lenders'
import { Upstream, type UpstreamTls } from '../upstream/connection'
import { loginAs, type LoginOutcome } from '../login/in-upgrade'
import { LoginWatch, parseStartupPacket, UpstreamError, type BackendKey } from '../wire/startup'
import { Statements } from './statements'
import { ClaimsError, REPLICA_CLAIMS_ENDS, replicaClaimsMessages, setClaims, type ReplicaKeyCache } from '../auth/claims'
import { HttpError, parseConnectionString, type ConnInfo } from './request'

export interface LeaseOptions {
  backends: BackendPool
  /** Transaction pooling: a request borrows a backend from its key's lender (which then also bounds how many at once). */
  lenders?: Lenders
  /** The proxy's upstream (a connection string may leave its port out). */
  upstream: HostPort
  upstreamTls?: UpstreamTls
  /** Requests per credentials holding a backend at once. */
  perKey: number
  /** Longest wait for a turn, and then for a login, before HTTP 503. */
  connectTimeoutMs: number
  /** statement_timeout in ms (0: none), SET by each request when the pool is on (see proxy/sql/handler.ts). */
  statementTimeoutMs: number
  applicationName?: string
}

/** A request's backend: from the pool (`backend`) or a connection of its own. */
export interface Lease {
  upstream: Upstream
  backend?: Backend
  key?: BackendKey
  statements: Statements
  /** A warm backend not pinged yet: the request's first write pings it. */
  unpinged: boolean
  /** The reset sent behind the last statement: whether it left the backend idle and clean. */
  reset?: Promise<boolean>
  /** A statement may have made a custom setting: the backend is not reused. */
  customSetting: boolean
  /** statement_timeout is SET for this request: Postgres enforces it. */
  timeoutSet: boolean
  /** Transaction pooling: the lender of `backend`. */
  lender?: Lender
  /** Transaction pooling: the backend changed hands, and is reset ahead of the request's statements (proxy/sql/run.ts). */
  handover?: boolean
}

/** One request's hold on a backend: what is running, and whether the backend may be reused. */
export class Control {
  lease?: Lease
  /** Waiting for its turn: give up. */
  onAbort?: () => void
  /** A statement is on the wire. */
  running = false
  /** The backend must be closed, not reused (cancelled, broken, or the client left). */
  tainted = false
  aborted = false
  /** The proxy's own statement timer fired. */
  timedOut = false
  /** Aborted by close(): answered 503. */
  shutdown = false
  tooLarge = false

  /**
   * Stops the request. Only a statement on the wire needs Postgres's help (a CancelRequest); between
   * statements the request itself notices (it checks `aborted` before each) and stops.
   */
  cancel() {
    this.onAbort?.()
    const lease = this.lease
    if (!this.running || this.tainted || !lease) return
    this.tainted = true
    if (lease.key) lease.upstream.cancel(lease.key)
  }
}

/** A connection string, parsed, with its StartupMessage and its pool keys by upstream. */
export interface Credentials {
  conn: ConnInfo
  startup: Buffer
  keys: Map<string, string>
  /** A request by token: its claims, set on the backend before its statements run (proxy/auth/claims.ts). */
  claims?: string
}

/** Connection strings remembered parsed, at most. */
const MAX_CREDENTIALS = 1000

export class Leases {
  private readonly turns = new Map<string, { held: number; waiting: Array<() => void> }>()
  private readonly credentials = new Map<string, Credentials>()

  constructor(private readonly o: LeaseOptions) {}

  /** Requests waiting for their turn. */
  get waiting(): number {
    let n = 0
    for (const t of this.turns.values()) n += t.waiting.length
    return n
  }

  /**
   * A connection string, parsed once, with the StartupMessage a default pg Client sends for it:
   * most requests repeat the same few. (Held in memory, as the requests themselves are.)
   */
  credentialsFor(text: string | undefined, anyUser = false): Credentials {
    const known = text === undefined ? undefined : this.credentials.get(text)
    if (known) return known
    const conn = parseConnectionString(text, this.o.upstream, anyUser)
    const startup = serialize.startup({ user: conn.user, database: conn.database, ...(this.o.applicationName && { application_name: this.o.applicationName }) })
    if (this.credentials.size >= MAX_CREDENTIALS) this.credentials.delete(this.credentials.keys().next().value!)
    const parsed = { conn, startup, keys: new Map<string, string>() }
    this.credentials.set(text!, parsed)
    return parsed
  }

  /** A request by token: `conn`'s database as `role`, with the role's password and the token's claims. */
  credentialsAs(conn: ConnInfo, role: string, password: string, claims: string, database: string): Credentials {
    const text = JSON.stringify(['token', conn.named.host, conn.named.port, database, role, password])
    const known = this.credentials.get(text)
    if (known) return { ...known, claims }
    const as = { ...conn, user: role, password, database }
    const startup = serialize.startup({ user: role, database, ...(this.o.applicationName && { application_name: this.o.applicationName }) })
    if (this.credentials.size >= MAX_CREDENTIALS) this.credentials.delete(this.credentials.keys().next().value!)
    const parsed = { conn: as, startup, keys: new Map<string, string>() }
    this.credentials.set(text, parsed)
    return { ...parsed, claims }
  }

  /**
   * Runs `use` on a backend for these credentials at `target`, once its turn has come, and gives the
   * backend back after. A warm backend that died while idle answers nothing, not even the ping that
   * goes out with the first statement: then nothing ran, and `use` runs again on another.
   */
  async with<T>(target: HostPort, credentials: Credentials, ctl: Control, use: (lease: Lease) => Promise<T>, claimsAt: ClaimsAt = {}): Promise<T> {
    const name = formatHostPort(target)
    const { keys, conn, startup } = credentials
    const key = keys.get(name) ?? keys.set(name, this.o.backends.key(name, undefined, startup, conn.password, credentials.claims !== undefined)).get(name)!
    const { lenders } = this.o
    if (!lenders) await this.waitTurn(key, ctl)
    try {
      for (;;) {
        const lease = (ctl.lease = await (lenders ? this.borrow(lenders, target, credentials, key, ctl) : this.lease(target, credentials, key)))
        try {
          if (ctl.aborted) throw new HttpError(499, 'client went away')
          // Whatever the backend's last user left is reset at the head of the first write, in its Sync group.
          if (lease.handover) lease.statements.handOver()
          const { claims } = credentials
          // A token's claims: on a standby, in the write and group of the request's statements; on the primary, first.
          if (claims !== undefined && claimsAt.replicaKey) lease.statements.lead(replicaClaimsMessages(claims, claimsAt.replicaKey), REPLICA_CLAIMS_ENDS)
          else if (claims !== undefined) await this.setClaims(lease, ctl, claims, claimsAt.learn)
          return await use(lease)
        } catch (err) {
          const { refused } = lease.statements
          if (refused && claimsAt.replicaKey && refused.code === '42501') throw new ClaimsError(`edgepg-proxy: the standby refused the claims: ${refused.message}`, refused.code) // (no other backend would take them)
          // (Nothing ran: a warm backend that died while idle, or one whose reset Postgres refused.)
          const ranNothing = refused || (lease.unpinged && lease.statements.broken && lease.statements.answered === 0)
          if (!ranNothing || ctl.aborted) throw err
          ctl.tainted = false
        } finally {
          ctl.lease = undefined
          this.release(lease, ctl)
        }
      }
    } finally {
      if (!lenders) this.endTurn(key)
    }
  }

  /** The token's claims on the lease's backend before anything else runs there (it is pinged too, then); and the replica key, if it is to be learnt. */
  private async setClaims(lease: Lease, ctl: Control, claims: string, learn?: ReplicaKeyCache) {
    const { statements } = lease
    const failed = (err: DatabaseError) => {
      if (statements.broken) throw err // (a warm backend that died while idle: tried again on another, see with())
      return { code: err.code ?? '', message: err.message }
    }
    const send = (bytes: Buffer) => statements.own(bytes).then(() => undefined, failed)
    try {
      await setClaims(lease.upstream, claims, send)
      if (learn && !learn.key) {
        let first: string | undefined
        await learn.learn(lease.upstream, (bytes) => statements.own(bytes, (row) => void (first ??= row[0] ?? undefined)).then(() => ({ first }), (err) => ({ error: failed(err) })))
      }
    } catch (err) {
      if (err instanceof ClaimsError) {
        ctl.tainted = true
        throw new HttpError(500, err.message, err.code)
      }
      throw err
    }
    lease.unpinged = false
  }

  /** Waits for one of the `perKey` turns at a backend for `key` (503 after connectTimeoutMs). */
  private waitTurn(key: string, ctl: Control): Promise<void> {
    const t = this.turns.get(key) ?? { held: 0, waiting: [] }
    this.turns.set(key, t)
    if (t.held < this.o.perKey) {
      t.held++
      return Promise.resolve()
    }
    return new Promise((resolve, reject) => {
      const turn = () => {
        clearTimeout(timer)
        ctl.onAbort = undefined
        resolve()
      }
      const leave = (err: Error) => {
        t.waiting.splice(t.waiting.indexOf(turn), 1)
        clearTimeout(timer)
        reject(err)
      }
      const ms = this.o.connectTimeoutMs
      const timer = setTimeout(() => leave(new HttpError(503, `no connection to Postgres available in time (waited ${ms} ms)`)), ms)
      ctl.onAbort = () => leave(new HttpError(499, 'client went away'))
      t.waiting.push(turn)
    })
  }

  /** The turn passes to the next request waiting, if any. */
  private endTurn(key: string) {
    const t = this.turns.get(key)!
    const next = t.waiting.shift()
    if (next) return next()
    if (--t.held === 0) this.turns.delete(key)
  }

  /** A logged-in backend: a warm one, else a fresh login (kept by the pool when it has room). */
  private async lease(target: HostPort, credentials: Credentials, key: string): Promise<Lease> {
    const { backends } = this.o
    const { upstream, backend, outcome, warm } = await this.login(target, credentials, (login) => backends.open(backends.enabled ? key : undefined, login, false))
    if (outcome.kind !== 'ready') {
      upstream.close()
      throw loginRefusal(outcome, credentials.conn.user)
    }
    return {
      upstream,
      backend,
      key: backend?.key ?? keyIn(outcome.answer),
      statements: new Statements(upstream),
      unpinged: !!warm,
      customSetting: false,
      timeoutSet: backends.enabled && this.o.statementTimeoutMs > 0,
    }
  }

  /**
   * Transaction pooling: a backend borrowed from the key's lender, in its turn (HTTP 503 with
   * SQLSTATE 53300 past --pool-timeout). Nothing is SET on it (the proxy's own timer enforces the
   * statement timeout), so a request that leaves nothing behind needs no reset.
   */
  private async borrow(lenders: Lenders, target: HostPort, credentials: Credentials, key: string, ctl: Control): Promise<Lease> {
    const relogin = () => loginAs(target, this.o.upstreamTls, loginOf(credentials))
    const got = await this.login(target, credentials, (login) => lenders.lenderFor(key, () => this.o.backends.open(key, login, false), relogin))
    if (!(got instanceof Lender)) {
      got.upstream.close()
      throw loginRefusal(got.outcome, credentials.conn.user)
    }
    // Waiting its turn: a client that goes away leaves the line. A login Postgres refuses the key
    // now (too many connections, shutting down) is, like the wait, no backend to be had: 503.
    const backend = await got
      .acquire((leave) => (ctl.onAbort = () => leave(new HttpError(499, 'client went away'))))
      .catch((err: Error) => {
        if (err instanceof PoolTimeout || err instanceof LoginRefused) throw new HttpError(503, err.message, err.code)
        throw err
      })
      .finally(() => (ctl.onAbort = undefined))
    const { upstream } = backend
    // Whatever the last user left is reset ahead of this request's statements, whatever they read like.
    const lease: Lease = { upstream, backend, key: backend.key, statements: new Statements(upstream), unpinged: true, customSetting: false, timeoutSet: false, lender: got }
    if (backend.user !== undefined) (lease.handover = true), backend.resets++
    backend.user = {} // (each request is another user)
    return lease
  }

  /** Runs `open` with a login for these credentials, within connectTimeoutMs: Postgres's errors as they are, the rest as HTTP errors. */
  private async login<T>(target: HostPort, credentials: Credentials, open: (login: () => Promise<{ upstream: Upstream; outcome: LoginOutcome }>) => Promise<T>): Promise<T> {
    const { connectTimeoutMs } = this.o
    let fresh: Upstream | undefined
    let late = false
    const timer = setTimeout(() => ((late = true), fresh?.close()), connectTimeoutMs)
    const login = () => loginAs(target, this.o.upstreamTls, loginOf(credentials), (upstream) => (fresh = upstream))
    try {
      return await open(login)
    } catch (err) {
      if (late) throw new HttpError(503, `no connection to Postgres available in time (no login within ${connectTimeoutMs} ms)`)
      if (err instanceof DatabaseError || err instanceof HttpError) throw err
      throw new HttpError(502, `cannot connect to Postgres at ${formatHostPort(target)}: ${fresh?.error?.code ?? (err as Error).message}`)
    } finally {
      clearTimeout(timer)
    }
  }

  /**
   * The backend goes back to the pool, idle and reset (by the reset sent behind the last statement,
   * or else by the pool), or is closed.
   */
  private release(lease: Lease, ctl: Control) {
    const { statements, backend, reset, lender } = lease
    const clean = !ctl.tainted && !statements.broken
    const ending = () => ({ pending: 0, status: statements.status.charCodeAt(0), reusable: !lease.customSetting })
    if (lender && backend) {
      if (lease.handover) lender.events.handedOver(statements.refused ? 'refused' : 'reset')
      // As it is: its next taker resets it. (A placeholder no reset takes back, or a transaction left open: the pool's.)
      statements.detach()
      if (clean && !statements.refused && !lease.customSetting && statements.status === 'I') return lender.giveBack(backend)
      return lender.endSession(backend, clean && !statements.refused ? ending() : undefined)
    }
    if (!backend || !clean || !reset) {
      statements.detach()
      if (!backend) return lease.upstream.close(clean ? undefined : lease.key)
      return this.o.backends.giveBack(backend, clean ? ending() : undefined)
    }
    this.o.backends.giveBack(backend, ending(), afterReset(statements, reset))
  }
}

/**
 * How the reset sent behind the last statement went, once it is answered. After a transaction left
 * open it fails: undefined then, for the pool's own reset (ROLLBACK first). The backend is given
 * back at once either way, so a login right behind this request waits for it instead of forking.
 */
const afterReset = (statements: Statements, reset: Promise<boolean>) =>
  (statements.status === 'I' ? reset : reset.then(() => undefined)).finally(() => statements.detach())

/** Where a token's claims go on a lease: on a standby, vouched for by the replica key; on the primary, with the replica key learnt there if need be. */
export interface ClaimsAt {
  replicaKey?: Buffer
  learn?: ReplicaKeyCache
}

/** The login a default pg Client makes with these credentials. */
const loginOf = ({ conn, startup }: Credentials) => ({ bytes: startup.length, first: parseStartupPacket(startup), password: conn.password, rest: Buffer.alloc(0) })

/** A refused login as the error Postgres gave (its ErrorResponse, every field), or why there was none. */
function loginRefusal(outcome: LoginOutcome, user: string): Error {
  let error: Error | undefined
  if (outcome.kind === 'refused') new Parser().parse(outcome.answer, (msg) => void (msg.name === 'error' && (error ??= msg as DatabaseError)))
  if (error) return error
  if (outcome.kind === 'relay') return new HttpError(400, `Postgres asks for a password for user "${user}", and the connection string has none`, '28P01')
  return new UpstreamError(`unexpected answer to a login: ${outcome.kind}`)
}

/** The cancel key in a login's answer. */
function keyIn(answer: Buffer): BackendKey | undefined {
  const watch = new LoginWatch()
  watch.feed(answer)
  return watch.key
}

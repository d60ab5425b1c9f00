/// <reference path="./pg-internals.d.ts" />
import './install-buffer'
import pg from 'pg'
import { isIP } from 'net'
import { serialize } from 'pg-protocol'
import { configKeys, setting, IN_WORKERS, TOKEN_MESSAGE, type EdgeConfig } from './config'
import { TOKEN_NEEDS, WebSocketSocket } from './socket'
import { TlsSocket } from './tls'
import { poolQueryViaHttp, type HttpPoolConfig } from './http'
import { CANCEL_WHEN_RUNNING, stoppableQuery, timeSubmittable } from './stop'
import sasl from 'pg/lib/crypto/sasl.js'

// pg's own exports, as they are (and pg's connection-string parser, which Neon exports).
export const { types, defaults, DatabaseError, Query, escapeIdentifier, escapeLiteral } = pg
export { parseIntoClientConfig } from 'pg-connection-string'

/** A signed token (JWT) for edgepg-proxy's logins by token, instead of a password: a string, or a function returning one (or a promise of one), called for each connection. */
export type AuthToken = string | (() => string | Promise<string>)
export type ClientConfig = pg.ClientConfig & EdgeConfig & { authToken?: AuthToken }
export type PoolConfig = pg.PoolConfig & EdgeConfig & HttpPoolConfig & { authToken?: AuthToken }

/**
 * Split a user's config into pg's part and edgepg's own keys, so pg never sees ours. pg-pool hands
 * its clients a non-enumerable `password`, which a copy of the keys would miss. (Plain copies:
 * this runs for every connection, and copying property descriptors cost nearly what pg's own
 * constructor does.)
 */
function splitConfig(input?: string | ClientConfig): { options: pg.ClientConfig; own: EdgeConfig } {
  if (typeof input === 'string') return { options: { connectionString: input }, own: {} }
  const options: any = { password: input?.password }
  const own: any = {}
  for (const key in input) ((configKeys as readonly string[]).includes(key) ? own : options)[key] = (input as any)[key]
  return { options, own }
}

const NEON_HOST = /\.neon\.(tech|build)$/

/** The first flight carries the token (resolved now), in the upgrade: edgepg-proxy logs in as the role it names. */
async function sendToken(socket: WebSocketSocket | TlsSocket, given: AuthToken) {
  try {
    if (socket instanceof TlsSocket) throw TOKEN_NEEDS
    ;(socket.token = serialize.password(typeof given == 'function' ? await given() : given))[0] = TOKEN_MESSAGE
  } catch (err) {
    socket.destroy(new Error(`edgepg: authToken: ${(err as Error)?.message ?? err}`))
  }
  socket.uncork()
}
const PgQuery = (pg as any).Query

/** A query that is answered in one go (no portal kept open), so it can share the pipeline. */
const isPlainQuery = (q: any) => q instanceof PgQuery && !q.rows

/** pg's connection config, as pg hands it to the stream factory. */
interface StreamConfig {
  ssl?: unknown
  sslNegotiation?: string
}

type SslOptions = { ca?: unknown; servername?: string; rejectUnauthorized?: boolean; checkServerIdentity?: unknown; key?: unknown; cert?: unknown; pfx?: unknown }

/**
 * The transport for one connection: a WebSocket, with TLS to Postgres when pg's `ssl` asks for it.
 * With `rootCerts` (or `ssl.ca`) edgepg runs it inside the WebSocket; otherwise edgepg-proxy makes
 * it, verified as pg would (`rejectUnauthorized: false` is sslmode require; a `checkServerIdentity`
 * of the user's, which cannot run at the proxy, verify-ca).
 */
function openSocket(own: EdgeConfig, { ssl, sslNegotiation }: StreamConfig): WebSocketSocket | TlsSocket {
  const socket = new WebSocketSocket(own)
  if (!ssl || setting(own, 'forceDisablePgSSL')) return socket
  const options: SslOptions = typeof ssl === 'object' ? ssl : {}
  if (options.key || options.cert || options.pfx) {
    socket.refusal = new Error('edgepg: client certificates (ssl.key, ssl.cert, ssl.pfx) are not supported: the proxy cannot present them')
  }
  const rootCerts = setting(own, 'rootCerts') ?? (typeof options.ca === 'string' ? options.ca : undefined)
  if (rootCerts) return new TlsSocket(socket, { host: options.servername, rootCerts, pipelineTLS: setting(own, 'pipelineTLS') })
  socket.upstreamTls = {
    sslmode: options.rejectUnauthorized === false ? 'require' : typeof options.checkServerIdentity === 'function' ? 'verify-ca' : 'verify-full',
    sslnegotiation: sslNegotiation === 'direct' ? 'direct' : 'postgres',
    servername: options.servername,
  }
  return socket
}

/** The WebSocket under a client's connection (under TLS inside it, if any); none before connect(). */
const webSocketOf = (client: pg.Client): WebSocketSocket | undefined => {
  const stream = (client as any).connection?.stream
  return stream instanceof TlsSocket ? stream.inner : stream instanceof WebSocketSocket ? stream : undefined
}

/** False for a connection opened by an earlier request of a Cloudflare Worker (see WebSocketSocket.usableHere). */
const usableHere = (client: pg.Client) => webSocketOf(client)?.usableHere !== false

const crossedRequests = () =>
  new Error("edgepg: this Client was connected in an earlier request, and a Worker's connection serves only the request that opened it. Create the Client in the request handler, or use a Pool.")

/** Fails a query the way pg fails one it cannot send: through its callback, its promise, or the Submittable's handleError. */
function refuseQuery(client: pg.Client, err: Error, args: any[]) {
  const [config] = args
  if (typeof config?.submit === 'function') {
    queueMicrotask(() => config.handleError(err, (client as any).connection))
    return config
  }
  const callback = args.slice(1).find((a) => typeof a === 'function') ?? (typeof config?.callback === 'function' ? config.callback : undefined)
  if (!callback) return Promise.reject(err)
  queueMicrotask(() => callback(err))
}

/** A query that keeps a portal open across round trips (pg-cursor, query streams, COPY, `rows`). */
const isPortalQuery = (config: any) =>
  typeof config === 'object' && config !== null && ((typeof config.submit === 'function' && !(config instanceof PgQuery)) || Boolean(config.rows))

/** node-postgres's Client, connected over a WebSocket to edgepg-proxy. */
export class Client extends pg.Client {
  /** This client's overrides of the global `config`. */
  readonly edgeConfig: EdgeConfig
  /** The password went out right behind the StartupMessage: Postgres's request for it is answered. */
  private passwordSent = false
  /** Plain queries pipelined, a portal query alone (unless `pipeline: false`). */
  private readonly pipelining: boolean
  /** pg's own strict pipeline mode (`pipeline: true`). */
  private readonly strict: boolean
  /** Queries queued earlier are set aside while pg queues a new one (see query()). */
  private holding = false
  /** The active query failed before anything was sent: pg answers it on the next tick, and nothing goes behind it. */
  private stalled = false
  /** As given, for the connection that carries a CancelRequest (not enumerable: it holds the password, which pg keeps out of sight too). */
  declare private readonly given?: string | ClientConfig
  /** pg's `query_timeout`, kept here: edgepg's cancels the statement (pg's leaves it running). */
  private readonly queryTimeout?: number
  /** ReadyForQuery messages read since the login: names the running statement to a cancel. */
  private readies = 0

  /** Neon's name for this client's own options (over the global `config`). */
  get neonConfig(): EdgeConfig {
    return this.edgeConfig
  }

  constructor(config?: string | ClientConfig) {
    const { options, own } = splitConfig(config)
    // pg hands the stream factory its connection config, `ssl` (from options or sslmode) included.
    if (!options.stream) options.stream = ((conn: StreamConfig) => openSocket(own, conn)) as any
    super(options)
    this.edgeConfig = own
    Object.defineProperty(this, 'given', { value: config })
    const params = (this as any).connectionParameters as { query_timeout?: number } // pg's internals
    this.queryTimeout = params.query_timeout
    params.query_timeout = undefined
    this.pipelining = options.pipeline !== false
    this.strict = options.pipeline === true
    // (Registered before pg's own listener, which marks the login's ReadyForQuery as connected.)
    this.connection.on('readyForQuery', () => (this as any)._connected && this.readies++)
    // pg must not negotiate TLS itself: TlsSocket does it inside the WebSocket, or edgepg-proxy
    // to Postgres (see openSocket).
    this.ssl = false
    ;(this.connection as any).ssl = false
  }

  _connect(callback: (err?: Error, client?: Client) => void) {
    const self = this as any // pg's internals
    const con = this.connection as any
    const socket: WebSocketSocket | TlsSocket = con.stream
    if (socket instanceof WebSocketSocket) {
      socket.deferOpen = true
      // As pg: a host name (not an address) is the name the certificate must carry, whatever ssl.servername says.
      if (socket.upstreamTls && !isIP(this.host)) socket.upstreamTls.servername = this.host
    }
    ;(pg.Client.prototype as any)._connect.call(this, callback)
    // pg's own listener has just written the StartupMessage (before the WebSocket opens). The
    // password joins the first flight, so it is needed now (pg resolves a password function, or
    // pgpass, as it would when asked); the flight waits for it.
    con.once('connect', () => {
      socket.cork()
      const token = (this.given as ClientConfig | undefined)?.authToken
      if (token !== undefined) return void sendToken(socket, token)
      self._getPassword(() => {
        const password = this.password
        if (typeof password === 'string' && password !== '') this.sendPassword(socket, password)
        socket.uncork()
      })
    })
  }

  /** Sends the password in the first flight: in the upgrade (auth offload), or right behind the StartupMessage (pipelineConnect). */
  private sendPassword(socket: WebSocketSocket | TlsSocket, password: string) {
    const mode = setting(this.edgeConfig, 'pipelineConnect')
    const inBand = mode === 'password' || (mode !== false && NEON_HOST.test(this.host))
    if (socket instanceof TlsSocket) {
      if (inBand) ((this.connection as any).password(password), (this.passwordSent = true))
      return
    }
    const message = serialize.password(password)
    if (setting(this.edgeConfig, 'authOffload') !== false) socket.secret = message
    // A server that does not take the login gets the password right behind the StartupMessage, if asked to.
    if (inBand) socket.fallback = (first) => (socket.send(first), socket.send(message), (this.passwordSent = true))
  }

  /**
   * Cancels the statement running now: on the session's own WebSocket where the proxy takes it
   * there, else pg's CancelRequest on a connection of its own that carries it in the WebSocket
   * upgrade. A cancel that fails changes nothing; the query just runs on.
   */
  cancelRunning() {
    const socket = (this.connection as any).stream
    if (socket instanceof WebSocketSocket && socket.cancelsInBand) return socket.sendCancel(this.readies)
    const con = new Client(this.given).connection as any
    if (con.stream instanceof WebSocketSocket) con.stream.deferOpen = true
    con.on('error', () => {})
    const { processID, secretKey } = this as any // pg's, from BackendKeyData
    con.once('connect', () => con.cancel(processID, secretKey))
    con.connect(this.port, this.host)
  }

  _handleAuthSASL(msg: unknown) {
    // The bundle loads pg's SCRAM on first use (shims/pg/sasl.ts); SCRAM is rare with auth offload.
    Promise.resolve((sasl as { load?: () => Promise<unknown> }).load?.()).then(
      () => (pg.Client.prototype as any)._handleAuthSASL.call(this, msg),
      (err) => this.connection.emit('error', err)
    )
  }

  _handleAuthCleartextPassword(msg: unknown) {
    if (this.passwordSent) return // already on its way
    return (pg.Client.prototype as any)._handleAuthCleartextPassword.call(this, msg)
  }

  /**
   * pg's pipeline mode, wherever it is safe. On a clear line pg's own pulse sends the next query,
   * as pg without pipelining would (its errors, 'drain' and portals included); plain queries issued
   * while others are in flight go out right behind them, each with its own Sync, so an error fails
   * only its query. A query that keeps a portal open across round trips (pg-cursor, query streams,
   * COPY, `rows`) waits for a clear line and runs alone. `pipeline: false` turns query pipelining
   * off; `pipeline: true` is pg's own strict mode.
   */
  _pulseQueryQueue() {
    const self = this as any // pg's internals
    const pulse = (pg.Client.prototype as any)._pulseQueryQueue
    if (this.holding) return
    if (!this.pipelining || this.strict) return pulse.call(this)
    if (!self._sentQueryQueue.length && (self.readyForQuery === true || !self._activeQuery)) {
      const flag = self.pipeline // up while query() queues a plain query (see below)
      const writes = self.connection.stream.writes
      self.pipeline = false
      pulse.call(this)
      self.pipeline = flag
      this.stalled = Boolean(self._activeQuery) && self.connection.stream.writes === writes
    }
    // Plain queries go out right behind queries in flight; with none in flight they wait for pg's pulse.
    const inFlight = self._sentQueryQueue.length > 0 || (self._activeQuery && !this.stalled)
    if (!inFlight || (self._activeQuery && !isPlainQuery(self._activeQuery))) return // a portal query owns the line until answered
    const queue: unknown[] = self._queryQueue
    const firstAlone = queue.findIndex((q) => !isPlainQuery(q))
    const sendable = firstAlone === -1 ? queue.length : firstAlone
    if (!sendable && !self._sentQueryQueue.length) return
    // pg's pipelined pulse (which also makes the next query sent the active one), shown only the
    // queries that may go out now.
    const later = queue.splice(sendable)
    self._pulsePipelinedQueryQueue()
    queue.push(...later)
    // An aborted query sent behind others is cancelled once it is the one running.
    const cancel = self._activeQuery?.[CANCEL_WHEN_RUNNING]
    if (cancel) (self._activeQuery[CANCEL_WHEN_RUNNING] = undefined), cancel()
  }
}

/**
 * Concurrent queries are pipelined, as pg 9 supports: pg's "already executing a query" deprecation
 * does not apply, and pg checks its `pipeline` flag for it, so the flag is up while a plain query is
 * queued. A portal query, which pg refuses in pipeline mode, is queued with the flag down and the
 * queries before it set aside (so pg sees no queue), then waits its turn. (Assigned, not declared,
 * so that pg's typed overloads of `query` stay as they are.)
 */
const clientQuery = pg.Client.prototype.query as (...args: unknown[]) => unknown
Client.prototype.query = function (this: any, ...args: any[]) {
  if (IN_WORKERS && !usableHere(this)) return refuseQuery(this, crossedRequests(), args)
  const [config] = args
  const signal: AbortSignal | undefined = config?.signal
  const timeout: number | undefined = config?.query_timeout || this.queryTimeout
  if (typeof config?.submit !== 'function') {
    if (signal || timeout) return stoppableQuery(this, (query) => this.query(query), () => this.cancelRunning(), args, signal, timeout)
  } else if (timeout && !(config instanceof PgQuery)) timeSubmittable(this, config, () => this.cancelRunning(), timeout)
  if (!this.pipelining || this.strict) return clientQuery.apply(this, args)
  const portal = isPortalQuery(args[0])
  const waiting: unknown[] | undefined = portal && this._queryQueue.length ? this._queryQueue : undefined
  if (waiting) {
    this._queryQueue = []
    this.holding = true
  }
  this.pipeline = !portal
  try {
    return clientQuery.apply(this, args)
  } finally {
    this.pipeline = false
    if (waiting) {
      this._queryQueue = waiting.concat(this._queryQueue)
      this.holding = false
      this._pulseQueryQueue()
    }
  }
} as pg.Client['query']

const inTransaction = (client: pg.PoolClient) => /^[TE]$/.test(client.getTransactionStatus() ?? '')

/** Why pool.query() refuses a statement that leaves its connection inside a transaction. */
const transactionOnPool = () =>
  new Error(
    'edgepg: pool.query() left its connection in a transaction, so it was rolled back: a transaction must run on one connection. ' +
      'Run BEGIN…COMMIT on `const client = await pool.connect()`, then `client.release()` (with Drizzle: drizzle-orm/node-postgres).'
  )

/**
 * node-postgres's Pool of edgepg Clients. Stricter than pg in one way: a connection inside a
 * transaction never serves another caller. One released mid-transaction is rolled back before it
 * is reused, and pool.query() that leaves one open rejects (pg would hand the open transaction to
 * the next caller, whose writes then vanish with a later rollback).
 */
export class Pool extends pg.Pool {
  constructor(config?: PoolConfig) {
    // Workers allow six simultaneous outgoing connections per request; leave one for a fetch.
    super({ ...(IN_WORKERS && { max: 5 }), ...config, Client: Client as any })
  }

  /** The connection released last was left in a transaction (read by pool.query, below). */
  private leftOpen = false

  _release(client: pg.PoolClient, idleListener: unknown, err?: unknown) {
    const release = (pg.Pool.prototype as any)._release
    const self = client as any // pg's internals, read as pg-pool reads them
    this.leftOpen = !err && !this.ending && self._queryable && !self._ending && inTransaction(client)
    if (!this.leftOpen) return release.call(this, client, idleListener, err)
    // Until it is back in the pool nobody listens for its errors: the ROLLBACK's own callback reports them.
    const ignore = () => {}
    client.on('error', ignore)
    client.query('ROLLBACK', (rollbackErr) => {
      client.off('error', ignore)
      release.call(this, client, idleListener, rollbackErr ?? undefined)
    })
  }
}

// A Worker's Pool at module scope: a connection opened by another request cannot serve this one.
// Those left idle are dropped before anything is sent (they close from their own request), and one
// handed over by another request's release is dropped on receipt, its slot then taken by a new
// connection of this request's own: the caller sees what an empty Pool gives. While it waits for a
// slot another request frees, a timer keeps workerd from taking the wait for a hang.
// (Assigned, not declared, so that pg's typed overloads stay as they are.)
const poolConnect = pg.Pool.prototype.connect as (this: pg.Pool) => Promise<pg.PoolClient>
Pool.prototype.connect = function (this: any, callback?: (err: Error | undefined, client?: pg.PoolClient, done?: unknown) => void) {
  if (!IN_WORKERS) return (poolConnect as any).call(this, callback)
  for (const { client } of this._idle.slice()) if (!usableHere(client)) this._remove(client)
  const acquire = (): Promise<pg.PoolClient> =>
    poolConnect.call(this).then((client) => {
      if (usableHere(client)) return client
      client.release(crossedRequests())
      return acquire()
    })
  const awake = setInterval(() => {}, 1000)
  const acquired = acquire().finally(() => clearInterval(awake))
  if (!callback) return acquired
  acquired.then((client) => callback(undefined, client, client.release), (err) => callback(err))
} as pg.Pool['connect']

// With `queryViaHttp`, a query that needs no session goes over HTTP: one request, no connection.
// (Assigned, not declared, so that pg's typed overloads of `query` stay as they are.)
const poolQuery = pg.Pool.prototype.query as (...args: unknown[]) => unknown
Pool.prototype.query = function (this: any, config: any, values?: any, callback?: any) {
  const viaHttp = poolQueryViaHttp(this, config, values, callback)
  if (viaHttp) return viaHttp
  if (typeof config === 'function') return poolQuery.call(this, config) // pg-pool's own refusal
  if (typeof values === 'function') [callback, values] = [values, undefined]
  let done = callback
  // As pg-pool's own promise: an error's stack is taken anew where it reaches the caller's promise, so
  // that it leads back through the caller's awaits rather than to the socket's read.
  const result = done
    ? undefined
    : new Promise((resolve, reject) => (done = (err: unknown, res: unknown) => (err ? reject(err) : resolve(res)))).catch((err) => {
        Error.captureStackTrace(err) // (unguarded, as in pg: a runtime without it would fail in pg already)
        throw err
      })
  // pg-pool releases the connection, then calls back, in one go: _release has just said whether it was left open.
  poolQuery.call(this, config, values, (err: unknown, res: unknown) => (this.leftOpen && !err ? done(transactionOnPool()) : done(err, res)))
  return result
} as pg.Pool['query']

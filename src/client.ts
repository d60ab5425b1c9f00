import './install-buffer'
import pg from 'pg'
import { configKeys, setting, type EdgeConfig } from './config'
import { WebSocketSocket } from './socket'
import { TlsSocket } from './tls'
import { poolQueryViaHttp, type HttpPoolConfig } from './http'

// pg's own exports, as they are.
export const { types, defaults, DatabaseError, Query, escapeIdentifier, escapeLiteral } = pg

export type ClientConfig = pg.ClientConfig & EdgeConfig
export type PoolConfig = pg.PoolConfig & EdgeConfig & HttpPoolConfig

/**
 * Split a user's config into pg's part and edgepg's own keys, so pg never sees ours. Copies
 * property descriptors because pg-pool hands its clients a non-enumerable `password`.
 */
function splitConfig(input?: string | ClientConfig): { options: pg.ClientConfig; own: EdgeConfig } {
  if (typeof input === 'string') return { options: { connectionString: input }, own: {} }
  const options = Object.defineProperties({}, Object.getOwnPropertyDescriptors(input ?? {})) as ClientConfig
  const own: EdgeConfig = {}
  for (const key of configKeys) {
    if (key in options) {
      ;(own as any)[key] = options[key]
      delete options[key]
    }
  }
  return { options, own }
}

const NEON_HOST = /\.neon\.(tech|build)$/
const PgQuery = (pg as any).Query

/** A query that is answered in one go (no portal kept open), so it can share the pipeline. */
const isPlainQuery = (q: any) => q instanceof PgQuery && !q.rows

/** The transport for one connection: a WebSocket, with TLS to Postgres inside it when asked for. */
function openSocket(own: EdgeConfig, ssl: unknown): WebSocketSocket | TlsSocket {
  const socket = new WebSocketSocket(own)
  const sslOptions = typeof ssl === 'object' && ssl !== null ? (ssl as { ca?: unknown; servername?: string }) : {}
  const rootCerts = setting(own, 'rootCerts') ?? (typeof sslOptions.ca === 'string' ? sslOptions.ca : undefined)
  if (!ssl || !rootCerts) return socket
  return new TlsSocket(socket, { host: sslOptions.servername, rootCerts, pipelineTLS: setting(own, 'pipelineTLS') })
}

/** node-postgres's Client, connected over a WebSocket to edgepg-proxy. */
export class Client extends pg.Client {
  /** This client's overrides of the global `config`. */
  readonly edgeConfig: EdgeConfig
  /** Startup and password went out pipelined; Postgres has not yet said ReadyForQuery. */
  private startupPending = false
  private passwordPipelined = false
  private startupError?: Error
  /** Pipeline plain queries (pg's `pipeline: false` turns it off). */
  private readonly pipelineQueries: boolean

  constructor(config?: string | ClientConfig) {
    const { options, own } = splitConfig(config)
    // pg hands the stream factory its connection config, `ssl` (from options or sslmode) included.
    if (!options.stream) options.stream = ((conn: { ssl?: unknown }) => openSocket(own, conn.ssl)) as any
    super(options)
    this.edgeConfig = own
    this.pipelineQueries = options.pipeline !== false
    // pg must not negotiate TLS itself: TlsSocket does it inside the WebSocket, or wss:// secures
    // the channel (as with Neon's forceDisablePgSSL).
    this.ssl = false
    ;(this.connection as any).ssl = false
  }

  private get internals(): any {
    return this
  }

  /** Whether to send the password and first queries without waiting for the server. */
  private shouldPipelineConnect(): boolean {
    const mode = setting(this.edgeConfig, 'pipelineConnect')
    if (mode === false || typeof this.password !== 'string') return false
    const socket = this.connection.stream as unknown as WebSocketSocket | TlsSocket
    return mode === 'password' || socket.authOffload || NEON_HOST.test(this.host)
  }

  _connect(callback: (err?: Error, client?: Client) => void) {
    const self = this.internals
    const con = this.connection as any
    con.prependOnceListener('connect', () => {
      if (!this.shouldPipelineConnect()) return
      this.startupPending = true
      con.stream.cork() // StartupMessage, password and the first queries: one message
    })
    ;(pg.Client.prototype as any)._connect.call(this, callback)
    // After pg's own listener has written the StartupMessage.
    con.once('connect', () => {
      if (!this.startupPending) return
      this.passwordPipelined = true
      con.password(this.password)
      // Report connected now, so queries go out behind the password instead of a round trip later.
      self._connecting = false
      self._connected = true
      self.readyForQuery = false
      const cb = self._connectionCallback
      self._connectionCallback = null
      cb?.(null, this) // pool.query() writes its query right here
      this.emit('connect')
      // `await client.connect(); client.query(…)` resumes a microtask later; its query joins too.
      queueMicrotask(() => queueMicrotask(() => con.stream.uncork()))
    })
  }

  _handleAuthCleartextPassword(msg: unknown) {
    // Already sent, pipelined behind the StartupMessage.
    if (this.passwordPipelined) return
    return (pg.Client.prototype as any)._handleAuthCleartextPassword.call(this, msg)
  }

  _handleReadyForQuery(msg: unknown) {
    if (this.startupPending) {
      this.startupPending = false
      clearTimeout(this.internals.connectionTimeoutHandle)
    }
    return (pg.Client.prototype as any)._handleReadyForQuery.call(this, msg)
  }

  _handleErrorMessage(msg: Error) {
    if (this.startupPending) return this.failStartup(msg)
    return (pg.Client.prototype as any)._handleErrorMessage.call(this, msg)
  }

  _handleErrorEvent(err: Error) {
    if (this.startupPending) return this.failStartup(err)
    if (this.startupError) return // already failed and reported; the socket closing after it is no news
    return (pg.Client.prototype as any)._handleErrorEvent.call(this, err)
  }

  /**
   * The server refused a pipelined startup (wrong password, unknown database...) after connect()
   * had resolved: the queries in flight, or else the next one, reject with its error.
   */
  private failStartup(err: Error) {
    const self = this.internals
    this.startupPending = false
    this.startupError = err
    clearTimeout(self.connectionTimeoutHandle)
    self._connectionError = true // no second 'Connection terminated unexpectedly' error
    self._errorAllQueries(err)
  }

  /**
   * pg's pipeline mode, wherever it is safe: plain queries go out back to back as they are issued
   * (each with its own Sync, so an error fails only its query). A query that keeps a portal open
   * across round trips (pg-cursor, query streams, COPY, the `rows` option) waits until the line is
   * clear and runs alone, as pg would run it. `pipeline: false` turns query pipelining off;
   * `pipeline: true` is pg's own strict mode.
   */
  _pulseQueryQueue() {
    const self = this.internals
    if (this.startupError) return self._errorAllQueries(this.startupError)
    if (this.pipeline) return self._pulsePipelinedQueryQueue()
    if (self._activeQuery && !isPlainQuery(self._activeQuery)) return // it owns the line until answered
    const queue: unknown[] = self._queryQueue
    const firstAlone = this.pipelineQueries || this.startupPending ? queue.findIndex((q) => !isPlainQuery(q)) : 0
    const sendable = firstAlone === -1 ? queue.length : firstAlone
    if (sendable > 0 || self._sentQueryQueue.length > 0) {
      // pg's pipelined pulse, shown only the queries that may go out now.
      const later = queue.splice(sendable)
      self._pulsePipelinedQueryQueue()
      queue.push(...later)
      return
    }
    return (pg.Client.prototype as any)._pulseQueryQueue.call(this)
  }
}

/** node-postgres's Pool of edgepg Clients. */
export class Pool extends pg.Pool {
  constructor(config?: PoolConfig) {
    super({ ...config, Client: Client as any })
  }
}

// With `queryViaHttp`, a query that needs no session goes over HTTP: one request, no connection.
// (Assigned, not declared, so that pg's typed overloads of `query` stay as they are.)
const poolQuery = pg.Pool.prototype.query as (...args: unknown[]) => unknown
Pool.prototype.query = function (this: Pool, config: unknown, values?: unknown, callback?: unknown) {
  return poolQueryViaHttp(this, config, values, callback) ?? poolQuery.call(this, config, values, callback)
} as pg.Pool['query']

/**
 * POST /sql for edgepg-proxy: Neon's SQL-over-HTTP protocol, so `@neondatabase/serverless`'s
 * `neon()` (and what is built on it, e.g. Drizzle's neon-http) works against the proxy unchanged.
 *
 * Request: `POST /sql`, body `{"query": "...", "params": [...], "arrayMode"?: bool}` or
 * `{"queries": [{...}, ...]}` (a batch, run in one transaction). Headers:
 * - `Neon-Connection-String: postgresql://user:password@host[:port]/database` (required). The host
 *   is not trusted: it must be the proxy's upstream, an address the operator allowed, or the proxy's
 *   own host (`isAllowed`; in edgepg-proxy, proxy/upstream/allowed.ts), else 403. Query parameters (sslmode, options, application_name, …) are ignored: the proxy
 *   decides how it reaches Postgres.
 * - `Neon-Raw-Text-Output: true`: every value as the text Postgres sent (neon() always asks for
 *   this, and parses the text itself by each field's dataTypeID). Otherwise values are converted
 *   as Neon's server does: bool → true/false, int2/int4 → numbers, finite float4/float8 → numbers,
 *   json/jsonb → JSON, arrays → JSON arrays of those, everything else (int8, numeric, dates, …) text.
 * - `Neon-Array-Mode: true`: rows as arrays (neon() always asks); otherwise objects keyed by column
 *   name (a later duplicate name wins). A query's own `"arrayMode"` in the body overrides it.
 * - `Neon-Batch-Isolation-Level` (ReadUncommitted | ReadCommitted | RepeatableRead | Serializable),
 *   `Neon-Batch-Read-Only: true`, `Neon-Batch-Deferrable: true`: how a batch's transaction starts
 *   (ignored for a single query, as Neon does); echoed on a batch's response.
 * - `Authorization: Bearer <token>`: with `tokens`, a signed token the request runs by (the role it
 *   names, its claims for edgepg.claims()); else ignored unless an `authToken` check is configured.
 *
 * Response 200: `{"command", "rowCount", "rowAsArray", "fields": [{name, dataTypeID, tableID,
 * columnID, dataTypeSize, dataTypeModifier, format: "text"}], "rows"}` (command "" and rowCount null
 * where Postgres's command tag has none), or `{"results": [...]}` for a batch. Errors are JSON with
 * `message`, `code`, `detail`, `hint`, `position`, `internalPosition`, `internalQuery`, `severity`,
 * `where`, `table`, `column`, `schema`, `dataType`, `constraint`, `file`, `line`, `routine` (null
 * where absent): 400 for Postgres errors (a wrong password is 28P01, a statement timeout 57014) and
 * for bad requests, 401 refused token, 403 host or Origin not allowed (or a password over plain
 * http:// from a non-loopback client, unless allowInsecurePasswords), 405 not POST, 413 body too
 * large, 502 Postgres unreachable, 503 shutting down / no connection in time / too many requests,
 * 507 response too large (a batch that hits it commits nothing).
 *
 * Every query runs with the extended protocol (as Neon's does), so one statement per query: a
 * multi-statement string fails with 42601.
 *
 * Backends come from the proxy's one pool (proxy/pool/backends.ts), shared with WebSocket sessions: a request
 * logs in as a default pg Client would (user, database; the same StartupMessage), so a backend one
 * warmed serves the other. Postgres checks the credentials of every fresh login; a warm backend is
 * lent only to the password it was authenticated with. After the request the backend goes back idle
 * and reset (ROLLBACK if a transaction was left open, DISCARD ALL), or is closed: cancelled, broken,
 * or a custom setting made (see proxy/pool/idle-watch.ts). At most `pool.max` requests per credentials hold
 * a backend at once; the rest wait up to `pool.connectTimeoutMs`.
 *
 * A client that goes away mid-request gets its running statement cancelled (a CancelRequest on a
 * connection of its own, as libpq does) and the backend is closed, which also rolls back a batch.
 * A response over `maxResponseBytes` is cut the same way while rows are still arriving. Each
 * request runs under Postgres's `statement_timeout` (a SET sent in the same write as the statement,
 * taken back by the reset); a statement that outlives it by a second anyway (a batch that SET it to
 * 0) is cancelled by the proxy, with 57014 "canceling statement due to statement timeout
 * (edgepg-proxy: N ms)". With the pool off (for a transaction pooler such as PgBouncer in front,
 * which would carry a SET over to other clients) nothing is SET: the proxy's timer alone enforces
 * the timeout, and each request logs in on a connection of its own.
 */
import type { IncomingMessage, ServerResponse } from 'node:http'
import { DatabaseError } from 'pg-protocol'
import { formatHostPort, type HostPort } from '../upstream/address'
import { notAllowed } from '../upstream/allowed'
import { BackendPool, type PoolOptions } from '../pool/backends'
import type { Lenders } from '../pool/lenders'
import type { UpstreamTls } from '../upstream/connection'
import type { TokenLogins } from '../auth/token-login'
import type { TokenRefused } from '../auth/tokens'
import { Control, Leases, type Lease } from './lease'
import { read } from '../isolation/reader'
import { POSITION_HEADER, runRouted } from '../replicas/sql'
import type { Replicas } from '../replicas/replicas'
import { runRequest, TooLarge, type Response } from './run'
import { header, HttpError, parseFlags, parsePayload, readBody, singleHeader, type BodyBudget } from './request'
import { databaseErrorJson, errorJson, type ArrayType } from './json'
import { isLoopback, limitKey } from '../listen/client-address'
import { giveAll, localPlaces, takeAll, type PlacesOf, type Wanted } from '../cluster/places'

export { ERROR_FIELDS } from './json'

export interface SqlPoolOptions {
  /** Requests per (upstream, user, database, password) holding a backend at once; the rest wait. Default 10. */
  max?: number
  /** Longest wait for a backend (a turn, then the login) before HTTP 503. Default 30 s. */
  connectTimeoutMs?: number
}

export interface SqlOptions {
  /** The proxy's Postgres. A connection string naming it (port omitted: this port) is always allowed. */
  upstream: HostPort
  /**
   * Whether a connection string may name `named` (host lowercased, port defaulting to 5432, or to
   * the upstream's port when the host is the upstream's), in a request sent to `sentTo` (its Host
   * header). Return false (403), true (connect to `named`), or the HostPort to connect to instead
   * (e.g. with `address` pinned to a resolved IP, or the upstream). Default: only the upstream.
   */
  isAllowed?: (named: HostPort, sentTo: string | undefined) => boolean | HostPort | Promise<boolean | HostPort>
  /** Largest request body, in bytes (HTTP 413). Default 10 MiB. */
  maxBodyBytes?: number
  /** Largest response body, in bytes (HTTP 507). Default 10 MiB. */
  maxResponseBytes?: number
  /** Requests served at once (waiting for a backend included); more get HTTP 503. Default 500. */
  maxRequests?: number
  /** Requests served at once for one client address; more get HTTP 429. Default 50. */
  maxRequestsPerIp?: number
  /** Where those two limits are counted (the whole proxy's, with --workers n). Default: here. */
  places?: PlacesOf
  /** Time a client has to send its whole body, from the request's start (HTTP 408, and the connection closed). Default 10 s. */
  readTimeoutMs?: number
  /** Counts bodies while they are read, with the WebSockets' unfinished messages (HTTP 503 past it). Default: none. */
  budget?: BodyBudget
  /** Postgres statement_timeout for every statement, in ms (0: none). Default 60 s. */
  statementTimeoutMs?: number
  pool?: SqlPoolOptions
  /**
   * The pool of backends to draw from (the proxy's, shared with its WebSocket sessions); or options
   * for one of the handler's own, closed with it. Default: one of its own with default options.
   */
  backends?: BackendPool | PoolOptions
  /** Transaction pooling (the proxy's, shared with its WebSocket sessions): requests borrow `backends`' backends from these lenders. */
  lenders?: Lenders
  /** Hot standbys of the upstream (--replica): reads may run there (proxy/replicas/sql.ts). */
  replicas?: Replicas
  /** Browser Origins allowed (`*`: any); requests without Origin are always allowed. Default: none. */
  allowedOrigins?: string[]
  /** TLS from the proxy to Postgres, as for the WebSocket routes. */
  upstreamTls?: UpstreamTls
  /**
   * Accept a connection string with a password over plain http:// from a non-loopback client (403
   * otherwise), for when TLS ends in front of the proxy. Over https:// or from loopback it always is.
   */
  allowInsecurePasswords?: boolean
  /**
   * Checks `Authorization: Bearer <token>` (undefined when absent); false → HTTP 401. Without it the
   * header is accepted and ignored (neon()'s `authToken` option sends it).
   */
  authToken?: (token: string | undefined, req: IncomingMessage) => boolean | Promise<boolean>
  /**
   * Logins by signed token (proxy/auth/): a request with `Authorization: Bearer <JWT>` runs as the
   * role the token names, whatever user and password its connection string gives (HTTP 401 for a
   * token refused).
   */
  tokens?: TokenLogins
  /** The client's address (behind a trusted balancer, the one it declares); default the TCP peer's. */
  clientAddress?: (req: IncomingMessage) => string
  /**
   * application_name of the logins this handler makes. Default: none, as a default pg Client's, so
   * that WebSocket sessions and /sql share backends.
   */
  applicationName?: string
  /** Called once per request; never given passwords, queries or parameters. */
  log?: (entry: SqlLog) => void
}

export interface SqlLog {
  peer: string
  /** host:port the queries went to ("" when refused before that was known). */
  upstream: string
  status: number
  durationMs: number
  bytesIn: number
  bytesOut: number
  /** Statements in the request (1 for a single query, n for a batch; 0 when refused before parsing). */
  statements: number
  outcome: string
  /** Who ran them, where (once the connection string was read; by token, the token's role). Never a password or a token. */
  user?: string
  database?: string
}

export interface SqlStats {
  /** Backends requests hold right now. */
  connections: number
  /** Requests waiting for their turn at a backend. */
  waiting: number
  /** Requests being served. */
  requests: number
}

export interface SqlHandler {
  /** Serves one request (any method; the caller routes /sql here). Never throws. */
  handle(req: IncomingMessage, res: ServerResponse): void
  /**
   * Refuses new requests (503), lets running ones finish for up to `graceMs`, cancels the rest,
   * and closes the handler's own pool (a shared one is its owner's to close).
   */
  close(graceMs?: number): Promise<void>
  stats(): SqlStats
}

/** Headers a browser may send (preflight), in Neon's spelling. */
export const SQL_REQUEST_HEADERS = [
  'Authorization',
  'Content-Type',
  'Neon-Connection-String',
  'Neon-Raw-Text-Output',
  'Neon-Array-Mode',
  'Neon-Pool-Opt-In',
  'Neon-Batch-Isolation-Level',
  'Neon-Batch-Read-Only',
  'Neon-Batch-Deferrable',
  'Edgepg-Last-Write',
]
const ECHOED_HEADERS = ['Neon-Batch-Isolation-Level', 'Neon-Batch-Read-Only', 'Neon-Batch-Deferrable', 'Edgepg-Last-Write']

/** How long cancelled statements may take to end at shutdown. */
const CANCEL_TIMEOUT_MS = 5000

export function sqlHandler(options: SqlOptions): SqlHandler {
  const upstream = options.upstream
  const maxBody = options.maxBodyBytes ?? 10 << 20
  const limits = { maxResponse: options.maxResponseBytes ?? 10 << 20, statementTimeout: options.statementTimeoutMs ?? 60_000 }
  const maxRequests = options.maxRequests ?? 500
  const maxPerIp = options.maxRequestsPerIp ?? 50
  const readTimeoutMs = options.readTimeoutMs ?? 10_000
  /** Requests being served: in all, and by client address. */
  const places = options.places ?? localPlaces
  const requests = places('sqlRequests', maxRequests)
  const perIp = places('sqlRequestsPerIp', maxPerIp)
  const origins = new Set(options.allowedOrigins ?? [])
  const isAllowed = options.isAllowed ?? ((named: HostPort) => formatHostPort(named) === formatHostPort(upstream))
  const ownPool = !(options.backends instanceof BackendPool)
  const backends = options.backends instanceof BackendPool ? options.backends : new BackendPool(options.backends)
  const leases = new Leases({
    backends,
    lenders: options.lenders,
    upstream,
    upstreamTls: options.upstreamTls,
    perKey: options.pool?.max ?? 10,
    connectTimeoutMs: options.pool?.connectTimeoutMs ?? 30_000,
    statementTimeoutMs: limits.statementTimeout,
    applicationName: options.applicationName,
  })
  const active = new Set<Control>()
  /** Array types by database (upstream and name), for non-raw output. */
  const learnt = new Map<string, Map<number, ArrayType | null>>()
  let closing = false

  const originAllowed = (origin: string | undefined) => origin === undefined || origins.has('*') || origins.has(origin)
  const corsHeaders = (origin: string | undefined): Record<string, string> =>
    origin === undefined ? {} : { 'access-control-allow-origin': origin, vary: 'Origin', 'access-control-expose-headers': ECHOED_HEADERS.join(', ') }

  /** One request, from its headers to its response: who may ask what, of which Postgres. */
  /** `readBy`: when the body must have arrived (performance.now() time). */
  async function serve(req: IncomingMessage, ctl: Control, log: SqlLog, readBy: number): Promise<Response> {
    if (closing) throw new HttpError(503, 'edgepg-proxy is shutting down')
    const auth = header(req, 'authorization')
    const token = auth === undefined ? undefined : /^Bearer\s+(.*)$/i.exec(auth)?.[1]
    const byToken = token !== undefined && options.tokens !== undefined
    let credentials = leases.credentialsFor(singleHeader(req, 'neon-connection-string'), byToken)
    const { conn } = credentials
    if ((conn.password !== undefined || byToken) && !options.allowInsecurePasswords && !('encrypted' in req.socket) && !isLoopback(log.peer)) {
      throw new HttpError(403, `a ${byToken ? 'token' : 'password'} over plain http:// from a non-loopback client is refused: use https:// (or --allow-insecure-passwords when TLS ends in front of the proxy)`)
    }
    const flags = parseFlags(req)
    if (options.authToken && !(await options.authToken(token, req))) throw new HttpError(401, 'authorization token refused')
    const verdict = await isAllowed(conn.named, singleHeader(req, 'host'))
    if (!verdict) throw new HttpError(403, `host ${notAllowed(conn.named, upstream)}`)
    const target = verdict === true ? conn.named : verdict
    log.upstream = formatHostPort(target)
    if (byToken) {
      // (A URL naming neither user nor database: Postgres's default then, the role's name.)
      const { identity, password, database } = await options.tokens!.identify(token!, target, conn.database || undefined).catch((err: TokenRefused) => {
        throw new HttpError(err.code === '08001' ? 503 : 401, err.message, err.code)
      })
      credentials = leases.credentialsAs(conn, identity.role, password, identity.claims, database)
    }
    log.user = credentials.conn.user
    log.database = credentials.conn.database || credentials.conn.user

    const body = await readBody(req, maxBody, readBy - performance.now(), options.budget)
    log.bytesIn = body.length
    const payload = parsePayload(body)
    log.statements = payload.single ? 1 : payload.batch!.length
    if (ctl.aborted) throw new HttpError(499, 'client went away')

    const database = `${log.upstream} ${conn.database}`
    const types = learnt.get(database) ?? learnt.set(database, new Map()).get(database)!
    const run = (lease: Lease) => runRequest(lease, ctl, payload, flags, types, limits)
    const { replicas } = options
    if (!replicas || log.upstream !== formatHostPort(upstream)) return leases.with(target, credentials, ctl, run)
    const asked = { texts: (payload.batch ?? [payload.single!]).map((q) => q.query), batch: !payload.single, readOnly: flags.readOnly === true }
    return runRouted(replicas, leases, target, credentials, ctl, asked, singleHeader(req, POSITION_HEADER), options.lenders?.o.reader ?? read, run)
  }

  function handle(req: IncomingMessage, res: ServerResponse) {
    const started = performance.now()
    const origin = header(req, 'origin')
    const log: SqlLog = { peer: options.clientAddress?.(req) ?? req.socket.remoteAddress ?? '?', upstream: '', status: 0, durationMs: 0, bytesIn: 0, bytesOut: 0, statements: 0, outcome: 'ok' }
    res.on('error', () => {})
    req.on('error', () => {})
    const finish = (status: number, body: string | undefined, headers: Record<string, string> = {}, outcome?: string) => {
      log.status = status
      if (outcome) log.outcome = outcome
      if (!res.headersSent && !res.destroyed) {
        const payload = body === undefined ? undefined : Buffer.from(body)
        log.bytesOut = payload?.length ?? 0
        res.writeHead(status, {
          ...(payload && { 'content-type': 'application/json' }),
          'cache-control': 'no-store',
          ...corsHeaders(originAllowed(origin) ? origin : undefined),
          ...headers,
        })
        res.end(payload)
      }
      log.durationMs = Math.round((performance.now() - started) * 100) / 100
      options.log?.(log)
    }

    if (!originAllowed(origin)) return finish(403, errorJson(`origin ${origin} is not allowed (--allow-origin)`), {}, 'refused: origin')
    if (req.method === 'OPTIONS') {
      req.resume()
      return finish(204, undefined, {
        'access-control-allow-methods': 'POST, OPTIONS',
        'access-control-allow-headers': SQL_REQUEST_HEADERS.join(', '),
        'access-control-max-age': '86400',
      }, 'preflight')
    }
    if (req.method !== 'POST') {
      req.resume()
      return finish(405, errorJson(`${req.method} is not allowed on /sql; use POST`), { allow: 'POST, OPTIONS' }, 'refused: method')
    }

    const held: Wanted = [[requests, ''], [perIp, limitKey(log.peer)]]
    const full = takeAll(held)
    typeof full === 'number' ? admitted(full) : full.then(admitted)

    function admitted(full: number) {
      if (full >= 0) req.resume()
      if (full === 0) return finish(503, errorJson(`too many requests in progress (${maxRequests}); try again later`), {}, 'refused: too many requests')
      if (full === 1) return finish(429, errorJson(`too many requests in progress from ${limitKey(log.peer)} (${maxPerIp}); try again later`), {}, 'refused: too many requests from one address')
      const ctl = new Control()
      active.add(ctl)
      // The client went away before its answer: cancel what runs for it.
      res.on('close', () => {
        if (res.writableEnded) return
        ctl.aborted = true
        ctl.cancel()
      })
      serve(req, ctl, log, started + readTimeoutMs).then(
        (r) => finish(r.status, r.body, r.headers),
        (err: unknown) => {
          if (ctl.shutdown) return finish(503, errorJson('edgepg-proxy is shutting down'), {}, 'shutdown')
          if (ctl.aborted) return finish(499, undefined, {}, 'aborted by client')
          const [status, body, outcome, headers] = describeError(err)
          finish(status, body, headers, outcome)
          if (status === 413) req.resume() // drop the rest of the body; the connection then closes
          if (status === 408) req.socket.destroySoon() // a body that is not coming: the answer, then no more
        }
      ).finally(() => {
        active.delete(ctl)
        giveAll(held)
      })
    }
  }

  function describeError(err: unknown): [number, string, string, Record<string, string>?] {
    if (err instanceof TooLarge) return [507, errorJson(`response is too large (max is ${limits.maxResponse} bytes)`), 'response too large']
    if (err instanceof DatabaseError) return [400, databaseErrorJson(err), `postgres error ${err.code}`]
    if (err instanceof HttpError) {
      return [err.status, errorJson(err.message, err.code), `refused: ${err.message}`, err.status === 413 ? { connection: 'close' } : undefined]
    }
    const message = err instanceof Error ? err.message : String(err)
    return [502, errorJson(`Postgres connection failed: ${message}`), `upstream error: ${message}`]
  }

  return {
    handle(req, res) {
      try {
        handle(req, res)
      } catch (err) {
        if (!res.headersSent) {
          res.writeHead(500, { 'content-type': 'application/json' })
          res.end(errorJson(`edgepg-proxy internal error: ${(err as Error).message}`))
        }
      }
    },
    async close(graceMs = 0) {
      closing = true
      const deadline = Date.now() + graceMs
      while (active.size && Date.now() < deadline) await new Promise((r) => setTimeout(r, Math.min(20, deadline - Date.now())))
      for (const ctl of active) {
        ctl.aborted = ctl.shutdown = true
        ctl.cancel()
      }
      const cut = Date.now() + CANCEL_TIMEOUT_MS
      while (active.size && Date.now() < cut) await new Promise((r) => setTimeout(r, 20))
      if (ownPool) backends.close()
    },
    stats() {
      let connections = 0
      for (const ctl of active) if (ctl.lease) connections++
      return { connections, waiting: leases.waiting, requests: active.size }
    },
  }
}

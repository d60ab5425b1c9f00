/**
 * POST /sql for edgepg-proxy: Neon's SQL-over-HTTP protocol, so `@neondatabase/serverless`'s
 * `neon()` (and what is built on it, e.g. Drizzle's neon-http) works against the proxy unchanged.
 *
 * Request: `POST /sql`, body `{"query": "...", "params": [...], "arrayMode"?: bool}` or
 * `{"queries": [{...}, ...]}` (a batch, run in one transaction). Headers:
 * - `Neon-Connection-String: postgresql://user:password@host[:port]/database` (required). The host
 *   is not trusted: it must be the proxy's upstream or an address the operator allowed (`isAllowed`),
 *   else 403. Query parameters (sslmode, options, application_name, …) are ignored: the proxy
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
 * - `Authorization: Bearer <token>`: ignored unless an `authToken` check is configured.
 *
 * Response 200: `{"command", "rowCount", "rowAsArray", "fields": [{name, dataTypeID, tableID,
 * columnID, dataTypeSize, dataTypeModifier, format: "text"}], "rows"}` (command "" and rowCount null
 * where Postgres's command tag has none), or `{"results": [...]}` for a batch. Errors are JSON with
 * `message`, `code`, `detail`, `hint`, `position`, `internalPosition`, `internalQuery`, `severity`,
 * `where`, `table`, `column`, `schema`, `dataType`, `constraint`, `file`, `line`, `routine` (null
 * where absent): 400 for Postgres errors (a wrong password is 28P01, a statement timeout 57014) and
 * for bad requests, 401 refused token, 403 host or Origin not allowed (or a password over plain
 * http:// from a non-loopback client, unless allowInsecurePasswords), 405 not POST, 413 body too
 * large, 502 Postgres unreachable, 503 shutting down / no connection in time / too many pools or
 * requests,
 * 507 response too large (a batch that hits it commits nothing).
 *
 * Every query runs with the extended protocol (as Neon's does), so one statement per query: a
 * multi-statement string fails with 42601. Connections come from a pg.Pool per (upstream, user,
 * database, password) — keyed by an HMAC of the password under a per-process random key, never the
 * password itself — bounded in size, closed when idle. Postgres checks the credentials: a pool whose
 * connect failed (e.g. 28P01) holds nothing and is dropped, so a wrong password is never let through
 * on connections another request opened with the right one. A connection goes back to its pool only
 * idle and reset (`DISCARD ALL`: SET, temp tables, LISTEN, advisory locks, … do not leak into the
 * next request); one left inside a transaction, cancelled, or broken is closed instead.
 *
 * A client that goes away mid-request gets its running statement cancelled (a CancelRequest on a
 * connection of its own, as libpq does) and the connection is closed, which also rolls back a batch.
 * A response over `maxResponseBytes` is cut the same way while rows are still arriving. Each
 * statement runs under Postgres's `statement_timeout` (set per connection at startup and restored by
 * DISCARD ALL); a statement that outlives it by a second anyway (a batch that SET it to 0) is
 * cancelled by the proxy, with 57014 "canceling statement due to statement timeout (edgepg-proxy:
 * N ms)". An upstream that refuses the startup parameter (PgBouncer: "unsupported startup parameter")
 * is remembered and connected to without it; there the proxy's timer alone enforces the timeout.
 */
import type { IncomingMessage, ServerResponse } from 'node:http'
import net from 'node:net'
import tls from 'node:tls'
import { createHmac, randomBytes } from 'node:crypto'
import pg from 'pg'
import { formatHostPort, type HostPort } from './address'
import { cancelRequest } from './startup'
import type { UpstreamTls } from './session'

export interface SqlPoolOptions {
  /** Connections per (upstream, user, database, password). Default 10. */
  max?: number
  /** Close a connection idle this long. Default 30 s. */
  idleTimeoutMs?: number
  /** Distinct (upstream, user, database, password) pools at most; idle ones are dropped first. Default 100. */
  maxKeys?: number
  /** Longest wait for a connection (new or freed) before HTTP 503. Default 30 s. */
  connectTimeoutMs?: number
}

export interface SqlOptions {
  /** The proxy's Postgres. A connection string naming it (port omitted: this port) is always allowed. */
  upstream: HostPort
  /**
   * Whether a connection string may name `named` (host lowercased, port defaulting to 5432, or to
   * the upstream's port when the host is the upstream's). Return false (403), true (connect to
   * `named`), or the HostPort to connect to instead (e.g. with `address` pinned to a resolved IP,
   * or the upstream). Default: only the upstream.
   */
  isAllowed?: (named: HostPort) => boolean | HostPort | Promise<boolean | HostPort>
  /** Largest request body, in bytes (HTTP 413). Default 10 MiB. */
  maxBodyBytes?: number
  /** Largest response body, in bytes (HTTP 507). Default 10 MiB. */
  maxResponseBytes?: number
  /** Requests served at once (waiting for a connection included); more get HTTP 503. Default 500. */
  maxRequests?: number
  /** Postgres statement_timeout for every statement, in ms (0: none). Default 60 s. */
  statementTimeoutMs?: number
  pool?: SqlPoolOptions
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
  /** application_name of the proxy's connections. Default "edgepg-proxy /sql". */
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
}

export interface SqlStats {
  /** Pools (distinct upstream, user, database, password) open. */
  pools: number
  /** Connections to Postgres, in all pools. */
  connections: number
  idle: number
  /** Requests waiting for a connection. */
  waiting: number
  /** Requests being served. */
  requests: number
}

export interface SqlHandler {
  /** Serves one request (any method; the caller routes /sql here). Never throws. */
  handle(req: IncomingMessage, res: ServerResponse): void
  /**
   * Refuses new requests (503), lets running ones finish for up to `graceMs`, cancels the rest,
   * and closes every pooled connection.
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
]
const ECHOED_HEADERS = ['Neon-Batch-Isolation-Level', 'Neon-Batch-Read-Only', 'Neon-Batch-Deferrable']

const ISOLATION_LEVELS: Record<string, string> = {
  ReadUncommitted: 'READ UNCOMMITTED',
  ReadCommitted: 'READ COMMITTED',
  RepeatableRead: 'REPEATABLE READ',
  Serializable: 'SERIALIZABLE',
}

/** The DatabaseError fields an error response carries besides `message`, in Neon's order. */
export const ERROR_FIELDS = [
  'code', 'detail', 'hint', 'position', 'internalPosition', 'internalQuery', 'severity', 'where',
  'table', 'column', 'schema', 'dataType', 'constraint', 'file', 'line', 'routine',
] as const

/** Every value comes back as the text Postgres sent; rows are built here. */
const RAW_TYPES = { getTypeParser: () => (value: string) => value }
const SSL_REQUEST = Buffer.from([0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f])
const CANCEL_TIMEOUT_MS = 5000
/** How long past statement_timeout the proxy waits before cancelling a statement itself. */
const TIMEOUT_GRACE_MS = 1000

const OID = { bool: 16, int2: 21, int4: 23, float4: 700, float8: 701, json: 114, jsonb: 3802 }

const isLoopback = (address: string) => /^(127\.|::1$|::ffff:127\.)/.test(address)

class HttpError extends Error {
  constructor(readonly status: number, message: string, readonly code: string | null = null) {
    super(message)
  }
}

/** The response grew past its limit (HTTP 507). */
class TooLarge extends Error {}

interface ArrayType {
  elem: number
  delim: string
}

interface PoolEntry {
  key: string
  pool: pg.Pool
  target: HostPort
  /** Array types of this database by OID (null: not an array), for non-raw output. */
  types: Map<number, ArrayType | null>
  /** Connections requests hold (a connection being reset after its request is not counted). */
  leased: number
  /** Postgres enforces statement_timeout (set at startup); false where the upstream refused it. */
  startupTimeout: boolean
}

interface QueryData {
  query: string
  params: Array<string | null>
  arrayMode?: boolean
}

interface Flags {
  raw: boolean
  arrayMode: boolean
  isolation?: string
  readOnly: boolean
  deferrable: boolean
}

/** One request's hold on a connection: what is running, and whether the connection may be reused. */
interface Control {
  client?: pg.PoolClient
  target?: HostPort
  /** A statement is on the wire. */
  running: boolean
  /** The connection must be closed, not reused (cancelled, broken, or the client left). */
  tainted: boolean
  aborted: boolean
  /** The proxy's own statement timer fired. */
  timedOut: boolean
  /** Aborted by close(): answered 503. */
  shutdown: boolean
  tooLarge: boolean
  cancel(): void
}

export function sqlHandler(options: SqlOptions): SqlHandler {
  const upstream = options.upstream
  const maxBody = options.maxBodyBytes ?? 10 << 20
  const maxResponse = options.maxResponseBytes ?? 10 << 20
  const statementTimeout = options.statementTimeoutMs ?? 60_000
  const maxRequests = options.maxRequests ?? 500
  const poolMax = options.pool?.max ?? 10
  const idleTimeout = options.pool?.idleTimeoutMs ?? 30_000
  const maxKeys = options.pool?.maxKeys ?? 100
  const connectTimeout = options.pool?.connectTimeoutMs ?? 30_000
  const origins = new Set(options.allowedOrigins ?? [])
  const applicationName = options.applicationName ?? 'edgepg-proxy /sql'
  const isAllowed = options.isAllowed ?? ((named: HostPort) => formatHostPort(named) === formatHostPort(upstream))
  const secret = randomBytes(32)
  const pools = new Map<string, PoolEntry>()
  const active = new Set<Control>()
  /** Upstreams that refused statement_timeout as a startup parameter (PgBouncer does). */
  const noStartupTimeout = new Set<string>()
  const upstreamKey = (t: HostPort) => `${formatHostPort(t)}@${t.address ?? ''}`
  let closing = false

  const originAllowed = (origin: string | undefined) => origin === undefined || origins.has('*') || origins.has(origin)
  const corsHeaders = (origin: string | undefined): Record<string, string> =>
    origin === undefined ? {} : { 'access-control-allow-origin': origin, vary: 'Origin', 'access-control-expose-headers': ECHOED_HEADERS.join(', ') }

  // ── pools ───────────────────────────────────────────────────────────────────────────────────

  function drop(entry: PoolEntry) {
    if (pools.get(entry.key) === entry) pools.delete(entry.key)
    entry.pool.end().catch(() => {})
  }
  const unused = (entry: PoolEntry) => entry.pool.totalCount === 0 && entry.pool.waitingCount === 0

  function poolFor(target: HostPort, user: string, database: string, password: string | undefined): PoolEntry {
    const key = JSON.stringify([
      formatHostPort(target),
      target.address ?? '',
      user,
      database,
      password === undefined ? null : createHmac('sha256', secret).update(password).digest('base64'),
    ])
    const known = pools.get(key)
    if (known && !(known.pool as any).ending) {
      pools.delete(key) // (re)insert: the map's order is least recently used first
      pools.set(key, known)
      return known
    }
    if (known) pools.delete(key)
    if (pools.size >= maxKeys) {
      // The least recently used pool no request is using makes room.
      const idle = [...pools.values()].find((e) => e.leased === 0 && e.pool.waitingCount === 0)
      if (!idle) throw new HttpError(503, `too many distinct connection credentials in use (${maxKeys}); try again later`)
      drop(idle)
    }
    const named = target.address !== undefined && !net.isIP(target.host)
    const startupTimeout = statementTimeout > 0 && !noStartupTimeout.has(upstreamKey(target))
    const pool = new pg.Pool({
      host: target.address ?? target.host,
      port: target.port,
      user,
      database,
      password,
      max: poolMax,
      idleTimeoutMillis: idleTimeout,
      connectionTimeoutMillis: connectTimeout,
      allowExitOnIdle: true,
      keepAlive: true,
      application_name: applicationName,
      statement_timeout: startupTimeout ? statementTimeout : undefined,
      types: RAW_TYPES,
      ssl: options.upstreamTls && options.upstreamTls.mode !== 'disable' ? pgSsl(options.upstreamTls, named ? target.host : undefined) : false,
    } as pg.PoolConfig)
    const entry: PoolEntry = { key, pool, target, types: new Map(), leased: 0, startupTimeout }
    // An idle connection that breaks (backend terminated, network) is removed by the pool itself.
    pool.on('error', () => {})
    pool.on('remove', () => {
      if (unused(entry)) drop(entry)
    })
    pools.set(key, entry)
    return entry
  }

  // ── cancelling ──────────────────────────────────────────────────────────────────────────────

  function newControl(): Control {
    const ctl: Control = {
      running: false,
      tainted: false,
      aborted: false,
      timedOut: false,
      shutdown: false,
      tooLarge: false,
      cancel() {
        // Only a statement on the wire needs Postgres's help; between statements the request
        // itself notices (it checks `aborted` before each) and stops.
        const client = ctl.client as any
        if (!ctl.running || ctl.tainted || !client || !ctl.target) return
        ctl.tainted = true
        if (typeof client.processID === 'number' && typeof client.secretKey === 'number') {
          sendCancel(ctl.target, options.upstreamTls, client.processID, client.secretKey)
        }
      },
    }
    return ctl
  }

  // ── running statements ──────────────────────────────────────────────────────────────────────

  /** Runs one statement; resolves with its result as JSON text. */
  async function runStatement(entry: PoolEntry, ctl: Control, data: QueryData, flags: Flags, budget: { used: number }): Promise<string> {
    const client = ctl.client!
    const arrayMode = data.arrayMode ?? flags.arrayMode
    const rawRows: unknown[][] = []
    const jsonRows: string[] = []
    let keys: string[] | undefined
    const charge = (bytes: number) => {
      budget.used += bytes
      if (budget.used > maxResponse && !ctl.tooLarge) {
        ctl.tooLarge = true
        ctl.cancel()
      }
    }
    const onRow = (row: Array<string | null>, result: pg.QueryResult) => {
      if (ctl.tooLarge || ctl.aborted) return
      if (!flags.raw) {
        rawRows.push(row)
        let n = row.length + 2
        for (const v of row) if (v !== null) n += v.length
        return charge(n)
      }
      let json: string
      if (arrayMode) json = JSON.stringify(row)
      else {
        keys ??= result.fields.map((f) => JSON.stringify(f.name) + ':')
        json = '{' + row.map((v, i) => keys![i] + JSON.stringify(v)).join(',') + '}'
      }
      jsonRows.push(json)
      charge(Buffer.byteLength(json) + 1)
    }

    ctl.running = true
    // Postgres's statement_timeout should fire first; this one is for a statement that lifted it
    // (SET in a batch), or for an upstream that refused it at startup, where it is the only one.
    const timer = statementTimeout > 0
      ? setTimeout(() => {
          ctl.timedOut = true
          ctl.cancel()
        }, statementTimeout + (entry.startupTimeout ? TIMEOUT_GRACE_MS : 0))
      : undefined
    let result: pg.QueryResult
    try {
      result = await new Promise<pg.QueryResult>((resolve, reject) => {
        const query = new pg.Query({ text: data.query, values: data.params, rowMode: 'array', types: RAW_TYPES, queryMode: 'extended' } as any)
        query.on('row', onRow as any)
        query.on('end', resolve as any)
        query.on('error', reject)
        client.query(query as any)
      })
    } catch (err) {
      if (!(err instanceof pg.DatabaseError)) ctl.tainted = true // the connection broke
      if (ctl.tooLarge) throw new TooLarge()
      if (ctl.timedOut && err instanceof pg.DatabaseError && err.code === '57014') {
        err.message = `canceling statement due to statement timeout (edgepg-proxy: ${statementTimeout} ms)`
      }
      throw err
    } finally {
      ctl.running = false
      clearTimeout(timer)
    }
    if (ctl.tooLarge) throw new TooLarge()

    const fields = result.fields.map((f) => ({
      name: f.name,
      dataTypeID: f.dataTypeID,
      tableID: f.tableID,
      columnID: f.columnID,
      dataTypeSize: f.dataTypeSize,
      dataTypeModifier: f.dataTypeModifier,
      format: 'text',
    }))
    if (!flags.raw && rawRows.length) {
      await learnTypes(entry, client, fields.map((f) => f.dataTypeID))
      const oids = fields.map((f) => f.dataTypeID)
      keys = fields.map((f) => JSON.stringify(f.name) + ':')
      budget.used -= rawRows.reduce((n, row) => n + row.length + 2 + row.reduce((m: number, v) => m + (v === null ? 0 : (v as string).length), 0), 0)
      for (const row of rawRows) {
        const values = row.map((v, i) => (v === null ? 'null' : textToJson(v as string, oids[i], entry.types)))
        const json = arrayMode ? '[' + values.join(',') + ']' : '{' + values.map((v, i) => keys![i] + v).join(',') + '}'
        jsonRows.push(json)
        budget.used += Buffer.byteLength(json) + 1
      }
      if (budget.used > maxResponse) throw new TooLarge()
    }
    const head = `{"command":${JSON.stringify(result.command ?? '')},"rowCount":${result.rowCount ?? 'null'},"rowAsArray":${arrayMode},"fields":${JSON.stringify(fields)},"rows":[`
    charge(head.length + 2)
    if (ctl.tooLarge) throw new TooLarge()
    return head + jsonRows.join(',') + ']}'
  }

  /** Which of `oids` are array types (and of what), once per pool, for non-raw output. */
  async function learnTypes(entry: PoolEntry, client: pg.PoolClient, oids: number[]) {
    const unknown = [...new Set(oids)].filter((oid) => !entry.types.has(oid) && !Object.values(OID).includes(oid))
    if (!unknown.length) return
    const { rows } = await client.query({
      text: `SELECT t.oid::int, t.typelem::int, e.typdelim::text FROM pg_type t JOIN pg_type e ON e.oid = t.typelem
             WHERE t.oid = ANY($1::oid[]) AND t.typcategory = 'A'`,
      values: [`{${unknown.join(',')}}`],
      rowMode: 'array',
      types: RAW_TYPES,
    } as any)
    for (const oid of unknown) entry.types.set(oid, null)
    for (const [oid, elem, delim] of rows as unknown as string[][]) entry.types.set(Number(oid), { elem: Number(elem), delim })
  }

  // ── one request ─────────────────────────────────────────────────────────────────────────────

  async function serve(req: IncomingMessage, res: ServerResponse, ctl: Control, log: SqlLog): Promise<{ status: number; body: string; headers?: Record<string, string> }> {
    if (closing) throw new HttpError(503, 'edgepg-proxy is shutting down')
    const conn = parseConnectionString(header(req, 'neon-connection-string'), upstream)
    if (conn.password !== undefined && !options.allowInsecurePasswords && !('encrypted' in req.socket) && !isLoopback(req.socket.remoteAddress ?? '')) {
      throw new HttpError(403, 'a password over plain http:// from a non-loopback client is refused: use https:// (or --allow-insecure-passwords when TLS ends in front of the proxy)')
    }
    const flags = parseFlags(req)
    if (options.authToken) {
      const auth = header(req, 'authorization')
      const token = auth === undefined ? undefined : /^Bearer\s+(.*)$/i.exec(auth)?.[1]
      if (!(await options.authToken(token, req))) throw new HttpError(401, 'authorization token refused')
    }
    const verdict = await isAllowed(conn.named)
    if (!verdict) throw new HttpError(403, `host ${formatHostPort(conn.named)} is not an allowed upstream`)
    const target = verdict === true ? conn.named : verdict
    log.upstream = formatHostPort(target)

    const body = await readBody(req, maxBody)
    log.bytesIn = body.length
    const payload = parsePayload(body)
    log.statements = payload.single ? 1 : payload.batch!.length
    if (ctl.aborted) throw new HttpError(499, 'client went away')

    let entry = poolFor(target, conn.user, conn.database, conn.password)
    let client: pg.PoolClient
    for (;;) {
      try {
        client = await entry.pool.connect()
        break
      } catch (err) {
        if (unused(entry)) drop(entry) // nothing in it was ever let in with these credentials
        if (entry.startupTimeout && err instanceof pg.DatabaseError && /unsupported startup parameter.*statement_timeout/.test(err.message)) {
          // PgBouncer: do without; the proxy's own timer enforces the timeout from now on.
          noStartupTimeout.add(upstreamKey(target))
          if (!unused(entry)) drop(entry)
          entry = poolFor(target, conn.user, conn.database, conn.password)
          continue
        }
        throw connectError(err, target)
      }
    }
    ctl.client = client
    ctl.target = entry.target
    entry.leased++
    try {
      if (ctl.aborted) throw new HttpError(499, 'client went away')
      const budget = { used: 0 }
      if (payload.single) {
        const json = await runStatement(entry, ctl, payload.single, flags, budget)
        if (Buffer.byteLength(json) > maxResponse) throw new TooLarge()
        return { status: 200, body: json }
      }
      // A batch: one transaction; the first error rolls it back.
      const begin = ['BEGIN']
      if (flags.isolation) begin.push('ISOLATION LEVEL', ISOLATION_LEVELS[flags.isolation])
      if (flags.readOnly) begin.push('READ ONLY')
      if (flags.deferrable) begin.push('DEFERRABLE')
      await client.query(begin.join(' '))
      try {
        const results: string[] = []
        for (const [i, data] of payload.batch!.entries()) {
          if (ctl.aborted) throw new HttpError(499, 'client went away')
          results.push(await runStatement(entry, ctl, data, flags, budget))
          if ((client as any).getTransactionStatus?.() === 'I') {
            throw new HttpError(400, `statement ${i + 1} of the batch ended its transaction; COMMIT, ROLLBACK and the like are not allowed in a batch`, '25000')
          }
        }
        const json = `{"results":[${results.join(',')}]}`
        if (Buffer.byteLength(json) > maxResponse) throw new TooLarge()
        if (ctl.aborted) throw new HttpError(499, 'client went away')
        await client.query('COMMIT')
        const headers: Record<string, string> = {}
        if (flags.isolation) headers['neon-batch-isolation-level'] = flags.isolation
        if (flags.readOnly) headers['neon-batch-read-only'] = 'true'
        if (flags.deferrable) headers['neon-batch-deferrable'] = 'true'
        return { status: 200, body: json, headers }
      } catch (err) {
        if (!ctl.tainted && (client as any).getTransactionStatus?.() !== 'I') {
          await client.query('ROLLBACK').catch(() => (ctl.tainted = true))
        }
        throw err
      }
    } finally {
      entry.leased--
      release(client, ctl)
    }
  }

  /** Returns the connection to its pool, idle and reset, or closes it. */
  function release(client: pg.PoolClient, ctl: Control) {
    ctl.client = undefined
    if (ctl.tainted || (client as any).getTransactionStatus?.() !== 'I') return client.release(true)
    client.query('DISCARD ALL').then(
      () => client.release(),
      (err: Error) => client.release(err)
    )
  }

  function handle(req: IncomingMessage, res: ServerResponse) {
    const started = performance.now()
    const origin = header(req, 'origin')
    const log: SqlLog = { peer: req.socket.remoteAddress ?? '?', upstream: '', status: 0, durationMs: 0, bytesIn: 0, bytesOut: 0, statements: 0, outcome: 'ok' }
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

    if (active.size >= maxRequests) {
      req.resume()
      return finish(503, errorJson(`too many requests in progress (${maxRequests}); try again later`), {}, 'refused: too many requests')
    }
    const ctl = newControl()
    active.add(ctl)
    // The client went away before its answer: cancel what runs for it.
    res.on('close', () => {
      if (res.writableEnded) return
      ctl.aborted = true
      ctl.cancel()
    })
    serve(req, res, ctl, log).then(
      (r) => finish(r.status, r.body, r.headers),
      (err: unknown) => {
        if (ctl.shutdown) return finish(503, errorJson('edgepg-proxy is shutting down'), {}, 'shutdown')
        if (ctl.aborted) return finish(499, undefined, {}, 'aborted by client')
        const [status, body, outcome, headers] = describeError(err)
        finish(status, body, headers, outcome)
        if (status === 413) req.resume() // drop the rest of the body; the connection then closes
      }
    ).finally(() => active.delete(ctl))
  }

  function describeError(err: unknown): [number, string, string, Record<string, string>?] {
    if (err instanceof TooLarge) return [507, errorJson(`response is too large (max is ${maxResponse} bytes)`), 'response too large']
    if (err instanceof pg.DatabaseError) return [400, databaseErrorJson(err), `postgres error ${err.code}`]
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
      await Promise.all([...pools.values()].map((entry) => entry.pool.end().catch(() => {})))
      pools.clear()
    },
    stats() {
      let connections = 0
      let idle = 0
      let waiting = 0
      for (const { pool } of pools.values()) {
        connections += pool.totalCount
        idle += pool.idleCount
        waiting += pool.waitingCount
      }
      return { pools: pools.size, connections, idle, waiting, requests: active.size }
    },
  }
}

// ── request parsing ───────────────────────────────────────────────────────────────────────────

function header(req: IncomingMessage, name: string): string | undefined {
  const v = req.headers[name]
  return Array.isArray(v) ? v.join(', ') : v
}

interface ConnInfo {
  named: HostPort
  user: string
  database: string
  password?: string
}

function parseConnectionString(text: string | undefined, upstream: HostPort): ConnInfo {
  if (!text) throw new HttpError(400, 'missing Neon-Connection-String header (postgresql://user:password@host/database)')
  const scheme = /^([a-z][a-z0-9+.-]*):/i.exec(text)?.[1]?.toLowerCase()
  if (scheme !== 'postgres' && scheme !== 'postgresql') throw new HttpError(400, 'Neon-Connection-String must be a postgresql:// URL')
  let url: URL
  try {
    // Parsed as an http URL, so the host is validated and normalised like one.
    url = new URL('http:' + text.slice(scheme.length + 1))
  } catch {
    throw new HttpError(400, 'Neon-Connection-String is not a valid URL') // (never echoed: it holds a password)
  }
  const decode = (s: string, what: string) => {
    try {
      return decodeURIComponent(s)
    } catch {
      throw new HttpError(400, `Neon-Connection-String: the ${what} is not valid percent-encoding`)
    }
  }
  const user = decode(url.username, 'user name')
  if (!user) throw new HttpError(400, 'Neon-Connection-String has no user name')
  if (!url.hostname) throw new HttpError(400, 'Neon-Connection-String has no host')
  const host = url.hostname.replace(/^\[(.*)\]$/, '$1').toLowerCase()
  const port = url.port ? Number(url.port) : host === upstream.host ? upstream.port : 5432
  const database = decode(url.pathname.replace(/^\//, ''), 'database name') || user
  return { named: { host, port }, user, database, password: url.password ? decode(url.password, 'password') : undefined }
}

function parseFlags(req: IncomingMessage): Flags {
  const isTrue = (name: string) => header(req, name)?.trim().toLowerCase() === 'true'
  const isolation = header(req, 'neon-batch-isolation-level')?.trim()
  if (isolation !== undefined && !(isolation in ISOLATION_LEVELS)) {
    throw new HttpError(400, `invalid isolation level "${isolation}": use ReadUncommitted, ReadCommitted, RepeatableRead or Serializable`)
  }
  return {
    raw: isTrue('neon-raw-text-output'),
    arrayMode: isTrue('neon-array-mode'),
    isolation,
    readOnly: isTrue('neon-batch-read-only'),
    deferrable: isTrue('neon-batch-deferrable'),
  }
}

function readBody(req: IncomingMessage, max: number): Promise<Buffer> {
  const tooLarge = () => new HttpError(413, `request body is too large (max is ${max} bytes)`)
  if (Number(req.headers['content-length']) > max) return Promise.reject(tooLarge())
  return new Promise((resolve, reject) => {
    const chunks: Buffer[] = []
    let size = 0
    const onData = (chunk: Buffer) => {
      size += chunk.length
      if (size <= max) return void chunks.push(chunk)
      req.off('data', onData)
      reject(tooLarge())
    }
    req.on('data', onData)
    req.once('end', () => resolve(Buffer.concat(chunks)))
    req.once('error', reject)
    req.once('close', () => reject(new HttpError(499, 'client went away')))
  })
}

function parsePayload(body: Buffer): { single?: QueryData; batch?: QueryData[] } {
  let json: any
  try {
    json = JSON.parse(body.toString('utf8'))
  } catch (err) {
    throw new HttpError(400, `request body is not valid JSON: ${(err as Error).message}`)
  }
  if (json !== null && typeof json === 'object' && !Array.isArray(json)) {
    if ('query' in json) return { single: parseQuery(json, 'the request') }
    if (Array.isArray(json.queries)) return { batch: json.queries.map((q: unknown, i: number) => parseQuery(q, `queries[${i}]`)) }
  }
  throw new HttpError(400, 'request body must be JSON {"query": "...", "params": [...]} or {"queries": [{"query": "...", "params": [...]}, ...]}')
}

function parseQuery(q: any, where: string): QueryData {
  if (q === null || typeof q !== 'object' || typeof q.query !== 'string') throw new HttpError(400, `${where}: "query" must be a string`)
  if (q.params !== undefined && q.params !== null && !Array.isArray(q.params)) throw new HttpError(400, `${where}: "params" must be an array`)
  if (q.arrayMode !== undefined && q.arrayMode !== null && typeof q.arrayMode !== 'boolean') throw new HttpError(400, `${where}: "arrayMode" must be true or false`)
  return { query: q.query, params: (q.params ?? []).map(toParam), arrayMode: q.arrayMode ?? undefined }
}

/** A JSON parameter as Postgres text: strings as they are, arrays as array literals, objects as JSON. */
function toParam(v: unknown): string | null {
  if (v === null || v === undefined) return null
  if (typeof v === 'string') return v
  if (typeof v === 'number' || typeof v === 'boolean') return String(v)
  if (Array.isArray(v)) return arrayLiteral(v)
  return JSON.stringify(v)
}

function arrayLiteral(items: unknown[]): string {
  const quote = (s: string) => '"' + s.replace(/[\\"]/g, '\\$&') + '"'
  const item = (v: unknown): string => {
    if (v === null || v === undefined) return 'NULL'
    if (Array.isArray(v)) return arrayLiteral(v)
    if (typeof v === 'number' || typeof v === 'boolean') return String(v)
    return quote(typeof v === 'string' ? v : JSON.stringify(v))
  }
  return '{' + items.map(item).join(',') + '}'
}

// ── responses ─────────────────────────────────────────────────────────────────────────────────

function errorJson(message: string, code: string | null = null): string {
  const out: Record<string, unknown> = { message, code }
  for (const f of ERROR_FIELDS) if (f !== 'code') out[f] = null
  return JSON.stringify(out)
}

function databaseErrorJson(err: pg.DatabaseError): string {
  const out: Record<string, unknown> = { message: err.message }
  for (const f of ERROR_FIELDS) out[f] = (err as any)[f] ?? null
  return JSON.stringify(out)
}

function connectError(err: unknown, target: HostPort): Error {
  if (err instanceof pg.DatabaseError) return err
  const e = err as NodeJS.ErrnoException
  const message = e?.message ?? String(err)
  if (e?.code && /^E[A-Z]+$/.test(e.code)) return new HttpError(502, `cannot connect to Postgres at ${formatHostPort(target)}: ${e.code}`)
  if (/timeout/i.test(message)) return new HttpError(503, `no connection to Postgres available in time: ${message}`)
  if (/password/i.test(message)) return new HttpError(400, message, '28P01')
  return new HttpError(502, `cannot connect to Postgres at ${formatHostPort(target)}: ${message}`)
}

// ── non-raw output (Neon's conversion of text values to JSON) ────────────────────────────────

const JSON_NUMBER = /^-?(0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?$/

function textToJson(text: string, oid: number, types: Map<number, ArrayType | null>): string {
  const array = types.get(oid)
  if (array) return arrayToJson(text, array, types) ?? JSON.stringify(text)
  switch (oid) {
    case OID.bool:
      return text === 't' ? 'true' : 'false'
    case OID.int2:
    case OID.int4:
      return JSON_NUMBER.test(text) ? text : JSON.stringify(text)
    case OID.float4:
    case OID.float8: {
      if (JSON_NUMBER.test(text)) return text
      const n = Number(text)
      return Number.isFinite(n) ? JSON.stringify(n) : JSON.stringify(text) // NaN, Infinity stay text
    }
    case OID.json:
    case OID.jsonb:
      return text
    default:
      return JSON.stringify(text)
  }
}

/** An array's text form as a JSON array (nested for more dimensions); undefined if it is not one. */
function arrayToJson(text: string, type: ArrayType, types: Map<number, ArrayType | null>): string | undefined {
  let s = text
  if (s.startsWith('[')) {
    const eq = s.indexOf('=') // dimension decoration: [1:2]={...}
    if (eq < 0) return undefined
    s = s.slice(eq + 1)
  }
  let at = 0
  const ws = () => {
    while (at < s.length && /\s/.test(s[at])) at++
  }
  const element = (item: string) => textToJson(item, type.elem, types)
  const list = (): string | undefined => {
    if (s[at] !== '{') return undefined
    at++
    const out: string[] = []
    ws()
    if (s[at] === '}') {
      at++
      return '[]'
    }
    for (;;) {
      ws()
      if (s[at] === '{') {
        const inner = list()
        if (inner === undefined) return undefined
        out.push(inner)
      } else if (s[at] === '"') {
        at++
        let item = ''
        for (;;) {
          if (at >= s.length) return undefined
          const c = s[at++]
          if (c === '"') break
          item += c === '\\' ? s[at++] ?? '' : c
        }
        out.push(element(item))
      } else {
        let end = at
        while (end < s.length && s[end] !== type.delim && s[end] !== '}') end++
        if (end >= s.length) return undefined
        const item = s.slice(at, end).trim()
        at = end
        out.push(item === 'NULL' ? 'null' : element(item))
      }
      ws()
      if (s[at] === type.delim) {
        at++
        continue
      }
      if (s[at] !== '}') return undefined
      at++
      return '[' + out.join(',') + ']'
    }
  }
  ws()
  const json = list()
  ws()
  return json !== undefined && at === s.length ? json : undefined
}

// ── upstream helpers ──────────────────────────────────────────────────────────────────────────

/** pg's `ssl` options for the proxy's upstream TLS setting. */
function pgSsl(t: UpstreamTls, servername?: string): tls.ConnectionOptions {
  return {
    ca: t.ca,
    rejectUnauthorized: t.mode !== 'require',
    ...(servername && { servername }),
    ...(t.mode === 'verify-ca' && { checkServerIdentity: () => undefined }),
  }
}

/**
 * Asks Postgres to cancel what backend `pid` runs: a CancelRequest on a connection of its own (TLS
 * first when the proxy's upstream connections use it), as libpq's PQcancel does. Best effort; the
 * connection is closed by the server once it has read the request, and cut after CANCEL_TIMEOUT_MS
 * whatever happens.
 */
function sendCancel(target: HostPort, upstreamTls: UpstreamTls | undefined, pid: number, key: number) {
  const secret = Buffer.alloc(4)
  secret.writeInt32BE(key | 0)
  const packet = cancelRequest({ pid, secret })
  const socket = net.connect({ host: target.address ?? target.host, port: target.port, noDelay: true })
  const timeout = setTimeout(() => socket.destroy(), CANCEL_TIMEOUT_MS).unref()
  socket.on('close', () => clearTimeout(timeout))
  socket.on('error', () => socket.destroy())
  // Written, not ended: like libpq, wait for the server to hang up. (PgBouncer drops a cancel whose
  // connection is half-closed before it has forwarded it.)
  if (!upstreamTls || upstreamTls.mode === 'disable') {
    socket.write(packet)
    return
  }
  socket.write(SSL_REQUEST)
  socket.once('data', (answer: Buffer) => {
    if (answer[0] !== 0x53) return socket.destroy() // never in clear where the connections use TLS
    const secure = tls.connect({ socket, ...pgSsl(upstreamTls, net.isIP(target.host) ? undefined : target.host) })
    secure.on('error', () => socket.destroy())
    secure.once('secureConnect', () => secure.write(packet))
    secure.on('close', () => socket.destroy())
  })
}

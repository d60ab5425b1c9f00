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
 * large, 502 Postgres unreachable, 503 shutting down / no connection in time / too many requests,
 * 507 response too large (a batch that hits it commits nothing).
 *
 * Every query runs with the extended protocol (as Neon's does), so one statement per query: a
 * multi-statement string fails with 42601.
 *
 * Backends come from the proxy's one pool (proxy/pool.ts), shared with WebSocket sessions: a request
 * logs in as a default pg Client would (user, database; the same StartupMessage), so a backend one
 * warmed serves the other. Postgres checks the credentials of every fresh login; a warm backend is
 * lent only to the password it was authenticated with. After the request the backend goes back idle
 * and reset (ROLLBACK if a transaction was left open, DISCARD ALL), or is closed: cancelled, broken,
 * or a custom setting made (see proxy/idle-watch.ts). At most `pool.max` requests per credentials hold
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
import { DatabaseError, serialize } from 'pg-protocol'
import { Parser } from 'pg-protocol/dist/parser'
import { formatHostPort, type HostPort } from './address'
import { BackendPool, type Backend, type PoolOptions } from './pool'
import { Upstream, type UpstreamTls } from './upstream'
import { runLogin, type LoginOutcome } from './login'
import { BackendKeyWatch, parseStartupPacket, UpstreamError, type BackendKey } from './startup'
import { setsCustomSetting } from './idle-watch'
import { Statements, type Field } from './statements'
import { header, HttpError, ISOLATION_LEVELS, parseConnectionString, parseFlags, parsePayload, readBody, type ConnInfo, type Flags, type QueryData } from './sql-request'
import { databaseErrorJson, errorJson, OID, textToJson, type ArrayType } from './sql-json'

export { ERROR_FIELDS } from './sql-json'

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
   * the upstream's port when the host is the upstream's). Return false (403), true (connect to
   * `named`), or the HostPort to connect to instead (e.g. with `address` pinned to a resolved IP,
   * or the upstream). Default: only the upstream.
   */
  isAllowed?: (named: HostPort) => boolean | HostPort | Promise<boolean | HostPort>
  /** Largest request body, in bytes (HTTP 413). Default 10 MiB. */
  maxBodyBytes?: number
  /** Largest response body, in bytes (HTTP 507). Default 10 MiB. */
  maxResponseBytes?: number
  /** Requests served at once (waiting for a backend included); more get HTTP 503. Default 500. */
  maxRequests?: number
  /** Postgres statement_timeout for every statement, in ms (0: none). Default 60 s. */
  statementTimeoutMs?: number
  pool?: SqlPoolOptions
  /**
   * The pool of backends to draw from (the proxy's, shared with its WebSocket sessions); or options
   * for one of the handler's own, closed with it. Default: one of its own with default options.
   */
  backends?: BackendPool | PoolOptions
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
]
const ECHOED_HEADERS = ['Neon-Batch-Isolation-Level', 'Neon-Batch-Read-Only', 'Neon-Batch-Deferrable']

/** How long cancelled statements may take to end at shutdown. */
const CANCEL_TIMEOUT_MS = 5000
/** How long past statement_timeout the proxy waits before cancelling a statement itself. */
const TIMEOUT_GRACE_MS = 1000
/** Connection strings remembered parsed, at most. */
const MAX_CREDENTIALS = 1000
/** Array types learnt, per database, at most (then forgotten and learnt again). */
const MAX_LEARNT_TYPES = 10_000

const isLoopback = (address: string) => /^(127\.|::1$|::ffff:127\.)/.test(address)

/** The response grew past its limit (HTTP 507). */
class TooLarge extends Error {}

/** A request's backend: from the pool (`backend`) or a connection of its own. */
interface Lease {
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
  /** statement_timeout was SET for this request: Postgres enforces it. */
  timeoutSet: boolean
}

/** One request's hold on a backend: what is running, and whether the backend may be reused. */
interface Control {
  lease?: Lease
  /** Waiting for its turn: give up. */
  onAbort?: () => void
  /** A statement is on the wire. */
  running: boolean
  /** The backend must be closed, not reused (cancelled, broken, or the client left). */
  tainted: boolean
  aborted: boolean
  /** The proxy's own statement timer fired. */
  timedOut: boolean
  /** Aborted by close(): answered 503. */
  shutdown: boolean
  tooLarge: boolean
  cancel(): void
}

interface Credentials {
  conn: ConnInfo
  startup: Buffer
  /** Pool keys by upstream. */
  keys: Map<string, string>
}

/** Requests per credentials key holding a backend, and those waiting for their turn. */
interface Turns {
  held: number
  waiting: Array<() => void>
}

export function sqlHandler(options: SqlOptions): SqlHandler {
  const upstream = options.upstream
  const maxBody = options.maxBodyBytes ?? 10 << 20
  const maxResponse = options.maxResponseBytes ?? 10 << 20
  const statementTimeout = options.statementTimeoutMs ?? 60_000
  const maxRequests = options.maxRequests ?? 500
  const perKey = options.pool?.max ?? 10
  const connectTimeout = options.pool?.connectTimeoutMs ?? 30_000
  const origins = new Set(options.allowedOrigins ?? [])
  const isAllowed = options.isAllowed ?? ((named: HostPort) => formatHostPort(named) === formatHostPort(upstream))
  const ownPool = !(options.backends instanceof BackendPool)
  const backends = options.backends instanceof BackendPool ? options.backends : new BackendPool(options.backends)
  const turns = new Map<string, Turns>()
  const credentials = new Map<string, Credentials>()
  const active = new Set<Control>()
  /** Array types by database (upstream and name), for non-raw output. */
  const learnt = new Map<string, Map<number, ArrayType | null>>()
  let closing = false

  const originAllowed = (origin: string | undefined) => origin === undefined || origins.has('*') || origins.has(origin)
  const corsHeaders = (origin: string | undefined): Record<string, string> =>
    origin === undefined ? {} : { 'access-control-allow-origin': origin, vary: 'Origin', 'access-control-expose-headers': ECHOED_HEADERS.join(', ') }

  // ── taking a backend ────────────────────────────────────────────────────────────────────────

  /**
   * A connection string, parsed once, with the StartupMessage a default pg Client sends for it (so
   * WebSocket sessions' logins find these backends) and its pool keys by upstream: most requests
   * repeat the same few. (Held in memory, as the requests themselves are.)
   */
  function credentialsFor(text: string | undefined): Credentials {
    const known = text === undefined ? undefined : credentials.get(text)
    if (known) return known
    const conn = parseConnectionString(text, upstream)
    const startup = serialize.startup({ user: conn.user, database: conn.database, ...(options.applicationName && { application_name: options.applicationName }) })
    if (credentials.size >= MAX_CREDENTIALS) credentials.delete(credentials.keys().next().value!)
    const parsed = { conn, startup, keys: new Map<string, string>() }
    credentials.set(text!, parsed)
    return parsed
  }

  /** Waits for one of the `perKey` turns at a backend for `key` (503 after connectTimeout). */
  function waitTurn(key: string, ctl: Control): Promise<void> {
    const t = turns.get(key) ?? { held: 0, waiting: [] }
    turns.set(key, t)
    if (t.held < perKey) {
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
      const timer = setTimeout(() => leave(new HttpError(503, `no connection to Postgres available in time (waited ${connectTimeout} ms)`)), connectTimeout)
      ctl.onAbort = () => leave(new HttpError(499, 'client went away'))
      t.waiting.push(turn)
    })
  }

  /** The turn passes to the next request waiting, if any. */
  function endTurn(key: string) {
    const t = turns.get(key)!
    const next = t.waiting.shift()
    if (next) return next()
    if (--t.held === 0) turns.delete(key)
  }

  /** A logged-in backend for the request's credentials: a warm one, else a fresh login (kept by the pool when it has room). */
  async function lease(target: HostPort, conn: ConnInfo, key: string, startup: Buffer): Promise<Lease> {
    let fresh: Upstream | undefined
    let late = false
    const timer = setTimeout(() => ((late = true), fresh?.close()), connectTimeout)
    const login = async () => {
      fresh = new Upstream(target, options.upstreamTls)
      const io = { upstream: fresh.queue, toUpstream: (b: Buffer) => void fresh!.write(b), passwordsAllowed: true, offload: true, secureUpstream: () => fresh!.secure() }
      const first = parseStartupPacket(startup)
      return { upstream: fresh, outcome: await runLogin(io, { bytes: startup.length, first, password: conn.password, rest: Buffer.alloc(0) }) }
    }
    try {
      const { upstream, backend, outcome, warm } = await backends.open(backends.enabled ? key : undefined, login, false)
      if (outcome.kind !== 'ready') {
        upstream.close()
        throw loginRefusal(outcome, conn.user)
      }
      const timeoutSet = backends.enabled && statementTimeout > 0
      return { upstream, backend, key: backend?.key ?? keyIn(outcome.answer), statements: new Statements(upstream), unpinged: !!warm, customSetting: false, timeoutSet }
    } catch (err) {
      if (late) throw new HttpError(503, `no connection to Postgres available in time (no login within ${connectTimeout} ms)`)
      if (err instanceof DatabaseError || err instanceof HttpError) throw err
      const failure = fresh?.error?.code ?? (err as Error).message
      throw new HttpError(502, `cannot connect to Postgres at ${formatHostPort(target)}: ${failure}`)
    } finally {
      clearTimeout(timer)
    }
  }

  /**
   * The backend goes back to the pool, idle and reset (by the reset sent behind the last statement,
   * or else by the pool), or is closed.
   */
  function release(lease: Lease, ctl: Control) {
    ctl.lease = undefined
    const { statements, backend, reset } = lease
    const clean = !ctl.tainted && !statements.broken
    const ending = () => ({ pending: 0, status: statements.status.charCodeAt(0), reusable: !lease.customSetting })
    if (!backend || !clean || !reset) {
      statements.detach()
      if (!backend) return lease.upstream.close(clean ? undefined : lease.key)
      return backends.giveBack(backend, clean ? ending() : undefined)
    }
    if (statements.status === 'I') return backends.giveBack(backend, ending(), reset.finally(() => statements.detach()))
    // A transaction left open: the reset sent fails; the pool's own (ROLLBACK first) follows it.
    reset.then(() => {
      statements.detach()
      backends.giveBack(backend, ending())
    })
  }

  function newControl(): Control {
    const ctl: Control = {
      running: false,
      tainted: false,
      aborted: false,
      timedOut: false,
      shutdown: false,
      tooLarge: false,
      cancel() {
        ctl.onAbort?.()
        // Only a statement on the wire needs Postgres's help; between statements the request
        // itself notices (it checks `aborted` before each) and stops.
        const lease = ctl.lease
        if (!ctl.running || ctl.tainted || !lease) return
        ctl.tainted = true
        if (lease.key) lease.upstream.cancel(lease.key)
      },
    }
    return ctl
  }

  // ── running statements ──────────────────────────────────────────────────────────────────────

  /** Runs one statement; resolves with its result as JSON text. */
  async function runStatement(lease: Lease, types: Map<number, ArrayType | null>, ctl: Control, data: QueryData, flags: Flags, budget: { used: number }): Promise<string> {
    const arrayMode = data.arrayMode ?? flags.arrayMode
    const rawRows: Array<Array<string | null>> = []
    const jsonRows: string[] = []
    let keys: string[] | undefined
    const charge = (bytes: number) => {
      budget.used += bytes
      if (budget.used > maxResponse && !ctl.tooLarge) {
        ctl.tooLarge = true
        ctl.cancel()
      }
    }
    const onRow = (row: Array<string | null>, fields: Field[]) => {
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
        keys ??= fields.map((f) => JSON.stringify(f.name) + ':')
        json = '{' + row.map((v, i) => keys![i] + JSON.stringify(v)).join(',') + '}'
      }
      jsonRows.push(json)
      charge(Buffer.byteLength(json) + 1)
    }

    if (setsCustomSetting(data.query)) lease.customSetting = true
    ctl.running = true
    // Postgres's statement_timeout should fire first; this one is for a statement that lifted it
    // (SET in a batch), or where nothing was SET, where it is the only one.
    const timer = statementTimeout > 0
      ? setTimeout(() => {
          ctl.timedOut = true
          ctl.cancel()
        }, statementTimeout + (lease.timeoutSet ? TIMEOUT_GRACE_MS : 0))
      : undefined
    let result
    try {
      result = await lease.statements.execute(data.query, data.params, onRow)
    } catch (err) {
      if (!(err instanceof DatabaseError)) ctl.tainted = true // the connection broke
      if (ctl.tooLarge) throw new TooLarge()
      if (ctl.timedOut && err instanceof DatabaseError && err.code === '57014') {
        err.message = `canceling statement due to statement timeout (edgepg-proxy: ${statementTimeout} ms)`
      }
      throw err
    } finally {
      ctl.running = false
      clearTimeout(timer)
    }
    if (ctl.tooLarge) throw new TooLarge()

    const fields = result.fields.map((f) => ({ ...f, format: 'text' }))
    if (!flags.raw && rawRows.length) {
      await learnTypes(lease, types, fields.map((f) => f.dataTypeID))
      const oids = fields.map((f) => f.dataTypeID)
      keys = fields.map((f) => JSON.stringify(f.name) + ':')
      budget.used -= rawRows.reduce((n, row) => n + row.length + 2 + row.reduce((m: number, v) => m + (v === null ? 0 : v.length), 0), 0)
      for (const row of rawRows) {
        const values = row.map((v, i) => (v === null ? 'null' : textToJson(v, oids[i], types)))
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

  /** Which of `oids` are array types (and of what), once per database, for non-raw output. */
  async function learnTypes(lease: Lease, types: Map<number, ArrayType | null>, oids: number[]) {
    const unknown = [...new Set(oids)].filter((oid) => !types.has(oid) && !Object.values(OID).includes(oid))
    if (!unknown.length) return
    const rows: Array<Array<string | null>> = []
    await lease.statements.execute(
      `SELECT t.oid::int, t.typelem::int, e.typdelim::text FROM pg_type t JOIN pg_type e ON e.oid = t.typelem
       WHERE t.oid = ANY($1::oid[]) AND t.typcategory = 'A'`,
      [`{${unknown.join(',')}}`],
      (row) => void rows.push(row)
    )
    if (types.size + unknown.length > MAX_LEARNT_TYPES) types.clear()
    for (const oid of unknown) types.set(oid, null)
    for (const [oid, elem, delim] of rows) types.set(Number(oid), { elem: Number(elem), delim: delim! })
  }

  // ── one request ─────────────────────────────────────────────────────────────────────────────

  async function serve(req: IncomingMessage, ctl: Control, log: SqlLog): Promise<{ status: number; body: string; headers?: Record<string, string> }> {
    if (closing) throw new HttpError(503, 'edgepg-proxy is shutting down')
    const { conn, startup, keys } = credentialsFor(header(req, 'neon-connection-string'))
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

    const upstreamName = formatHostPort(target)
    const key = keys.get(upstreamName) ?? keys.set(upstreamName, backends.key(upstreamName, undefined, startup, conn.password)).get(upstreamName)!
    await waitTurn(key, ctl)
    try {
      for (;;) {
        const lease = (ctl.lease = await acquire())
        try {
          return await run(lease)
        } catch (err) {
          // A warm backend that died while idle answered nothing, not even the ping: nothing ran; another backend will do.
          if (!(lease.unpinged && lease.statements.broken && lease.statements.answered === 0 && !ctl.aborted)) throw err
          ctl.tainted = false
        } finally {
          release(lease, ctl)
        }
      }
    } finally {
      endTurn(key)
    }

    async function acquire() {
      const l = await lease(target, conn, key, startup)
      if (ctl.aborted) {
        release(l, ctl)
        throw new HttpError(499, 'client went away')
      }
      return l
    }

    async function run(lease: Lease) {
      const { statements } = lease
      const database = `${formatHostPort(target)} ${conn.database}`
      const types = learnt.get(database) ?? new Map()
      learnt.set(database, types)
      const budget = { used: 0 }
      // In one write with the first statement: the timeout (taken back by the reset), which is also
      // the ping a warm backend needs (one that died while idle never answers it: see serve()).
      if (lease.timeoutSet) statements.query(`SET statement_timeout = ${statementTimeout}`).catch(() => {})
      else if (lease.unpinged) statements.sync().catch(() => {})
      /** The reset, in the same write as the last statement. */
      const resetBehind = () => (lease.reset = statements.query('DISCARD ALL').then(() => statements.status === 'I', () => false))
      if (payload.single) {
        const running = runStatement(lease, types, ctl, payload.single, flags, budget)
        resetBehind()
        const json = await running
        if (Buffer.byteLength(json) > maxResponse) throw new TooLarge()
        return { status: 200, body: json }
      }
      // A batch: one transaction; the first error rolls it back.
      const begin = ['BEGIN']
      if (flags.isolation) begin.push('ISOLATION LEVEL', ISOLATION_LEVELS[flags.isolation])
      if (flags.readOnly) begin.push('READ ONLY')
      if (flags.deferrable) begin.push('DEFERRABLE')
      await statements.query(begin.join(' '))
      try {
        const results: string[] = []
        for (const [i, data] of payload.batch!.entries()) {
          if (ctl.aborted) throw new HttpError(499, 'client went away')
          results.push(await runStatement(lease, types, ctl, data, flags, budget))
          if (statements.status === 'I') {
            throw new HttpError(400, `statement ${i + 1} of the batch ended its transaction; COMMIT, ROLLBACK and the like are not allowed in a batch`, '25000')
          }
        }
        const json = `{"results":[${results.join(',')}]}`
        if (Buffer.byteLength(json) > maxResponse) throw new TooLarge()
        if (ctl.aborted) throw new HttpError(499, 'client went away')
        const commit = statements.query('COMMIT')
        resetBehind()
        await commit
        const headers: Record<string, string> = {}
        if (flags.isolation) headers['neon-batch-isolation-level'] = flags.isolation
        if (flags.readOnly) headers['neon-batch-read-only'] = 'true'
        if (flags.deferrable) headers['neon-batch-deferrable'] = 'true'
        return { status: 200, body: json, headers }
      } catch (err) {
        if (!ctl.tainted && statements.status !== 'I') await statements.query('ROLLBACK').catch(() => (ctl.tainted = true))
        throw err
      }
    }
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
    serve(req, ctl, log).then(
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
      let waiting = 0
      for (const ctl of active) if (ctl.lease) connections++
      for (const t of turns.values()) waiting += t.waiting.length
      return { connections, waiting, requests: active.size }
    },
  }
}

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
  const watch = new BackendKeyWatch()
  watch.feed(answer)
  return watch.key
}

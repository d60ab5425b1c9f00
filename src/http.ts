/**
 * SQL over HTTP: each query (or non-interactive transaction) is one `fetch` to `POST /sql`, in
 * Neon's HTTP protocol, which edgepg-proxy serves next to its WebSocket routes. No connection to
 * open, no session: one round trip per query on a warm (keep-alive) connection.
 *
 *   import { httpSql } from 'edgepg'
 *   const sql = httpSql(process.env.DATABASE_URL)
 *   const rows = await sql`SELECT * FROM users WHERE id = ${id}`            // [{ id: 1, ... }]
 *   const where = sql`WHERE id = ${id}`                                       // fragments compose
 *   const [user] = await sql<User>`SELECT * FROM users ${where}`             // typed rows
 *   await sql.query('SELECT * FROM users WHERE id = $1', [id], { fullResults: true })
 *   await sql`SELECT * FROM ${sql.unsafe(trustedTableName)}`
 *   const [a, b] = await sql.transaction([sql`UPDATE ...`, sql`SELECT ...`], { isolationLevel: 'Serializable' })
 *
 * Results are parsed by type OID with pg's parsers (`pg-types`, so `types.setTypeParser` applies)
 * into pg's own Result; parameters are serialised as pg serialises them. This module imports no
 * part of pg's Client, so an app that uses only `httpSql` bundles small.
 */
import type { FieldDef, QueryResult } from 'pg'
import { DatabaseError, Field } from 'pg-protocol/dist/messages.js'
// @ts-ignore: pg's internal modules ship no type declarations
import PgResult from 'pg/lib/result.js'
// @ts-ignore: (the object pg exports as `defaults`: honours `defaults.parseInputDatesAsUTC`)
import pgDefaults from 'pg/lib/defaults.js'
import { config as edgeConfig, defaultEndpointHint, sqlEndpoint, type EdgeConfig } from './config'

// ── types ───────────────────────────────────────────────────────────────────────────────────

/** Type parsers by OID, as pg takes them (`pg.types`, or your own `{ getTypeParser }`). */
export interface HttpTypes {
  getTypeParser(oid: number, format?: any): (value: any) => any
}

/** A pg Result: `command`, `rowCount`, `oid`, `rows`, `fields` (pg `Field`s) and `rowAsArray`. */
export interface HttpQueryResult<R = Record<string, any>> extends QueryResult<any> {
  rows: R[]
  fields: FieldDef[]
  rowAsArray: boolean
}

/**
 * Options of one request; accepted by `httpSql()`, `sql.query()` and `sql.transaction()`. The type
 * parameters are the literal `arrayMode` / `fullResults` (declare `HttpSqlOptions<true>` for arrays).
 */
export interface HttpQueryOptions<A extends boolean = false, F extends boolean = false> {
  /** Rows as arrays (pg's `rowMode: 'array'`) instead of objects. Default false. */
  arrayMode?: A
  /** Resolve to pg's full Result (`rows`, `fields`, `rowCount`, `command`...) instead of the rows. Default false. */
  fullResults?: F
  /** Type parsers; default pg's global ones (`types.setTypeParser` applies). */
  types?: HttpTypes
  /** Merged into the `fetch` options, e.g. `{ signal: AbortSignal.timeout(5000) }`. Per request, not per query of a transaction. */
  fetchOptions?: RequestInit
  /** Sent as `Authorization: Bearer <token>`; a function is called (and awaited) for every request. */
  authToken?: string | (() => string | Promise<string>)
}

export type IsolationLevel = 'ReadUncommitted' | 'ReadCommitted' | 'RepeatableRead' | 'Serializable'

/** `sql.transaction()` options: those of a query, plus the transaction's mode. */
export interface HttpTransactionOptions<A extends boolean = false, F extends boolean = false> extends HttpQueryOptions<A, F> {
  isolationLevel?: IsolationLevel
  readOnly?: boolean
  /** Takes effect with `readOnly` and `isolationLevel: 'Serializable'`, as in Postgres. */
  deferrable?: boolean
}

/** Where and how to send requests (`httpSql` options, and the Pool's `queryViaHttp` object). */
export interface HttpTransportOptions {
  /**
   * The URL queries are POSTed to, or a function of the Postgres host and port returning it.
   * Default for `httpSql`: `https://<host>/sql` (the connection string's host). Default for a
   * Pool's `queryViaHttp`: the Pool's WebSocket proxy address with `ws(s)://…/v2` turned into
   * `http(s)://…/sql` (edgepg-proxy serves both).
   */
  fetchEndpoint?: string | ((host: string, port: number, options?: { jwtAuth?: boolean }) => string)
  /** The `fetch` to use; default `globalThis.fetch`. */
  fetch?: (input: string, init: RequestInit) => Promise<Response>
  fetchOptions?: RequestInit
  authToken?: string | (() => string | Promise<string>)
}

/** `httpSql()` options: connection parameters (overriding the connection string's), transport and defaults. */
export interface HttpSqlOptions<A extends boolean = false, F extends boolean = false> extends HttpTransactionOptions<A, F>, HttpTransportOptions {
  connectionString?: string
  user?: string
  password?: string | (() => string | Promise<string>)
  host?: string
  port?: number | string
  database?: string
}

type AnyOptions = HttpQueryOptions<boolean, boolean>
type Full<F, D> = F extends boolean ? F : D
type Out<T, F> = F extends true ? HttpQueryResult<T> : T[]
type DefaultRow<A> = A extends true ? any[] : Record<string, any>

/** One `sql.query()` call signature for given literal `arrayMode` / `fullResults` options (undefined: not given). */
type QueryCall<OA, OF, A, F> = <T = DefaultRow<Full<OA, A>>>(
  text: string,
  params: readonly unknown[] | undefined,
  opts: AnyOptions & (OA extends boolean ? { arrayMode: OA } : { arrayMode?: undefined }) & (OF extends boolean ? { fullResults: OF } : { fullResults?: undefined })
) => HttpQuery<Out<T, Full<OF, F>>>

/** `sql.query(text, params, opts)`: the result type follows literal `arrayMode` / `fullResults` options. */
export type HttpQueryFunction<A extends boolean, F extends boolean> = (<T = DefaultRow<A>>(text: string, params?: readonly unknown[]) => HttpQuery<Out<T, F>>) &
  QueryCall<true, true, A, F> & QueryCall<true, false, A, F> & QueryCall<true, undefined, A, F> &
  QueryCall<false, true, A, F> & QueryCall<false, false, A, F> & QueryCall<false, undefined, A, F> &
  QueryCall<undefined, true, A, F> & QueryCall<undefined, false, A, F> & QueryCall<undefined, undefined, A, F> &
  ((text: string, params?: readonly unknown[], opts?: AnyOptions) => HttpQuery<any>)

type Results<Q extends readonly unknown[]> = { -readonly [K in keyof Q]: Awaited<Q[K]> }

/** What `httpSql()` returns: a tagged template that runs SQL over HTTP, with `query`, `unsafe` and `transaction`. */
export interface HttpSql<A extends boolean = false, F extends boolean = false> {
  /**
   * sql`SELECT * FROM t WHERE id = ${id}`: every `${value}` becomes a parameter ($1, $2, ...), never
   * SQL text; a nested sql`...` fragment (or `sql.unsafe()`) is inlined, its parameters renumbered.
   * Runs when awaited; `T` types the rows.
   */
  <T = DefaultRow<A>>(strings: TemplateStringsArray, ...values: unknown[]): HttpQuery<Out<T, F>>
  /** A query with $1, $2... placeholders and its parameters, and per-query options. */
  query: HttpQueryFunction<A, F>
  /** Trusted raw SQL, as is: awaitable, or interpolated into a sql`...` template verbatim. Never pass user input. */
  unsafe<T = DefaultRow<A>>(rawSql: string): HttpQuery<Out<T, F>>
  /**
   * Runs the queries in one request, in one transaction: all of them commit, or none. Resolves to
   * one result per query. A query's own `sql.query()` options win over `opts`, which win over the
   * defaults of the httpSql that made the query. `fetchOptions` apply to the request as a whole.
   */
  transaction<const Q extends readonly HttpQuery<unknown>[]>(queries: Q | ((sql: HttpSql<A, F>) => Q), opts?: Omit<HttpTransactionOptions, 'arrayMode' | 'fullResults'> & { arrayMode?: undefined; fullResults?: undefined }): Promise<Results<Q>>
  transaction(queries: readonly HttpQuery<unknown>[] | ((sql: HttpSql<A, F>) => readonly HttpQuery<unknown>[]), opts?: HttpTransactionOptions<boolean, boolean>): Promise<any[]>
}

// ── queries ─────────────────────────────────────────────────────────────────────────────────

/** What runs a query function's queries: its request, and the defaults its queries are parsed with. */
interface Runner {
  run(queries: HttpQuery<unknown>[], opts: HttpTransactionOptions<boolean, boolean>, batch: boolean): Promise<any[]>
  defaults: AnyOptions
}

/**
 * A query, not yet sent: awaiting it (or `.then`) sends it, once; interpolating it into another
 * sql`...` inlines it. `toQuery()` gives pg's `{ text, values }`, e.g. for `client.query()`.
 */
export class HttpQuery<T = any> implements Promise<T> {
  /** @internal */ readonly _p: { strings: readonly string[]; values: readonly unknown[]; text?: string }
  /** @internal */ readonly _opts: AnyOptions
  /** @internal */ readonly _sql: Runner
  private _promise?: Promise<T>

  /** @internal */
  constructor(sql: Runner, parts: HttpQuery['_p'], opts: AnyOptions = {}) {
    this._sql = sql
    this._p = parts
    this._opts = opts
  }

  /** The SQL text and parameters (not yet serialised) this query sends. */
  toQuery(): { text: string; values: unknown[] } {
    const { text, values } = this._p
    if (text !== undefined) return { text, values: [...values] }
    const out = { text: '', values: [] as unknown[] }
    inline(this, out)
    return out
  }

  then<R1 = T, R2 = never>(onFulfilled?: ((value: T) => R1 | PromiseLike<R1>) | null, onRejected?: ((reason: any) => R2 | PromiseLike<R2>) | null): Promise<R1 | R2> {
    this._promise ??= this._sql.run([this], this._opts, false).then((r) => r[0])
    return this._promise.then(onFulfilled, onRejected)
  }
  catch<R = never>(onRejected?: ((reason: any) => R | PromiseLike<R>) | null): Promise<T | R> {
    return this.then(undefined, onRejected)
  }
  finally(onFinally?: (() => void) | null): Promise<T> {
    return this.then().finally(onFinally)
  }
  get [Symbol.toStringTag]() {
    return 'HttpQuery'
  }
}

/** Appends a template's SQL to `out`, its values as $n parameters and nested templates inline. */
function inline(q: HttpQuery, out: { text: string; values: unknown[] }) {
  const { strings, values, text } = q._p
  if (text !== undefined) throw new TypeError('edgepg: a sql.query(text, params) query cannot be nested in a sql`...` template; write the fragment as sql`...`')
  strings.forEach((s, i) => {
    out.text += s
    if (i >= values.length) return
    const v = values[i]
    if (v instanceof HttpQuery) inline(v, out)
    else out.text += '$' + out.values.push(v)
  })
}

// ── parameters, exactly as pg serialises them ────────────────────────────────────────────────

const pad = (n: number | string, width = 2) => String(n).padStart(width, '0')

/** pg's Date serialisation: local time with its offset, or UTC under `defaults.parseInputDatesAsUTC`. */
function dateString(d: Date, utc: boolean): string {
  const get = (part: string): number => (d as any)[`get${utc ? 'UTC' : ''}${part}`]()
  let year = get('FullYear')
  const bc = year < 1
  if (bc) year = Math.abs(year) + 1
  let s = `${pad(year, 4)}-${pad(get('Month') + 1)}-${pad(get('Date'))}T${pad(get('Hours'))}:${pad(get('Minutes'))}:${pad(get('Seconds'))}.${pad(get('Milliseconds'), 3)}`
  if (utc) s += '+00:00'
  else {
    const offset = -d.getTimezoneOffset()
    const abs = Math.abs(offset)
    s += `${offset < 0 ? '-' : '+'}${pad(Math.floor(abs / 60))}:${pad(abs % 60)}`
  }
  return bc ? s + ' BC' : s
}

let hexTable: string[] | undefined
/** bytea's hex text form, for a Buffer / any typed array (pg sends those as binary; JSON carries text). */
function hex(view: ArrayBufferView): string {
  hexTable ??= Array.from({ length: 256 }, (_, i) => pad(i.toString(16)))
  const bytes = new Uint8Array(view.buffer, view.byteOffset, view.byteLength)
  let s = ''
  for (let i = 0; i < bytes.length; i++) s += hexTable[bytes[i]]
  return s
}

const isDate = (v: object): v is Date => Object.prototype.toString.call(v) === '[object Date]'

/** A JS array as a Postgres array literal, as pg writes it. */
function arrayString(array: unknown[]): string {
  return `{${array
    .map((item) =>
      item == null ? 'NULL'
      : Array.isArray(item) ? arrayString(item)
      : ArrayBuffer.isView(item) ? '\\\\x' + hex(item)
      : `"${prepareValue(item)!.replace(/\\/g, '\\\\').replace(/"/g, '\\"')}"`
    )
    .join(',')}}`
}

/**
 * A parameter in the text form pg sends: null/undefined → null; Buffer and typed arrays → bytea
 * hex (`\x…`); Date → pg's timestamp text; arrays → array literals; `toPostgres()`; other objects →
 * JSON; anything else → `toString()`.
 */
export function prepareValue(value: unknown, seen?: unknown[]): string | null {
  if (value == null) return null
  if (typeof value !== 'object') return (value as any).toString()
  if (ArrayBuffer.isView(value)) return '\\x' + hex(value)
  if (isDate(value)) return dateString(value, pgDefaults.parseInputDatesAsUTC)
  if (Array.isArray(value)) return arrayString(value)
  if (typeof (value as any).toPostgres === 'function') {
    seen ??= []
    if (seen.includes(value)) throw new Error(`circular reference detected while preparing "${value}" for query`)
    seen.push(value)
    return prepareValue((value as any).toPostgres(prepareValue), seen)
  }
  return JSON.stringify(value)
}

// ── the request ─────────────────────────────────────────────────────────────────────────────

/** A network, HTTP or protocol failure (Postgres' own errors are pg `DatabaseError`s). */
export class HttpSqlError extends Error {
  /** The HTTP status, when the server answered. */
  status?: number
  constructor(message: string, readonly url: string, status?: number, cause?: unknown) {
    super(message, cause === undefined ? undefined : { cause })
    this.name = 'HttpSqlError'
    if (status !== undefined) this.status = status
  }
}

export const errorFields = ['severity', 'code', 'detail', 'hint', 'position', 'internalPosition', 'internalQuery', 'where', 'schema', 'table', 'column', 'dataType', 'constraint', 'file', 'line', 'routine'] as const

/**
 * Neon's error class, for code that catches by it: whatever a query rejects with from Postgres
 * (pg's DatabaseError) or from the request (HttpSqlError) is an instance of it.
 */
export class NeonDbError extends Error {
  static [Symbol.hasInstance](value: unknown): boolean {
    return value instanceof DatabaseError || value instanceof HttpSqlError || Function.prototype[Symbol.hasInstance].call(this, value)
  }
}

/** Postgres' error, as pg's DatabaseError with every field (`length`, the wire message size, stays undefined). */
function databaseError(body: any): DatabaseError {
  const err = new DatabaseError(body.message, undefined as any, 'error')
  for (const key of errorFields) (err as any)[key] = body[key] == null ? undefined : String(body[key])
  return err
}

/** One result as pg builds it: pg's Result, its rows parsed by type OID. */
function toResult(r: any, arrayMode: boolean, types: HttpTypes | undefined): HttpQueryResult {
  const result = new PgResult(arrayMode ? 'array' : undefined, types)
  const fields = (r.fields ?? []).map((f: any) => new Field(f.name, f.tableID, f.columnID, f.dataTypeID, f.dataTypeSize, f.dataTypeModifier, 'text'))
  result.addFields(fields)
  result.command = r.command || null
  result.rowCount = r.rowCount ?? null
  // Postgres ≥ 12 always tags INSERT with oid 0; the protocol does not carry it.
  result.oid = r.oid !== undefined ? r.oid : result.command === 'INSERT' ? 0 : null
  for (const row of r.rows ?? []) result.rows.push(result.parseRow(Array.isArray(row) ? row : fields.map((f: Field) => row[f.name])))
  return result
}

const call = async <V>(x: V | (() => V | Promise<V>)): Promise<V> => (typeof x === 'function' ? (x as () => V | Promise<V>)() : x)
const definedOnly = <O extends object>(o: O): Partial<O> => Object.fromEntries(Object.entries(o).filter(([, v]) => v !== undefined)) as Partial<O>

/** Where requests go, and with which connection string (resolved per request: the password may be a function). */
interface Target {
  url: string
  /** Said beside a failure to reach `url` (the default endpoint's). */
  hint?: string
  connectionString(): Promise<string>
  fetch?: HttpTransportOptions['fetch']
}

/** Sends queries in one request: a single query, or a batch that runs as one transaction. */
async function send(target: Target, queries: HttpQuery<unknown>[], defaults: AnyOptions, explicit: HttpTransactionOptions<boolean, boolean>, batch: boolean): Promise<any[]> {
  const opts: HttpTransactionOptions<boolean, boolean> = { ...defaults, ...explicit }
  const { url } = target
  const payload = queries.map((q) => {
    const { text, values } = q.toQuery()
    return { query: text, params: values.map((v) => prepareValue(v)) }
  })
  const fail = (what: string, status?: number, cause?: unknown) => new HttpSqlError(`edgepg: POST ${url} ${what}`, url, status, cause)
  let token: string | undefined
  try {
    token = await call(opts.authToken)
  } catch (err) {
    throw fail(`not sent: authToken() failed: ${(err as Error)?.message ?? err}`, undefined, err)
  }
  const own: Record<string, string> = { 'Neon-Connection-String': await target.connectionString(), 'Neon-Raw-Text-Output': 'true', 'Neon-Array-Mode': 'true' }
  if (token) own.Authorization = `Bearer ${token}`
  if (batch) {
    if (opts.isolationLevel !== undefined) own['Neon-Batch-Isolation-Level'] = opts.isolationLevel
    if (opts.readOnly !== undefined) own['Neon-Batch-Read-Only'] = String(opts.readOnly)
    if (opts.deferrable !== undefined) own['Neon-Batch-Deferrable'] = String(opts.deferrable)
  }
  // What this process has seen (config.lastWrite): a read from a replica waits for it.
  if (edgeConfig.lastWrite) own['Edgepg-Last-Write'] = edgeConfig.lastWrite
  const headers = new Headers(opts.fetchOptions?.headers)
  for (const key in own) headers.set(key, own[key])

  let res: Response
  let body: string
  try {
    res = await (target.fetch ?? fetch)(url, { ...opts.fetchOptions, method: 'POST', headers, body: JSON.stringify(batch ? { queries: payload } : payload[0]) })
    body = await res.text()
    const seen = res.headers.get('edgepg-last-write')
    if (seen) edgeConfig.lastWrite = seen
  } catch (err: any) {
    const cause = err?.cause?.message ?? err?.cause?.code
    throw fail(`failed: ${err?.message ?? err}${cause ? ` (${cause})` : ''}${target.hint ? ` ${target.hint}` : ''}`, undefined, err)
  }
  let json: any
  try {
    json = JSON.parse(body)
  } catch {}
  // Postgres' errors carry a SQLSTATE or severity; the server's own refusals (bad request, 403...) do not.
  if (res.status === 400 && typeof json?.message === 'string' && (json.code != null || json.severity != null)) throw databaseError(json)
  const excerpt = (typeof json?.message === 'string' ? json.message : body.trim().slice(0, 300)) || '(empty body)'
  if (!res.ok) throw fail(`answered HTTP ${res.status}${res.statusText ? ' ' + res.statusText : ''}: ${excerpt}`, res.status)
  const results = batch ? json?.results : [json]
  if (!Array.isArray(results) || results.length !== queries.length || !results.every((r) => r && typeof r === 'object' && Array.isArray(r.fields)))
    throw fail(`answered with something that is not ${batch ? `${queries.length} query results` : 'a query result'}: ${excerpt}`, res.status)
  return results.map((r, i) => {
    // a query's own options, then the call's (transaction), then those of the sql`` that made it
    const o = { ...queries[i]._sql.defaults, ...explicit, ...definedOnly(queries[i]._opts) }
    const result = toResult(r, !!o.arrayMode, o.types)
    return o.fullResults ? result : result.rows
  })
}

/** A query function sending to `target`, with `defaults` under every call's own options. */
function makeSql(target: Target, defaults: HttpTransactionOptions<boolean, boolean>): HttpSql<boolean, boolean> {
  const runner: Runner = { defaults, run: (queries, opts, batch) => send(target, queries, defaults, definedOnly(opts), batch) }
  const sql = ((strings: TemplateStringsArray, ...values: unknown[]) => {
    if (!Array.isArray(strings) || !Array.isArray((strings as any).raw))
      throw new TypeError('edgepg: sql is a tagged template (sql`SELECT ${value}`); for a query in a string use sql.query(text, params)')
    return new HttpQuery(runner, { strings: strings.map((s, i) => s ?? strings.raw[i]), values })
  }) as HttpSql<boolean, boolean>
  sql.query = ((text: string, params: readonly unknown[] = [], opts: AnyOptions = {}) => new HttpQuery(runner, { strings: [text], values: params, text }, opts)) as any
  sql.unsafe = (rawSql: string) => new HttpQuery(runner, { strings: [String(rawSql)], values: [] })
  sql.transaction = (async (queries: any, opts: HttpTransactionOptions<boolean, boolean> = {}) => {
    if (typeof queries === 'function') queries = queries(sql)
    if (!Array.isArray(queries) || !queries.every((q) => q instanceof HttpQuery))
      throw new TypeError('edgepg: sql.transaction() takes an array of queries (sql`...` or sql.query()), or a function returning one')
    return queries.length ? runner.run(queries, opts, true) : []
  }) as any
  return sql
}

// ── httpSql ─────────────────────────────────────────────────────────────────────────────────

type ConnectionParams = Pick<HttpSqlOptions, 'user' | 'host' | 'port' | 'database'> & { password?: string }

/**
 * The connection URL: `base` (a postgres:// URL) with `params` filled in; `override` says whether
 * they replace the URL's own (httpSql, as Neon) or only fill what it lacks (Pool, as pg).
 * Errors never echo the connection string (it holds the password).
 */
function connectionUrl(base: string | undefined, params: ConnectionParams, override: boolean): URL {
  let url: URL
  try {
    url = new URL(base ?? 'postgresql://')
  } catch {
    throw new TypeError('edgepg: the connection string is not a valid postgres:// URL')
  }
  if (url.protocol !== 'postgres:' && url.protocol !== 'postgresql:') throw new TypeError(`edgepg: the connection string must start with postgres:// or postgresql://, not ${url.protocol}//`)
  const set = (key: 'username' | 'password' | 'hostname' | 'port', value: unknown) => {
    if (value != null && value !== '' && (override || !url[key])) url[key] = String(value)
  }
  set('hostname', params.host)
  set('port', params.port)
  set('username', params.user)
  set('password', params.password)
  if (params.database != null && (override || url.pathname.length < 2)) url.pathname = '/' + encodeURIComponent(params.database)
  if (!url.hostname) throw new TypeError('edgepg: no host in the connection string or options')
  return url
}

/** The connection string for each request, with the password resolved now if it is a function. */
const resolver = (url: URL, password: HttpSqlOptions['password']) => async () => {
  if (typeof password !== 'function') return url.href
  const withPassword = new URL(url.href)
  withPassword.password = await password()
  return withPassword.href
}

const hostOf = (url: URL) => decodeURIComponent(url.hostname)
const portOf = (url: URL) => Number(url.port || 5432)
/** The endpoint given, else `config.fetchEndpoint` (Neon's neonConfig.fetchEndpoint), for a host and port. */
const endpointFor = (given: HttpTransportOptions['fetchEndpoint'], host: string, port: number, authToken: unknown) => {
  const fetchEndpoint = given ?? edgeConfig.fetchEndpoint
  return typeof fetchEndpoint === 'function' ? fetchEndpoint(host, port, { jwtAuth: authToken !== undefined }) : fetchEndpoint
}

/**
 * Runs SQL over HTTP (POST /sql on edgepg-proxy, or Neon). `connection` is a postgres:// URL, or
 * options with `connectionString` and/or `user`, `password`, `host`, `port`, `database` (these
 * override the URL's). The endpoint defaults to `https://<host>/sql` (Neon's), or, with
 * `config.wsProxy` set, to the /sql of that proxy; `fetchEndpoint` changes it.
 *
 *   const sql = httpSql(process.env.DATABASE_URL, { fetchEndpoint: 'http://localhost:8080/sql' })
 *   const users = await sql<User>`SELECT * FROM users WHERE active = ${true}`
 */
export function httpSql<A extends boolean = false, F extends boolean = false>(connection: string, options?: HttpSqlOptions<A, F>): HttpSql<A, F>
export function httpSql<A extends boolean = false, F extends boolean = false>(options: HttpSqlOptions<A, F>): HttpSql<A, F>
export function httpSql(connection: string | HttpSqlOptions<boolean, boolean>, options: HttpSqlOptions<boolean, boolean> = {}): HttpSql<boolean, boolean> {
  if (typeof connection !== 'string') options = connection ?? {}
  const { connectionString, fetchEndpoint, fetch, user, password, host, port, database, ...defaults } = options
  const url = connectionUrl(typeof connection === 'string' ? connection : connectionString, { user, host, port, database, password: typeof password === 'string' ? password : undefined }, true)
  // The /sql next to the WebSocket's proxy: Neon's https://<host>/sql, unless config.wsProxy says where.
  const named = endpointFor(fetchEndpoint, hostOf(url), portOf(url), defaults.authToken)
  const hint = named === undefined && edgeConfig.wsProxy === undefined ? defaultEndpointHint('neither fetchEndpoint nor config.wsProxy is set') : undefined
  return makeSql({ url: named ?? sqlEndpoint(hostOf(url), portOf(url), edgeConfig), hint, connectionString: resolver(url, password), fetch: fetch ?? edgeConfig.fetchFunction }, defaults) as HttpSql<any, any>
}

// ── Pool.query over HTTP ────────────────────────────────────────────────────────────────────

/** The Pool option that sends `pool.query()` over HTTP when it can (Neon's `poolQueryViaFetch`). */
export interface HttpPoolConfig {
  /**
   * `pool.query(text, values)` without a callback goes over HTTP (one fetch, no WebSocket, no
   * pooled connection), like Neon's `poolQueryViaFetch`, unless something needs a session: Pool
   * `connect`/`acquire`/`release`/`remove` listeners; session settings (`options`,
   * `statement_timeout`, `lock_timeout`, `idle_in_transaction_session_timeout`: the endpoint picks
   * its own); text with a `;` before more text (maybe several statements); a Submittable (cursor,
   * stream); `binary` or `rows`. Those go over the WebSocket as usual. `query_timeout` works (the
   * request is aborted, "Query read timeout"). `true`, or transport options (`fetchEndpoint`,
   * `fetch`, `fetchOptions`, `authToken`); the default endpoint is the Pool's WebSocket proxy
   * address (`wsProxy`, `useSecureWebSocket`) with `ws(s)://…/v2` made `http(s)://…/sql`.
   */
  queryViaHttp?: boolean | HttpTransportOptions
}

/** Pool options that shape the session; the HTTP endpoint picks its own, so such Pools keep to WebSockets. */
const SESSION_OPTIONS = ['options', 'statement_timeout', 'lock_timeout', 'idle_in_transaction_session_timeout']
const SESSION_EVENTS = ['connect', 'acquire', 'release', 'remove']
const poolSql = new WeakMap<object, HttpSql<boolean, boolean>>()

/**
 * For `Pool.query`: when the Pool has `queryViaHttp` and the call needs no session, runs the query
 * over HTTP and returns its promise (of a pg Result); otherwise returns undefined, for the
 * WebSocket path to take the call:
 *
 *   query(config: any, values?: any, callback?: any): any {
 *     return poolQueryViaHttp(this, config, values, callback) ?? super.query(config, values, callback)
 *   }
 */
export function poolQueryViaHttp(pool: any, config: unknown, values?: unknown, callback?: unknown): Promise<HttpQueryResult> | undefined {
  const options = pool?.options ?? {}
  const viaHttp = options.queryViaHttp ?? edgeConfig.poolQueryViaFetch
  if (!viaHttp || pool.ending || callback !== undefined || typeof values === 'function') return
  if (SESSION_EVENTS.some((e) => pool.listenerCount(e) > 0)) return
  if (SESSION_OPTIONS.some((key) => options[key] != null && options[key] !== false) || /[?&](options|[a-z_]+_timeout)=/.test(options.connectionString ?? '')) return
  const cfg: any = typeof config === 'string' ? { text: config } : config
  if (!cfg || typeof cfg.text !== 'string' || typeof cfg.submit === 'function' || cfg.callback || cfg.binary || cfg.rows) return
  if (/;\s*\S/.test(cfg.text)) return // perhaps several statements: only the simple protocol, on a connection, runs those
  let sql = poolSql.get(pool)
  try {
    if (!sql) poolSql.set(pool, (sql = sqlForPool(options, viaHttp === true ? {} : viaHttp)))
  } catch (err) {
    return Promise.reject(err) // (pool.query reports errors by rejecting)
  }
  const timeout = cfg.query_timeout ?? options.query_timeout
  const signal = timeout > 0 ? AbortSignal.timeout(timeout) : undefined
  const opts: AnyOptions = { arrayMode: cfg.rowMode === 'array', types: cfg.types }
  if (signal) opts.fetchOptions = { ...viaHttp.fetchOptions, signal }
  return sql.query(cfg.text, (values ?? cfg.values ?? []) as unknown[], opts).then(undefined, (err) => {
    throw signal?.aborted && err instanceof HttpSqlError ? new Error('Query read timeout') : err
  })
}

/** httpSql for a Pool's connection options (pg's precedence: the connection string's fields win). */
function sqlForPool(options: any, transport: HttpTransportOptions): HttpSql<boolean, boolean> {
  const { password } = options
  const url = connectionUrl(
    options.connectionString,
    { user: options.user ?? pgDefaults.user, host: options.host ?? pgDefaults.host, port: options.port, database: options.database, password: typeof password === 'string' ? password : undefined },
    false
  )
  const authToken = transport.authToken ?? options.authToken
  // (edgepg-proxy serves /sql next to /v2: the WebSocket address this Pool would use, as http(s))
  const own: EdgeConfig = { ...edgeConfig, ...definedOnly({ wsProxy: options.wsProxy, useSecureWebSocket: options.useSecureWebSocket }) }
  const endpoint = endpointFor(transport.fetchEndpoint, hostOf(url), portOf(url), authToken) ?? sqlEndpoint(hostOf(url), portOf(url), own)
  const { fetchOptions, fetch } = transport
  return makeSql({ url: endpoint, connectionString: resolver(url, password), fetch: fetch ?? edgeConfig.fetchFunction }, { fullResults: true, types: options.types, fetchOptions, authToken })
}

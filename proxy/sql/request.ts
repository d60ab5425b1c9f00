/**
 * Reading a POST /sql request: the connection string, the Neon-* headers, the JSON body and its
 * parameters (JSON values as Postgres text). Anything wrong is an HttpError saying what.
 */
import type { IncomingMessage } from 'node:http'
import type { HostPort } from '../upstream/address'

/** A refusal, with its HTTP status (and a SQLSTATE where Postgres has one for it). */
export class HttpError extends Error {
  constructor(readonly status: number, message: string, readonly code: string | null = null) {
    super(message)
  }
}

/** Neon-Batch-Isolation-Level's values, in SQL. */
export const ISOLATION_LEVELS: Record<string, string> = {
  ReadUncommitted: 'READ UNCOMMITTED',
  ReadCommitted: 'READ COMMITTED',
  RepeatableRead: 'REPEATABLE READ',
  Serializable: 'SERIALIZABLE',
}

/** One statement of a request. */
export interface QueryData {
  query: string
  params: Array<string | null>
  arrayMode?: boolean
}

/** The Neon-* headers that shape the results and a batch's transaction. */
export interface Flags {
  raw: boolean
  arrayMode: boolean
  isolation?: string
  readOnly: boolean
  deferrable: boolean
}

export function header(req: IncomingMessage, name: string): string | undefined {
  const v = req.headers[name]
  return Array.isArray(v) ? v.join(', ') : v
}

/** A header that must come once (two connection strings joined by ", " would read as one, a password in its path). */
export function singleHeader(req: IncomingMessage, name: string): string | undefined {
  const values = req.headersDistinct[name]
  if (values && values.length > 1) throw new HttpError(400, `the ${name} header is given ${values.length} times; send it once`)
  return values?.[0]
}

/** Postgres's limit: a Bind carries the parameter count in 16 bits. */
const MAX_PARAMS = 65535

export interface ConnInfo {
  named: HostPort
  user: string
  database: string
  password?: string
}

/** `anyUser`: the request is by token, which names the role: the URL may name no user. */
export function parseConnectionString(text: string | undefined, upstream: HostPort, anyUser = false): ConnInfo {
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
  if (!user && !anyUser) throw new HttpError(400, 'Neon-Connection-String has no user name')
  if (!url.hostname) throw new HttpError(400, 'Neon-Connection-String has no host')
  const host = url.hostname.replace(/^\[(.*)\]$/, '$1').toLowerCase()
  const port = url.port ? Number(url.port) : host === upstream.host ? upstream.port : 5432
  const database = decode(url.pathname.replace(/^\//, ''), 'database name') || user
  return { named: { host, port }, user, database, password: url.password ? decode(url.password, 'password') : undefined }
}

export function parseFlags(req: IncomingMessage): Flags {
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

/** The body, whole, within `max` bytes and `ms` milliseconds. */
/** Where a body's bytes are counted while it is read (proxy/ws/budget.ts): take() false means no room. */
export interface BodyBudget {
  take(n: number): boolean
  give(n: number): void
}

export function readBody(req: IncomingMessage, max: number, ms: number, budget?: BodyBudget): Promise<Buffer> {
  const tooLarge = () => new HttpError(413, `request body is too large (max is ${max} bytes)`)
  if (Number(req.headers['content-length']) > max) return Promise.reject(tooLarge())
  let size = 0
  const read = new Promise<Buffer>((resolve, reject) => {
    const timer = setTimeout(() => reject(new HttpError(408, `request body not received within ${Math.round(ms)} ms`)), Math.max(0, ms))
    req.once('close', () => clearTimeout(timer))
    req.once('end', () => clearTimeout(timer))
    const chunks: Buffer[] = []
    const stop = (err: HttpError) => {
      req.off('data', onData)
      reject(err)
    }
    const onData = (chunk: Buffer) => {
      if (size + chunk.length > max) return stop(tooLarge())
      if (budget && !budget.take(chunk.length)) return stop(new HttpError(503, 'edgepg-proxy is over its memory budget for request bodies (--max-client-buffer); try again later'))
      size += chunk.length
      chunks.push(chunk)
    }
    req.on('data', onData)
    let ended = false
    req.once('end', () => ((ended = true), resolve(Buffer.concat(chunks))))
    req.once('error', reject)
    req.once('close', () => ended || reject(new HttpError(499, 'client went away')))
  })
  return budget ? read.finally(() => budget.give(size)) : read
}

/** JSON nested beyond what the stack takes (parsing it, or turning a parameter into text). */
const tooDeep = () => new HttpError(400, 'request body is nested too deeply')

export function parsePayload(body: Buffer): { single?: QueryData; batch?: QueryData[] } {
  let json: any
  try {
    json = JSON.parse(body.toString('utf8'))
  } catch (err) {
    if (err instanceof RangeError) throw tooDeep()
    throw new HttpError(400, `request body is not valid JSON: ${(err as Error).message}`)
  }
  try {
    if (json !== null && typeof json === 'object' && !Array.isArray(json)) {
      if ('query' in json) return { single: parseQuery(json, 'the request') }
      if (Array.isArray(json.queries)) return { batch: json.queries.map((q: unknown, i: number) => parseQuery(q, `queries[${i}]`)) }
    }
  } catch (err) {
    throw err instanceof RangeError ? tooDeep() : err
  }
  throw new HttpError(400, 'request body must be JSON {"query": "...", "params": [...]} or {"queries": [{"query": "...", "params": [...]}, ...]}')
}

function parseQuery(q: any, where: string): QueryData {
  if (q === null || typeof q !== 'object' || typeof q.query !== 'string') throw new HttpError(400, `${where}: "query" must be a string`)
  if (q.params !== undefined && q.params !== null && !Array.isArray(q.params)) throw new HttpError(400, `${where}: "params" must be an array`)
  if (q.arrayMode !== undefined && q.arrayMode !== null && typeof q.arrayMode !== 'boolean') throw new HttpError(400, `${where}: "arrayMode" must be true or false`)
  if (q.params?.length > MAX_PARAMS) throw new HttpError(400, `${where}: ${q.params.length} params; Postgres takes at most ${MAX_PARAMS} in one statement`)
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

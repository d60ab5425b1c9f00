import assert from 'node:assert/strict'
import http from 'node:http'
import net from 'node:net'
import { WebSocket, WebSocketServer } from 'ws'
import pg from 'pg'
import { createProxy, type ProxyOptions } from '../../proxy'
import { Client, Pool, type ClientConfig } from '../../src'
import { pgConfig, testPostgres, type Role, type PgInfo } from './stack'

export { pgConfig, testPostgres }

/** An edgepg-proxy in this process, relaying to the test Postgres. */
export async function startProxy(options: Partial<ProxyOptions> = {}) {
  const info = testPostgres()
  const proxy = createProxy({ upstream: `${info.host}:${info.port}`, ...options })
  const { port } = await proxy.listen(0, '127.0.0.1')
  return Object.assign(proxy, { port, url: `ws://127.0.0.1:${port}/v2` }) // (a spread would freeze sessionCount)
}

/** edgepg client options that reach the test Postgres through the proxy on `proxyPort`. */
export function edgeConfig(proxyPort: number, role: Role = 'scram_user', extra: ClientConfig = {}): ClientConfig {
  return { ...pgConfig(role), webSocketConstructor: WebSocket as any, wsProxy: () => `ws://127.0.0.1:${proxyPort}/v2`, ...extra }
}

export const edgeClient = (proxyPort: number, role?: Role, extra?: ClientConfig) => new Client(edgeConfig(proxyPort, role, extra))
export const edgePool = (proxyPort: number, extra: ClientConfig & pg.PoolConfig = {}) => new Pool(edgeConfig(proxyPort, 'scram_user', extra))

/**
 * A table of a test file's own, made and read over TCP (outside edgepg), so what committed is seen
 * as Postgres has it. drop() removes it and closes the connection.
 */
export async function scratchTable(prefix: string, columns: string) {
  const name = `${prefix}_${process.pid}_${Date.now()}`
  const tcp = new pg.Client(pgConfig('scram_user'))
  await tcp.connect()
  await tcp.query(`CREATE TABLE ${name} (${columns})`)
  const drop = async () => {
    try {
      await tcp.query(`DROP TABLE IF EXISTS ${name}`)
    } finally {
      await tcp.end()
    }
  }
  return { name, tcp, drop }
}

/** Backends other than the caller's, optionally only those with a given application_name (and user). */
export async function backends(applicationName?: string, on: PgInfo = testPostgres(), user?: string): Promise<number> {
  const admin = new pg.Client(pgConfig('trust_user', on))
  await admin.connect()
  try {
    const { rows } = await admin.query(
      `SELECT count(*)::int AS n FROM pg_stat_activity WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()
       AND ($1::text IS NULL OR application_name = $1) AND ($2::text IS NULL OR usename = $2)`,
      [applicationName ?? null, user ?? null]
    )
    return rows[0].n
  } finally {
    await admin.end()
  }
}

/** Polls (every `pollMs`) until `fn` returns true, for state that settles asynchronously (e.g. a backend exiting). */
export async function eventually(fn: () => Promise<boolean> | boolean, what: string, ms = 5000, pollMs = 25) {
  const deadline = Date.now() + ms
  while (!(await fn())) {
    if (Date.now() > deadline) throw new Error(`timed out after ${ms} ms waiting for: ${what}`)
    await new Promise((r) => setTimeout(r, pollMs))
  }
}

/** Races `promise` against a timer, so that no wait is unbounded. */
export async function within<T>(ms: number, what: string, promise: Promise<T>): Promise<T> {
  let timer: NodeJS.Timeout | undefined
  try {
    return await Promise.race([promise, new Promise<never>((_, reject) => (timer = setTimeout(() => reject(new Error(`timed out after ${ms} ms: ${what}`)), ms)))])
  } finally {
    clearTimeout(timer)
  }
}

/** Tries a WebSocket upgrade: the HTTP status and body when refused, or the open socket (status 101). */
export function tryUpgrade(url: string, options: { headers?: Record<string, string>; protocols?: string[]; ca?: string } = {}): Promise<{ status: number; body: string; ws?: WebSocket }> {
  return new Promise((resolve, reject) => {
    const ws = new WebSocket(url, options.protocols ?? [], { headers: options.headers, ca: options.ca })
    ws.once('open', () => resolve({ status: 101, body: '', ws }))
    ws.once('unexpected-response', (req, res) => {
      let body = ''
      res.setEncoding('utf8')
      res.on('data', (c: string) => (body += c))
      res.on('end', () => {
        req.destroy()
        resolve({ status: res.statusCode ?? 0, body })
      })
    })
    ws.once('error', reject)
  })
}

/** Resolves with the close code and reason once the WebSocket closes. */
export const closeOf = (ws: WebSocket) =>
  new Promise<{ code: number; reason: string }>((resolve) => ws.once('close', (code, reason) => resolve({ code, reason: String(reason) })))

/** deepStrictEqual, with a label in front of the diff (a `message` argument would replace the diff). */
export function same(actual: unknown, expected: unknown, label: string) {
  try {
    assert.deepStrictEqual(actual, expected)
  } catch (err) {
    ;(err as Error).message = `${label}\n${(err as Error).message}`
    throw err
  }
}

/** The real `ws` WebSocket, recording every message it sends. */
export function recordingWebSocket() {
  const sent: Buffer[] = []
  class Recording extends WebSocket {
    send(data: any, ...rest: any[]) {
      sent.push(Buffer.from(data))
      return (super.send as any)(data, ...rest)
    }
  }
  return { sent, Recording: Recording as any }
}

/** The message types in a chunk of frontend messages, e.g. 'PBDES'. */
export function tags(buf: Buffer): string {
  let out = ''
  for (let i = 0; i < buf.length; i += 1 + buf.readInt32BE(i + 1)) out += String.fromCharCode(buf[i])
  return out
}

/**
 * The simplest WebSocket → TCP relay, knowing nothing of edgepg (as other relays are): each message
 * goes out as it is. `select` picks a subprotocol from those offered (default: none).
 */
export async function startPlainWebSocketRelay(target: { host: string; port: number }, select: (offered: Set<string>) => string | false = () => false) {
  const server = http.createServer()
  const wss = new WebSocketServer({ server, handleProtocols: select })
  wss.on('connection', (ws) => {
    const tcp = net.connect(target)
    tcp.on('error', () => ws.close())
    tcp.on('data', (d) => ws.send(d))
    tcp.on('close', () => ws.close())
    ws.on('message', (d) => tcp.write(d as Buffer))
    ws.on('close', () => tcp.destroy())
  })
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
  return {
    port: (server.address() as net.AddressInfo).port,
    close: () =>
      new Promise<void>((resolve) => {
        for (const ws of wss.clients) ws.terminate()
        wss.close()
        server.closeAllConnections()
        server.close(() => resolve())
      }),
  }
}

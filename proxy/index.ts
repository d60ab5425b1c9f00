import http, { type Server } from 'node:http'
import https from 'node:https'
import net, { type AddressInfo } from 'node:net'
import dns from 'node:dns/promises'
import type { Duplex } from 'node:stream'
import { WebSocketServer, type WebSocket } from 'ws'
import { formatHostPort, parseHostPort, type HostPort } from './address'
import { runSession, type SessionLog } from './session'
import { Upstream, type ClientTls, type UpstreamTls } from './upstream'
import { redactLogin, runLogin, takeLogin, type LoginOutcome } from './login'
import { BackendPool, UNUSED, type Backend, type PoolOptions } from './pool'
import { UpstreamError } from './startup'
import { createMetrics, type Metrics, type RefusalReason } from './metrics'
import { healthHandler } from './health'
import { sqlHandler, type SqlOptions, type SqlPoolOptions, type SqlLog } from './sql'
import { SUBPROTOCOL } from '../src/config'

export interface ProxyOptions {
  /** The Postgres this proxy relays to: `host:port`. */
  upstream: string
  /** Further `host:port` upstreams a client may pick with `?address=`; matched exactly. */
  allow?: string[]
  /** Largest WebSocket message accepted from a client, in bytes. Default 64 MiB. */
  maxMessageBytes?: number
  /**
   * Authenticate upstream on the client's behalf (default true): clients send a cleartext
   * password, pipelined, and the proxy does md5/SCRAM next to the database. When false the proxy
   * relays the startup untouched, so clients authenticate with Postgres end to end.
   */
  authOffload?: boolean
  /**
   * Accept cleartext passwords over plain ws:// from non-loopback clients. Only for when TLS ends
   * in front of the proxy (a load balancer); otherwise passwords would cross the network in clear.
   */
  allowInsecurePasswords?: boolean
  /** Serve wss:// (and https://) with this certificate chain and key (PEM). */
  tls?: { cert: string | Buffer; key: string | Buffer }
  /** TLS from the proxy to Postgres (sslmode require / verify-ca / verify-full). Default: none. */
  upstreamTls?: UpstreamTls
  /** Browser Origins allowed to open sessions (`*`: any). Requests without Origin are allowed. Default: none. */
  allowedOrigins?: string[]
  /** Concurrent sessions in all (default 1000); more are refused with HTTP 503. */
  maxSessions?: number
  /** Concurrent sessions from one client address (default 100); more are refused with HTTP 429. */
  maxSessionsPerIp?: number
  /** Time from the upgrade to a finished Postgres startup (default 10 s). */
  handshakeTimeoutMs?: number
  /** Close a session with no traffic either way for this long (default 15 min; 0: never). */
  idleTimeoutMs?: number
  /** Resolves a host name to its addresses (default: the system resolver). */
  lookup?: (host: string) => Promise<string[]>
  /** POST /sql: Neon's SQL-over-HTTP protocol, on pooled connections (default on); false: off. */
  sql?: false | Pick<SqlOptions, 'maxBodyBytes' | 'maxResponseBytes' | 'statementTimeoutMs' | 'maxRequests' | 'authToken'> & { pool?: SqlPoolOptions }
  /** Called once per /sql request; never given passwords, queries or parameters. */
  sqlLog?: (entry: SqlLog) => void
  /** Called once per ended session; never given passwords or payloads. */
  log?: (entry: SessionLog) => void
  /** Warm backends for sessions whose login the proxy runs (default on; see proxy/pool.ts). */
  pool?: PoolOptions
}

export type { SessionLog, UpstreamTls, SqlLog }

export interface Proxy {
  server: Server
  listen(port?: number, host?: string): Promise<AddressInfo>
  /**
   * Stops accepting, lets sessions end by themselves for up to `graceMs`, then closes the rest with
   * WebSocket code 1001 (their clients see "edgepg-proxy is shutting down").
   */
  close(graceMs?: number): Promise<void>
  /** Serves a new certificate and key from now on; running sessions keep theirs. */
  setTls(tls: { cert: string | Buffer; key: string | Buffer }): void
  /** Sessions open right now. */
  readonly sessionCount: number
  /** Prometheus metrics, also served at GET /metrics. */
  readonly metrics: Metrics
}

/** Sent to clients whose session is cut by a shutdown. */
const SHUTDOWN_REASON = 'edgepg-proxy is shutting down'

/** A request's path: cut at the query, cheaply (requests are mostly origin-form); URL for the rest. */
function pathOf(url = '/'): string {
  if (url[0] !== '/') return new URL(url, 'http://proxy').pathname
  const query = url.indexOf('?')
  return query < 0 ? url : url.slice(0, query)
}

const isLoopback = (address: string) => /^(127\.|::1$|::ffff:127\.)/.test(address)

export function createProxy(options: ProxyOptions): Proxy {
  const upstream = parseHostPort(options.upstream)
  const offload = options.authOffload !== false
  const lookup = options.lookup ?? (async (host: string) => (await dns.lookup(host, { all: true })).map((a) => a.address))
  /**
   * A name on the allow-list stands for the addresses it had when first used: a client's session
   * goes to one of those, never to wherever the name points later (DNS rebinding).
   */
  const pinned = new Map<string, Promise<Set<string>>>()
  const pinnedAddress = async (target: HostPort): Promise<string | undefined> => {
    const key = formatHostPort(target)
    if (!pinned.has(key)) pinned.set(key, lookup(target.host).then((ips) => new Set(ips)))
    const [known, now] = await Promise.all([pinned.get(key)!, lookup(target.host)])
    return now.find((ip) => known.has(ip))
  }
  const allowed = new Set([upstream, ...(options.allow ?? []).map((a) => parseHostPort(a))].map(formatHostPort))
  // Selecting edgepg's subprotocol says the proxy takes a login from the upgrade (proxy/login.ts).
  // Any other offered subprotocol is declined (ws would otherwise select the first one offered).
  const wss = new WebSocketServer({
    noServer: true,
    maxPayload: options.maxMessageBytes ?? 64 << 20,
    perMessageDeflate: false,
    handleProtocols: (offered) => (offered.has(SUBPROTOCOL) ? SUBPROTOCOL : false),
  })
  const sessions = new Set<WebSocket>()
  /** Whether a cleartext password may cross this client's link: TLS, loopback, or the operator says so. */
  const passwordsAllowed = (req: http.IncomingMessage) =>
    'encrypted' in req.socket || isLoopback(req.socket.remoteAddress ?? '') || options.allowInsecurePasswords === true
  /** Upgrades under way: they count against the limits too. */
  const upgrading = new Set<Duplex>()
  const perIp = new Map<string, number>()
  const maxSessions = options.maxSessions ?? 1000
  const maxPerIp = options.maxSessionsPerIp ?? 100
  const origins = new Set(options.allowedOrigins ?? [])
  let closing = false

  const pool = new BackendPool(options.pool, (event) => metrics.poolEvent(event))
  const metrics = createMetrics(() => pool.size)
  const health = healthHandler(upstream)
  const sql =
    options.sql === false
      ? undefined
      : sqlHandler({
          upstream,
          // The same rules as /v1?address=: exact allow-list, names pinned to their addresses.
          isAllowed: async (named) => {
            if (!allowed.has(formatHostPort(named))) return false
            if (net.isIP(named.host) || formatHostPort(named) === formatHostPort(upstream)) return true
            const ip = await pinnedAddress(named)
            return ip ? { ...named, address: ip } : false
          },
          allowedOrigins: options.allowedOrigins,
          upstreamTls: options.upstreamTls,
          backends: pool,
          allowInsecurePasswords: options.allowInsecurePasswords,
          log: options.sqlLog,
          ...options.sql,
        })
  const onRequest = (req: http.IncomingMessage, res: http.ServerResponse) => {
    const path = pathOf(req.url)
    if (path === '/healthz') return health(req, res)
    if (path === '/metrics') return void metrics.handle(req, res)
    if (path === '/sql' && sql) return sql.handle(req, res)
    res.writeHead(426, { 'content-type': 'text/plain', upgrade: 'websocket' })
    res.end('edgepg-proxy: connect with a WebSocket to /v1 or /v2\n')
  }
  const handshakeMs = options.handshakeTimeoutMs ?? 10_000
  const server: Server = options.tls ? https.createServer({ ...options.tls, handshakeTimeout: handshakeMs }, onRequest) : http.createServer(onRequest)
  // A client that never finishes its HTTP request (or TLS handshake) is dropped on the same clock.
  const unanswered = new WeakMap<Duplex, NodeJS.Timeout>()
  const answered = (socket: Duplex) => clearTimeout(unanswered.get(socket))
  server.on(options.tls ? 'secureConnection' : 'connection', (socket: Duplex) => {
    unanswered.set(socket, setTimeout(() => socket.destroy(), handshakeMs).unref())
    socket.once('close', () => answered(socket))
  })
  server.on('request', (req) => answered(req.socket))

  server.on('upgrade', (req, socket, head) => {
    answered(socket)
    const refuse = (status: number, reason: string, why: RefusalReason) => {
      metrics.refused(why)
      socket.end(`HTTP/1.1 ${status} ${http.STATUS_CODES[status]}\r\nContent-Type: text/plain\r\nConnection: close\r\n\r\n${reason}\n`)
    }
    socket.on('error', () => socket.destroy())
    const url = new URL(req.url ?? '/', 'http://proxy')
    const peer = req.socket.remoteAddress ?? '?'
    if (closing) return refuse(503, SHUTDOWN_REASON, 'shutting_down')
    if (url.pathname !== '/v1' && url.pathname !== '/v2') return refuse(404, `no WebSocket route at ${url.pathname}; use /v1 or /v2`, 'not_found')
    const origin = req.headers.origin
    if (origin !== undefined && !origins.has('*') && !origins.has(origin)) return refuse(403, `origin ${origin} is not allowed (--allow-origin)`, 'origin')
    if (sessions.size + upgrading.size >= maxSessions) return refuse(503, `too many sessions (${maxSessions}); try again later`, 'too_many_sessions')
    if ((perIp.get(peer) ?? 0) >= maxPerIp) return refuse(429, `too many sessions from ${peer} (${maxPerIp})`, 'too_many_sessions_per_ip')
    let target: HostPort = upstream
    const address = url.searchParams.get('address')
    if (address) {
      try {
        target = parseHostPort(address)
      } catch (err) {
        return refuse(400, (err as Error).message, 'bad_address')
      }
      if (!allowed.has(formatHostPort(target))) return refuse(403, `address ${address} is not an allowed upstream`, 'forbidden_address')
      if (!net.isIP(target.host)) {
        const named = target
        return void pinnedAddress(named).then(
          (ip) => (ip ? accept({ ...named, address: ip }) : refuse(403, `address ${address} no longer resolves to an address the allow-list had`, 'forbidden_address')),
          (err: Error) => refuse(502, `cannot resolve ${named.host}: ${err.message}`, 'bad_address')
        )
      }
    }
    accept(target)

    function accept(target: HostPort) {
      if (socket.destroyed) return
      upgrading.add(socket)
      perIp.set(peer, (perIp.get(peer) ?? 0) + 1)
      const release = () => {
        const n = (perIp.get(peer) ?? 1) - 1
        n ? perIp.set(peer, n) : perIp.delete(peer)
      }
      // The login leaves the headers here: ws negotiates the rest, and nothing logs it.
      const { protocols, login, problem } = takeLogin(req.headers['sec-websocket-protocol'])
      if (protocols === undefined) delete req.headers['sec-websocket-protocol']
      else req.headers['sec-websocket-protocol'] = protocols
      req.rawHeaders = redactLogin(req.rawHeaders)

      let up: Upstream | undefined
      /** The pool's backend this session runs on, if any. */
      let backend: Backend | undefined
      let ws: WebSocket | undefined
      const connect = () => {
        const started = performance.now()
        return (up = new Upstream(target, options.upstreamTls, () => metrics.upstreamConnected((performance.now() - started) / 1000)))
      }
      // Until the Postgres startup is done: a stalled login is answered with an error, a stalled session closed.
      const handshake = timer(handshakeMs, () =>
        ws ? ws.close(1008, 'edgepg-proxy: startup not finished in time') : upgrade(new UpstreamError(`login timed out: Postgres at ${formatHostPort(target)} did not answer within ${handshakeMs} ms`))
      )
      /** No session after all: the backend goes back idle (its login just finished), or the connection is closed. */
      const drop = () => (backend ? pool.giveBack(backend, UNUSED) : up?.close())
      socket.once('close', () => {
        if (upgrading.delete(socket)) release()
        handshake.stop()
        if (!ws) drop()
      })
      if (login?.first.kind === 'cancel') login.first.packet = pool.cancelRequest(formatHostPort(target), login.first.packet)
      // A login the proxy runs in full, with a password it can compare, may get a warm backend.
      const poolKey = login && offload && pool.enabled && login.first.kind === 'startup' ? pool.key(formatHostPort(target), login.tls, login.first.packet, login.password) : undefined
      if (problem) connect(), upgrade(problem)
      else if (!login) connect(), upgrade()
      else {
        const fresh = () => {
          const upstream = connect()
          const io = { upstream: upstream.queue, toUpstream: (b: Buffer) => void upstream.write(b), passwordsAllowed: passwordsAllowed(req), offload, secureUpstream: (asked?: ClientTls) => upstream.secure(asked) }
          return runLogin(io, login).then((outcome) => ({ upstream, outcome }))
        }
        pool.open(poolKey, fresh).then((opened) => {
          up = opened.upstream
          backend = opened.backend
          ws ? drop() : upgrade(opened.outcome) // (a session already open was refused: the login timed out)
        }, upgrade)
      }

      function upgrade(opened?: LoginOutcome | Error) {
        if (ws) return
        if (socket.destroyed) return void drop()
        // The 101 response and Postgres's answer (sent as the session starts) leave in one write.
        socket.cork()
        wss.handleUpgrade(req, socket, head, (session) => {
          ws = session
          upgrading.delete(socket)
          sessions.add(session)
          metrics.sessionOpened()
          const idle = timer(options.idleTimeoutMs ?? 900_000, () => session.close(1001, 'edgepg-proxy: idle timeout'))
          session.once('close', () => {
            sessions.delete(session)
            release()
            handshake.stop()
            idle.stop()
          })
          runSession(session, {
            upstream: up!, opened, loginBytes: login?.bytes, peer, offload, passwordsAllowed: passwordsAllowed(req),
            giveBack: backend && ((ending) => pool.giveBack(backend!, ending)),
            mapCancel: (packet) => pool.cancelRequest(formatHostPort(target), packet),
            log: (entry) => {
              metrics.sessionClosed(entry)
              options.log?.(entry)
            },
            onEstablished: () => handshake.stop(),
            onActivity: idle.touch,
          })
        })
        socket.uncork()
      }
    }
  })

  return {
    server,
    listen(port = 0, host = '127.0.0.1') {
      return new Promise((resolve, reject) => {
        server.once('error', reject)
        server.listen(port, host, () => {
          server.off('error', reject)
          resolve(server.address() as AddressInfo)
        })
      })
    },
    metrics,
    get sessionCount() {
      return sessions.size + upgrading.size
    },
    setTls(tls) {
      ;(server as https.Server).setSecureContext({ ...tls })
    },
    async close(graceMs = 0) {
      closing = true
      const sqlClosed = sql?.close(graceMs)
      const stopped = new Promise<void>((resolve) => server.close(() => resolve()))
      const deadline = Date.now() + graceMs
      while (sessions.size && Date.now() < deadline) await new Promise((r) => setTimeout(r, Math.min(50, deadline - Date.now())))
      for (const socket of upgrading) socket.destroy()
      for (const ws of sessions) ws.close(1001, SHUTDOWN_REASON)
      // Clients that do not answer the close handshake promptly are cut.
      const cut = setTimeout(() => sessions.forEach((ws) => ws.terminate()), 2000)
      while (sessions.size) await new Promise((r) => setTimeout(r, 20))
      clearTimeout(cut)
      pool.close()
      await sqlClosed
      server.closeAllConnections()
      await stopped
    },
  }
}

/**
 * Fires `ms` after the last touch (0 ms: never). Touching only records the time, so it costs
 * nothing per message; when the timer comes due early it re-arms for what is left.
 */
function timer(ms: number, fire: () => void) {
  let handle: NodeJS.Timeout | undefined
  let last = Date.now()
  const arm = (delay: number) => {
    if (ms > 0) (handle = setTimeout(check, delay)).unref()
  }
  const check = () => {
    const left = last + ms - Date.now()
    left > 0 ? arm(left) : fire()
  }
  arm(ms)
  return {
    touch: () => void (last = Date.now()),
    stop: () => clearTimeout(handle),
  }
}

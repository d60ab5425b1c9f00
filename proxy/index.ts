import http, { type Server } from 'node:http'
import https from 'node:https'
import net, { type AddressInfo } from 'node:net'
import type { Duplex } from 'node:stream'
import type { SessionLog } from './ws/session'
import type { UpstreamTls } from './upstream/connection'
import { BackendPool, type PoolOptions } from './pool/backends'
import { Lenders } from './pool/lenders'
import { policyName } from './notify/policy'
import { pinnedCap } from './pool/pin'
import { Replicas, type ReplicaOptions } from './replicas/replicas'
import { createMetrics, type Metrics } from './admin/metrics'
import { healthHandler } from './admin/health'
import { sqlHandler, type SqlOptions, type SqlPoolOptions, type SqlLog } from './sql/handler'
import { Upstreams } from './upstream/allowed'
import { WebSocketRoutes, type UpgradeRefusal } from './ws/routes'
import { BufferBudget } from './ws/budget'
import { LoginGate } from './login/gate'
import { Cancels } from './ws/cancels'
import { TokenLogins, type TokenLoginOptions } from './auth/token-login'
import { ClientAddresses, isLoopback } from './listen/client-address'
import type { ClusterLink } from './cluster/worker'
import type { ListenerEvents } from './notify/listener'
import { localPlaces, type PlacesOf } from './cluster/places'
import { read } from './isolation/reader'
import { warmUp } from './warm-up'
import { Signals } from './ws/signals'

export interface ProxyOptions {
  /** The Postgres this proxy relays to: `host:port`. */
  upstream: string
  /** Further `host:port` upstreams a client may pick with `?address=`; matched exactly. */
  allow?: string[]
  /** Largest WebSocket message accepted from a client once logged in, in bytes. Default 64 MiB. */
  maxMessageBytes?: number
  /**
   * Bytes all clients' unfinished WebSocket messages and /sql bodies may hold at once (default
   * 256 MiB): a message that does not fit is refused as its header comes (1009), a body with 503.
   */
  maxClientBufferBytes?: number
  /** Logins waiting on Postgres at once, in all (default 64); more wait their turn. */
  maxLogins?: number
  /** Logins waiting on Postgres at once from one client address (default 8); more wait their turn. */
  maxLoginsPerIp?: number
  /** CancelRequests a second from one client address (default 20); more are dropped. */
  maxCancelsPerIp?: number
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
  /** Concurrent sessions in all (default 10,000); more are refused with HTTP 503. */
  maxSessions?: number
  /** Concurrent sessions from one client address (default 100); more are refused with HTTP 429. */
  maxSessionsPerIp?: number
  /** Time from the upgrade to a finished Postgres startup (default 10 s). */
  handshakeTimeoutMs?: number
  /** Close a session with no traffic either way for this long (default 15 min; 0: never). */
  idleTimeoutMs?: number
  /** Resolves a host name to its addresses (default: the system resolver). */
  lookup?: (host: string) => Promise<string[]>
  /** POST /sql: Neon's SQL-over-HTTP protocol, on the warm backends sessions use too (default on); false: off. */
  sql?: false | Pick<SqlOptions, 'maxBodyBytes' | 'maxResponseBytes' | 'statementTimeoutMs' | 'maxRequests' | 'maxRequestsPerIp' | 'readTimeoutMs' | 'authToken' | 'applicationName'> & { pool?: SqlPoolOptions }
  /** Called once per /sql request; never given passwords, queries or parameters. */
  sqlLog?: (entry: SqlLog) => void
  /**
   * Serve /metrics and /healthz on `proxy.admin` only (listen on it yourself), not on the public
   * listener, where they would tell anyone the proxy's load and its upstream's health. Default
   * false: the public listener serves /healthz without naming the upstream, and /metrics (which
   * names upstreams, roles and databases) only to this machine.
   */
  adminApart?: boolean
  /** Called once per ended session; never given passwords or payloads. */
  log?: (entry: SessionLog) => void
  /** Called once per refused WebSocket upgrade (a route, an origin or an address not served, a limit), with the reason the client is sent. */
  refusalLog?: (entry: UpgradeRefusal) => void
  /** Warm backends for sessions whose login the proxy runs, and for /sql (default on; see proxy/pool/backends.ts). */
  pool?: PoolOptions
  /**
   * Logins by signed token instead of password (WebSocket sessions and /sql): verified with the
   * issuer's JWKS or a secret, as one of `roles`, whose passwords come from `passfile`. Needs
   * `edgepg-proxy setup-auth` on the database (proxy/auth/setup.ts). Default: none.
   */
  tokens?: TokenLoginOptions
  /** Hot standbys of `upstream` (--replica): transaction mode's reads may go there (proxy/replicas/). */
  replicas?: ReplicaOptions
  /**
   * Load balancers in front (CIDR ranges, or addresses): from a peer in them the client's address is
   * taken from its PROXY protocol header (v1 or v2, HAProxy's send-proxy), else from X-Forwarded-For,
   * for per-IP limits, logs and metrics. Never from any other peer. Default: none.
   */
  trustProxy?: string[]
  /** A worker of `--workers n` (proxy/cluster/): the limits counted for the whole proxy, and its metrics. */
  cluster?: ClusterLink
}

export type { SessionLog, UpstreamTls, SqlLog, UpgradeRefusal }

export interface Proxy {
  server: Server
  /** Serves /metrics and /healthz (and nothing else): for a listener apart from the public one (`adminApart`). */
  admin: Server
  listen(port?: number, host?: string): Promise<AddressInfo>
  /**
   * Stops accepting, lets sessions end by themselves for up to `graceMs`, then closes the rest with
   * WebSocket code 1001 (their clients see "edgepg-proxy is shutting down"). `handover`: others
   * accept on the same port meanwhile (a worker being replaced), so the admin listener closes at once
   * too, and connections already accepted are answered as usual rather than refused.
   */
  close(graceMs?: number, o?: { handover?: boolean }): Promise<void>
  /** Serves a new certificate and key from now on; running sessions keep theirs. */
  setTls(tls: { cert: string | Buffer; key: string | Buffer }): void
  /** Sessions open right now. */
  readonly sessionCount: number
  /** Prometheus metrics, also served at GET /metrics. */
  readonly metrics: Metrics
}

/** --workers: each key's sessions listen through the primary's one backend (proxy/cluster/listening.ts). */
const listenThrough = (cluster?: ClusterLink) => cluster && ((key: string, events: ListenerEvents) => cluster.listening.through(key, events))

/** A request's path: cut at the query, cheaply (requests are mostly origin-form); URL for the rest. */
function pathOf(url = '/'): string {
  if (url[0] !== '/') return new URL(url, 'http://proxy').pathname
  const query = url.indexOf('?')
  return query < 0 ? url : url.slice(0, query)
}

export function createProxy(options: ProxyOptions): Proxy {
  const upstreams = new Upstreams(options.upstream, options.allow, options.lookup)
  const { upstream } = upstreams
  // --pool-size bounds a key's backends: all of them in transaction mode, where they are all idle at
  // times; in session mode those kept idle, and /sql's at once (so that none it gives back is closed).
  const size = options.pool?.size ?? 20
  const poolOptions = { keepWarmMs: 3_600_000, ...options.pool, maxIdlePerKey: options.pool?.maxIdlePerKey ?? size }
  const pool = new BackendPool({ ...poolOptions, hmacKey: options.cluster?.poolSecret }, (event) => metrics.poolEvent(event))
  const budget = new BufferBudget(options.maxClientBufferBytes ?? 256 << 20, options.maxMessageBytes ?? 64 << 20)
  const metrics = createMetrics(() => ({ pool: pool.size, logins: logins.counts, buffered: budget.total, lending: lenders?.counts ?? { lent: 0, waiting: 0, listening: 0 }, keys: lenders?.keys ?? [] }), options.cluster?.metrics)
  const handshakeTimeoutMs = options.handshakeTimeoutMs ?? 10_000
  const { mode = 'transaction', enabled = true, timeoutMs = 5000, statements = 100, maxLifetimeMs: lifetimeMs = 30 * 60_000, reader = read } = options.pool ?? {}
  // No one client, and no sessions that keep state, take every backend of a key: unpinned work always has some,
  // and others' sessions go first once a client holds a quarter (the share orders the line; it idles no backend).
  const places: PlacesOf = options.cluster?.places ?? localPlaces
  const shares = { perClient: options.pool?.maxPerClient ?? Math.ceil(size / 4), pinned: options.pool?.maxPinned ?? pinnedCap(size) }
  const lenders = mode === 'transaction' && enabled ? new Lenders(pool, { size, timeoutMs, statements, lifetimeMs, reader, shares, pins: places('pinned', shares.pinned), listenThrough: listenThrough(options.cluster) }, metrics.lending, options.cluster?.moves) : undefined
  const tokens = options.tokens && new TokenLogins(options.tokens)
  const replicas = options.replicas?.addresses.length && lenders ? new Replicas(options.replicas, metrics.replicas) : undefined
  const addresses = new ClientAddresses(options.trustProxy ?? [])
  const clientAddress = (req: http.IncomingMessage) => addresses.of(req.socket, req.headers)
  const logins = new LoginGate(options.maxLogins ?? 64, options.maxLoginsPerIp ?? 8, places)
  const signals = new Signals(options.cluster?.index ?? 0, options.cluster?.signal)
  if (options.cluster) options.cluster.onSignal = (m) => signals.hear(m)
  const listenPolicy = options.pool?.listenPolicy === undefined ? undefined : policyName(options.pool.listenPolicy)
  if (options.pool?.listenPolicy !== undefined && !listenPolicy) throw new Error(`edgepg-proxy: listenPolicy must name a function as schema.function, not "${options.pool.listenPolicy}"`)
  const routes = new WebSocketRoutes({
    ...options,
    upstreams,
    pool,
    metrics,
    budget,
    logins,
    cancels: new Cancels(pool, options.maxCancelsPerIp ?? 20, places),
    lenders,
    tokens,
    replicas,
    clientAddress,
    places,
    offload: options.authOffload !== false,
    handshakeTimeoutMs,
    idleInTransactionMs: options.pool?.idleInTransactionMs ?? 60_000,
    listenBuffer: options.pool?.listenBufferBytes,
    listenPolicy,
    signals,
    announce: options.cluster?.announce,
  })
  if (options.cluster) {
    options.cluster.onKey = (m) => routes.prelogin(m)
    options.cluster.onWanted = (key, from) => lenders?.wanted(key, from)
    options.cluster.onGiven = (m, socket) => (lenders ? lenders.received(m, socket) : socket?.destroy())
  }
  let draining = false
  const health = healthHandler(upstream, { draining: () => draining })
  const sql =
    options.sql === false
      ? undefined
      : sqlHandler({
          upstream,
          // The same rule as /v1 and /v2 (proxy/upstream/allowed.ts).
          isAllowed: (named, sentTo) => {
            const picked = upstreams.pick(named, sentTo)
            return picked ? upstreams.admit(picked) : false
          },
          allowedOrigins: options.allowedOrigins,
          upstreamTls: options.upstreamTls,
          backends: pool,
          lenders,
          replicas,
          tokens,
          clientAddress,
          allowInsecurePasswords: options.allowInsecurePasswords,
          budget,
          log: options.sqlLog,
          places,
          ...options.sql,
          pool: { max: size, ...options.sql?.pool },
        })
  /** Whether a request on the public listener comes from this machine: its TCP peer, its declared client, and no forwarder in between. */
  const fromHere = (req: http.IncomingMessage) =>
    isLoopback(req.socket.remoteAddress ?? '') && isLoopback(clientAddress(req)) && !req.headers['x-forwarded-for'] && !req.headers.forwarded
  /** `open`: the public listener, where nothing names an upstream, role or database to a stranger. */
  const onAdmin = (req: http.IncomingMessage, res: http.ServerResponse, path = pathOf(req.url), open = false): boolean => {
    if (path === '/healthz') return health(req, res, !open), true
    if (path !== '/metrics') return false
    if (!open || fromHere(req)) return void metrics.handle(req, res), true
    res.writeHead(403, { 'content-type': 'text/plain' })
    res.end('edgepg-proxy: /metrics is served to this machine only; serve it elsewhere with --admin-listen\n')
    return true
  }
  const admin = http.createServer((req, res) => {
    if (onAdmin(req, res)) return
    res.writeHead(404, { 'content-type': 'text/plain' })
    res.end('edgepg-proxy admin: GET /metrics or /healthz\n')
  })
  /** A handover under way (see close): each response closes its connection after it. */
  let handingOver = false
  const onRequest = (req: http.IncomingMessage, res: http.ServerResponse) => {
    if (handingOver) res.setHeader('connection', 'close')
    const path = pathOf(req.url)
    if (!options.adminApart && onAdmin(req, res, path, true)) return
    if (path === '/sql' && sql) return sql.handle(req, res)
    // Why an upgrade here is refused, readable by any page (Routes.answer).
    const [status, reason] = routes.answer(req)
    res.writeHead(status, { 'content-type': 'text/plain', 'access-control-allow-origin': '*', ...(status === 426 && { upgrade: 'websocket' }) })
    res.end(`${reason}\n`)
  }
  const server: Server = options.tls ? https.createServer({ ...options.tls, handshakeTimeout: handshakeTimeoutMs }, onRequest) : http.createServer(onRequest)
  // A client that never finishes its HTTP request (or TLS handshake) is dropped on the same clock.
  const unanswered = new WeakMap<Duplex, NodeJS.Timeout>()
  const answered = (socket: Duplex) => clearTimeout(unanswered.get(socket))
  /** Connections still speaking HTTP (not yet upgraded). */
  const httpSockets = new Set<Duplex>()
  server.on(options.tls ? 'secureConnection' : 'connection', (socket: Duplex) => {
    unanswered.set(socket, setTimeout(() => socket.destroy(), handshakeTimeoutMs).unref())
    httpSockets.add(socket)
    socket.once('close', () => (answered(socket), httpSockets.delete(socket)))
  })
  server.on('request', (req) => answered(req.socket))
  server.on('upgrade', (req, socket, head) => {
    answered(socket)
    httpSockets.delete(socket)
    routes.handle(req, socket, head)
  })

  // Behind trusted balancers, a PROXY header is read off each of their connections before HTTP (or TLS) sees it.
  const front = addresses.any ? net.createServer((socket) => addresses.take(socket, (s) => server.emit('connection', s), handshakeTimeoutMs)) : server
  return {
    server,
    admin,
    async listen(port = 0, host = '127.0.0.1') {
      await warmUp()
      return new Promise((resolve, reject) => {
        front.once('error', reject)
        front.listen(port, host, () => {
          front.off('error', reject)
          resolve(front.address() as AddressInfo)
        })
      })
    },
    metrics,
    get sessionCount() {
      return routes.count
    },
    setTls(tls) {
      ;(server as https.Server).setSecureContext({ ...tls })
    },
    async close(graceMs = 0, { handover = false } = {}) {
      const deadline = Date.now() + graceMs
      const left = () => Math.max(0, deadline - Date.now())
      // (net's close: it stops accepting, and leaves the connections to what follows.)
      const stopped = new Promise<void>((resolve) => net.Server.prototype.close.call(front, () => resolve()))
      if (handover) {
        if (admin.listening) admin.close()
        // What this process accepted is its own to answer, in the grace period: upgrades as usual, and
        // requests on kept-alive connections, each response then closing its connection (closing an idle
        // one could fail a request already on its way).
        handingOver = true
        while (httpSockets.size && left()) await new Promise((r) => setTimeout(r, 20))
      }
      draining = true
      server.closeIdleConnections()
      const sqlClosed = sql?.close(left())
      await routes.close(left())
      pool.close()
      lenders?.close()
      await sqlClosed
      server.closeAllConnections()
      await stopped
      admin.closeAllConnections()
      if (admin.listening) await new Promise((resolve) => admin.close(resolve))
    },
  }
}

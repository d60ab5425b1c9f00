import { later } from './positions'

/** What edgepg uses of a WebSocket: the browser API, as the global one and Node's `ws` offer it. */
export interface WebSocketLike {
  readonly readyState: number
  binaryType: string
  close(code?: number, reason?: string): void
  send(data: any): void
  addEventListener(type: 'open' | 'message' | 'close' | 'error', listener: (this: WebSocketLike, ev: any) => any, options?: any): void
}

/** A WebSocket constructor (the global one, or `ws` in Node). */
export type WebSocketConstructor = new (...args: any[]) => WebSocketLike

export interface EdgeConfig {
  /** WebSocket implementation. Defaults to `globalThis.WebSocket`; pass `ws` in Node < 22. */
  webSocketConstructor?: WebSocketConstructor
  /**
   * Where to open the WebSocket for a Postgres `host:port`. A string is the proxy's address
   * (`proxy.example.com/v1`), to which `?address=host:port` is appended; a function returns the
   * whole address. Either may include `ws://` or `wss://`; otherwise `useSecureWebSocket` picks
   * (by default `ws://` for this machine, `wss://` for any other).
   * Default: `(host) => host + '/v2'`, the route edgepg-proxy (and Neon) serve.
   */
  wsProxy?: string | ((host: string, port: number) => string)
  /**
   * `wss://` (true) or `ws://` (false) when `wsProxy` has no scheme. Default: `ws://` to this machine
   * (localhost, 127.x.x.x, [::1]: edgepg-proxy there serves plain WebSockets), `wss://` elsewhere.
   */
  useSecureWebSocket?: boolean
  /** Send all writes made in one tick as one WebSocket message, flushed on a microtask. Default true. */
  coalesceWrites?: boolean
  /**
   * Let edgepg-proxy authenticate with Postgres for this client (default true): the password
   * travels to the proxy (inside the WebSocket upgrade, over wss:// or to loopback only) and the
   * proxy answers whatever Postgres asks, next to the database. `false`: the proxy relays the
   * login untouched and the client authenticates with Postgres itself (SCRAM end to end), so the
   * proxy never sees the password; it costs the round trips of the auth exchange.
   */
  authOffload?: boolean
  /**
   * Against a server that does not take the login from the upgrade (a plain WebSocket relay, Neon's
   * proxy): send the password right behind the StartupMessage, without waiting for Postgres to ask.
   * Safe only where the server asks for a cleartext password. `undefined` (default): for Neon hosts;
   * `'password'`: always; `false`: never. connect() resolves after ReadyForQuery either way.
   */
  pipelineConnect?: 'password' | false
  /**
   * PEM of the CA(s) to trust for TLS to Postgres itself, inside the WebSocket (the proxy then
   * relays only ciphertext). Used when the connection asks for TLS (`ssl`, `sslmode`); `ssl.ca`
   * works too. Without it, `ssl`/`sslmode` asks edgepg-proxy to reach Postgres over TLS, verified
   * as pg would verify it (a server that does not take the login from the upgrade sets it aside).
   */
  rootCerts?: string
  /**
   * Send the SSLRequest and the TLS ClientHello together, one round trip fewer. Default: on when the
   * proxy announces SSLRequest handling (edgepg-proxy does); PostgreSQL ≤ 16 behind any other relay
   * hangs on it. PostgreSQL 17+ accepts it directly.
   */
  pipelineTLS?: boolean
  /**
   * Set pg's `ssl` (and `sslmode`) aside: no TLS to Postgres beyond the WebSocket's own. Neon's
   * default is true; edgepg's is false, so that `ssl` asks edgepg-proxy for TLS to Postgres.
   */
  forceDisablePgSSL?: boolean
}

/** Options only the global `config` (`neonConfig`) takes, under Neon's names. */
export interface GlobalConfig extends EdgeConfig {
  /** Where httpSql (neon()) and `queryViaHttp` POST by default: a URL, or a function of the host and port. */
  fetchEndpoint?: string | ((host: string, port: number | string, options?: { jwtAuth?: boolean }) => string)
  /** The `fetch` httpSql (neon()) uses by default. */
  fetchFunction?: (input: string, init: RequestInit) => Promise<Response>
  /** Every Pool's `queryViaHttp` default: pool.query() goes over HTTP where it needs no session. */
  poolQueryViaFetch?: boolean
  /** Taken for Neon's sake, without effect: edgepg brings its own TLS, always sends SNI, never warns, and fetch reuses connections. */
  subtls?: unknown
  disableSNI?: boolean
  disableWarningInBrowsers?: boolean
  fetchConnectionCache?: boolean
  /**
   * The latest write-ahead-log position this process has seen, by database: what edgepg-proxy
   * told it after each transaction and read. Every Client, Pool and httpSql request sends it, and the
   * proxy serves a read from a replica only once the replica has replayed it, so reads never go back
   * in time. Carry it across requests and processes (a cookie, a header): setting it keeps, for
   * each database, the later of the two positions.
   */
  lastWrite?: string
}

/** Cloudflare Workers, where a connection serves only the request that opened it. */
export const IN_WORKERS = (globalThis as any).navigator?.userAgent === 'Cloudflare-Workers'

/** Global defaults; any of them but GlobalConfig's own can be overridden per Client or Pool. Also exported as `neonConfig`. */
export const config: GlobalConfig = {
  webSocketConstructor: undefined,
  wsProxy: undefined,
  useSecureWebSocket: undefined,
  coalesceWrites: true,
  authOffload: true,
  pipelineConnect: undefined,
  rootCerts: undefined,
  pipelineTLS: undefined,
  forceDisablePgSSL: false,
}

let lastWrite = ''
/** Bumped as lastWrite moves on: a connection sends it again when this differs from what it sent. */
export let lastWriteVersion = 0
Object.defineProperty(config, 'lastWrite', {
  enumerable: true,
  get: () => lastWrite,
  set: (text: string | undefined) => {
    const next = later(lastWrite, text)
    if (next !== lastWrite) (lastWrite = next), lastWriteVersion++
  },
})

export const configKeys = ['webSocketConstructor', 'wsProxy', 'useSecureWebSocket', 'coalesceWrites', 'authOffload', 'pipelineConnect', 'rootCerts', 'pipelineTLS', 'forceDisablePgSSL'] as const

/** An option's value for one client: its own if given, else the global one. */
export const setting = <K extends keyof EdgeConfig>(own: EdgeConfig, key: K): EdgeConfig[K] => (own[key] !== undefined ? own[key] : config[key])

/**
 * The WebSocket subprotocol edgepg offers. A proxy that selects it took the login offered next to
 * it (`LOGIN_PREFIX` + base64url of the client's first flight) and answers with Postgres's reply.
 */
export const SUBPROTOCOL = 'edgepg.v2'
/**
 * Offered ahead of SUBPROTOCOL: a proxy that selects it also takes a cancel on the session's own
 * WebSocket, a text frame `cancel <n>` (n: the ReadyForQuery messages the client has read since its
 * login), acted on only while no later ReadyForQuery has gone out, so it never reaches a later query.
 */
export const SUBPROTOCOL_CANCEL = 'edgepg.v3'
/**
 * Offered ahead of SUBPROTOCOL_CANCEL, and meaning it too: the client tells the positions it has
 * seen (config.lastWrite) in a message of the proxy's own, `positionMessage`, at the head of the
 * WebSocket message that carries what must not go behind them, and the proxy tells each new one in
 * a text frame `seen <position>`, ahead of the ReadyForQuery that ends what it was learnt from.
 */
export const SUBPROTOCOL_POSITIONS = 'edgepg.v5'
/**
 * As SUBPROTOCOL_POSITIONS, with the client's positions in a text frame `after <positions>` of
 * their own: what drivers and proxies before edgepg.v5 speak. (A second message sent right behind
 * the first waits for its ACK, ~40 ms, where the runtime leaves Nagle's algorithm on, as Deno does.)
 */
export const SUBPROTOCOL_POSITIONS_FRAMED = 'edgepg.v4'
/** Type of the client's position message (SUBPROTOCOL_POSITIONS): a byte no Postgres frontend message has. */
export const POSITION_MESSAGE = 0x40 // '@'
/** The positions as a message in the client's stream: '@', Int32 length, the text, NUL. */
export function positionMessage(positions: string): Buffer {
  const text = Buffer.from(positions, 'latin1')
  const msg = Buffer.alloc(6 + text.length)
  msg[0] = POSITION_MESSAGE
  msg.writeInt32BE(5 + text.length, 1)
  text.copy(msg, 5)
  return msg
}
/** The text frame a client sends to cancel its running statement (SUBPROTOCOL_CANCEL). */
export const cancelFrame = (readies: number) => `cancel ${readies}`
export const LOGIN_PREFIX = 'edgepg.login.'
/** Longest login offered in the upgrade (base64url characters); a longer first flight goes in band. */
export const MAX_LOGIN_CHARS = 8192
/**
 * A login packet of edgepg's own, shaped like a StartupMessage (Int32 length, Int32 code, name and
 * value C strings, a NUL): edgepg-proxy is to reach Postgres over TLS, as pg's `ssl` asks, before
 * the StartupMessage (or CancelRequest) behind it goes on. Names: `sslmode` (require, verify-ca,
 * verify-full), `sslnegotiation` (postgres, direct), `servername`. It never reaches Postgres.
 */
export const UPSTREAM_TLS_REQUEST = (1234 << 16) | 5690
/**
 * In a login, in place of the PasswordMessage: a message of edgepg's own, shaped like one ('j',
 * Int32 length, a C string), carrying the client's `authToken`. edgepg-proxy verifies it and logs in
 * as the role it names; it never reaches Postgres.
 */
export const TOKEN_MESSAGE = 0x6a

/** Global config overlaid with the keys a client was given explicitly. */
export function resolveConfig(own: EdgeConfig) {
  const merged = { ...config }
  for (const key of configKeys) if (own[key] !== undefined) (merged as any)[key] = own[key]
  const webSocketConstructor = merged.webSocketConstructor ?? (globalThis as any).WebSocket
  if (!webSocketConstructor) {
    throw new Error(
      'edgepg: no WebSocket implementation found. In Node < 22 install `ws` and set ' +
        "`config.webSocketConstructor = WebSocket` (import { WebSocket } from 'ws')."
    )
  }
  return { ...merged, webSocketConstructor, coalesceWrites: merged.coalesceWrites !== false }
}

/** Said when the default endpoint (Neon's: the proxy on the Postgres host itself) fails; `unset` says what was not set. */
export const defaultEndpointHint = (unset = 'config.wsProxy is not set') =>
  `(${unset}, so edgepg tried Neon's address for this host: say where your edgepg-proxy listens, e.g. config.wsProxy = '127.0.0.1:8080/v2')`

/** The WebSocket URL for a Postgres host and port under the given config. */
export function webSocketUrl(host: string, port: number, cfg: EdgeConfig): string {
  const { wsProxy } = cfg
  const address =
    typeof wsProxy === 'function' ? wsProxy(host, port)
    : typeof wsProxy === 'string' ? `${wsProxy}${wsProxy.includes('?') ? '&' : '?'}address=${encodeURIComponent(`${host}:${port}`)}`
    : `${host}/v2`
  if (/^wss?:\/\//i.test(address)) return address
  return `${cfg.useSecureWebSocket ?? !onThisMachine(address) ? 'wss' : 'ws'}://${address}`
}

/** Whether an address (no scheme) is on this machine: localhost, 127.0.0.0/8 or [::1], then a port or a path. */
export const onThisMachine = (address: string) => /^(localhost|127\.[\d.]+|\[::1\])([:/?]|$)/i.test(address)

/** The POST /sql endpoint edgepg-proxy serves next to the WebSocket address a client would use for `host:port` (its `/v2` made `/sql`). */
export function sqlEndpoint(host: string, port: number, cfg: EdgeConfig): string {
  const url = new URL(webSocketUrl(host, port, cfg).replace(/^ws/i, 'http'))
  return url.origin + url.pathname.replace(/[^/]*$/, 'sql')
}

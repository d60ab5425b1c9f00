/** A WebSocket constructor with the browser API (the global one, or `ws` in Node). */
export type WebSocketConstructor = new (url: string, protocols?: string | string[]) => WebSocket

export interface EdgeConfig {
  /** WebSocket implementation. Defaults to `globalThis.WebSocket`; pass `ws` in Node < 22. */
  webSocketConstructor?: WebSocketConstructor
  /**
   * Where to open the WebSocket for a Postgres `host:port`. A string is the proxy's address
   * (`proxy.example.com/v1`), to which `?address=host:port` is appended; a function returns the
   * whole address. Either may include `ws://` or `wss://`; otherwise `useSecureWebSocket` picks.
   * Default: `(host) => host + '/v2'`, the route edgepg-proxy (and Neon) serve.
   */
  wsProxy?: string | ((host: string, port: number) => string)
  /** `wss://` (true, default) or `ws://` when `wsProxy` has no scheme. */
  useSecureWebSocket?: boolean
  /** Send all writes made in one tick as one WebSocket message, flushed on a microtask. Default true. */
  coalesceWrites?: boolean
  /**
   * Send the password (and the first queries) right behind the StartupMessage, without waiting
   * for Postgres to ask: new connection + first query in one flight after the WebSocket opens.
   * Safe only where the server asks for a cleartext password. `undefined` (default): on when the
   * proxy announces auth offload (edgepg-proxy does) or for Neon hosts; `'password'`: always on;
   * `false`: off.
   */
  pipelineConnect?: 'password' | false
  /**
   * PEM of the CA(s) to trust for TLS to Postgres itself, inside the WebSocket (the proxy then
   * relays only ciphertext). Used when the connection asks for TLS (`ssl`, `sslmode`); `ssl.ca`
   * works too. Without it, `ssl`/`sslmode` is set aside and the channel relies on wss://.
   */
  rootCerts?: string
  /**
   * Send the SSLRequest and the TLS ClientHello together, one round trip fewer. Default: on when the
   * proxy announces SSLRequest handling (edgepg-proxy does); PostgreSQL ≤ 16 behind any other relay
   * hangs on it. PostgreSQL 17+ accepts it directly.
   */
  pipelineTLS?: boolean
}

/** Global defaults; any of them can be overridden per Client or Pool. */
export const config: EdgeConfig = {
  webSocketConstructor: undefined,
  wsProxy: undefined,
  useSecureWebSocket: true,
  coalesceWrites: true,
  pipelineConnect: undefined,
  rootCerts: undefined,
  pipelineTLS: undefined,
}

export const configKeys = ['webSocketConstructor', 'wsProxy', 'useSecureWebSocket', 'coalesceWrites', 'pipelineConnect', 'rootCerts', 'pipelineTLS'] as const

/** An option's value for one client: its own if given, else the global one. */
export const setting = <K extends keyof EdgeConfig>(own: EdgeConfig, key: K): EdgeConfig[K] => (own[key] !== undefined ? own[key] : config[key])

/**
 * The WebSocket subprotocol edgepg offers. A proxy that selects it announces that it offloads
 * auth (asks for a cleartext password, authenticates upstream itself) and handles SSLRequest.
 */
export const SUBPROTOCOL = 'edgepg.v1'

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
  return { ...merged, webSocketConstructor, useSecureWebSocket: merged.useSecureWebSocket !== false, coalesceWrites: merged.coalesceWrites !== false }
}

/** The WebSocket URL for a Postgres host and port under the given config. */
export function webSocketUrl(host: string, port: number, cfg: EdgeConfig): string {
  const { wsProxy } = cfg
  const address =
    typeof wsProxy === 'function' ? wsProxy(host, port)
    : typeof wsProxy === 'string' ? `${wsProxy}${wsProxy.includes('?') ? '&' : '?'}address=${encodeURIComponent(`${host}:${port}`)}`
    : `${host}/v2`
  if (/^wss?:\/\//i.test(address)) return address
  return `${cfg.useSecureWebSocket === false ? 'ws' : 'wss'}://${address}`
}

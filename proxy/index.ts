import http, { type Server } from 'node:http'
import https from 'node:https'
import type { AddressInfo } from 'node:net'
import { WebSocketServer, type WebSocket } from 'ws'
import { formatHostPort, parseHostPort, type HostPort } from './address'
import { runSession, type SessionLog, type UpstreamTls } from './session'
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
  /** Called once per ended session; never given passwords or payloads. */
  log?: (entry: SessionLog) => void
}

export type { SessionLog, UpstreamTls }

export interface Proxy {
  server: Server
  listen(port?: number, host?: string): Promise<AddressInfo>
  close(): Promise<void>
}

const isLoopback = (address: string) => /^(127\.|::1$|::ffff:127\.)/.test(address)

export function createProxy(options: ProxyOptions): Proxy {
  const upstream = parseHostPort(options.upstream)
  const offload = options.authOffload !== false
  const allowed = new Set([upstream, ...(options.allow ?? []).map((a) => parseHostPort(a))].map(formatHostPort))
  // Selecting edgepg's subprotocol announces auth offload and SSLRequest handling. Any other
  // offered subprotocol is declined (ws would otherwise select the first one offered).
  const wss = new WebSocketServer({
    noServer: true,
    maxPayload: options.maxMessageBytes ?? 64 << 20,
    perMessageDeflate: false,
    handleProtocols: (offered) => (offload && offered.has(SUBPROTOCOL) ? SUBPROTOCOL : false),
  })
  const sessions = new Set<WebSocket>()

  const onRequest = (req: http.IncomingMessage, res: http.ServerResponse) => {
    res.writeHead(426, { 'content-type': 'text/plain', upgrade: 'websocket' })
    res.end('edgepg-proxy: connect with a WebSocket to /v1 or /v2\n')
  }
  const server: Server = options.tls ? https.createServer({ ...options.tls }, onRequest) : http.createServer(onRequest)

  server.on('upgrade', (req, socket, head) => {
    const refuse = (status: number, reason: string) => {
      socket.end(`HTTP/1.1 ${status} ${http.STATUS_CODES[status]}\r\nContent-Type: text/plain\r\nConnection: close\r\n\r\n${reason}\n`)
    }
    socket.on('error', () => socket.destroy())
    const url = new URL(req.url ?? '/', 'http://proxy')
    if (url.pathname !== '/v1' && url.pathname !== '/v2') return refuse(404, `no WebSocket route at ${url.pathname}; use /v1 or /v2`)
    let target: HostPort = upstream
    const address = url.searchParams.get('address')
    if (address) {
      try {
        target = parseHostPort(address)
      } catch (err) {
        return refuse(400, (err as Error).message)
      }
      if (!allowed.has(formatHostPort(target))) return refuse(403, `address ${address} is not an allowed upstream`)
    }
    const peer = req.socket.remoteAddress ?? '?'
    const passwordsAllowed = 'encrypted' in req.socket || isLoopback(peer) || options.allowInsecurePasswords === true
    wss.handleUpgrade(req, socket, head, (ws) => {
      sessions.add(ws)
      ws.once('close', () => sessions.delete(ws))
      runSession(ws, { target, peer, offload, passwordsAllowed, upstreamTls: options.upstreamTls, log: options.log })
    })
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
    close() {
      for (const ws of sessions) ws.terminate()
      const closed = new Promise<void>((resolve) => server.close(() => resolve()))
      server.closeAllConnections()
      return closed
    },
  }
}

import http, { type Server } from 'node:http'
import https from 'node:https'
import net from 'node:net'
import type { AddressInfo } from 'node:net'
import { WebSocketServer, type WebSocket, type RawData } from 'ws'
import { formatHostPort, parseHostPort, type HostPort } from './address'
import { ByteQueue, ProtocolError } from './bytes'
import { errorResponse, runStartup, UpstreamError } from './startup'
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
  /** Called once per ended session; never given passwords or payloads. */
  log?: (entry: SessionLog) => void
}

export interface SessionLog {
  peer: string
  upstream: string
  durationMs: number
  bytesIn: number
  bytesOut: number
  outcome: string
}

export interface Proxy {
  server: Server
  listen(port?: number, host?: string): Promise<AddressInfo>
  close(): Promise<void>
}

/** Bytes queued on a client's WebSocket past which we stop reading from Postgres. */
const HIGH_WATER = 1 << 20
/** Bytes a client may pipeline behind its password before we stop reading until auth is done. */
const MAX_HELD_BYTES = 1 << 20

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
    wss.handleUpgrade(req, socket, head, (ws) => relay(ws, target, peer, passwordsAllowed))
  })

  function relay(ws: WebSocket, target: HostPort, peer: string, passwordsAllowed: boolean) {
    sessions.add(ws)
    const started = Date.now()
    const upstreamName = formatHostPort(target)
    let bytesIn = 0
    let bytesOut = 0
    let outcome = 'closed by client'
    let connected = false
    /** Startup is over (or left to Postgres): bytes flow straight through. */
    let relaying = !offload
    let refused = false
    const fromClient = new ByteQueue()
    const fromUpstream = new ByteQueue()
    const tcp = net.connect({ host: target.host, port: target.port, noDelay: true }, () => (connected = true))

    // Ends the session from our side. The client may be paused by backpressure; read (and drop)
    // what it still sends, or its close reply would wait behind that until ws's 30 s close timeout.
    const closeClient = (code: number, reason?: string) => {
      ws.resume()
      ws.close(code, reason)
    }
    const toUpstream = (chunk: Buffer) => {
      if (!tcp.write(chunk)) ws.pause()
    }
    // Postgres → client, pausing Postgres while the client is slow to read.
    // Only the chunk that crosses the mark gets a callback: nothing is sent after it while paused,
    // so once it is written the queue has drained.
    const resume = () => tcp.resume()
    const toClient = (chunk: Buffer) => {
      bytesOut += chunk.length
      const congested = ws.bufferedAmount + chunk.length > HIGH_WATER
      ws.send(chunk, congested ? resume : undefined)
      if (congested) tcp.pause()
    }

    // Client → Postgres. Frames that arrive before the TCP connect are queued by the socket.
    ws.on('message', (data: RawData, isBinary: boolean) => {
      if (ws.readyState !== ws.OPEN || tcp.destroyed) return // closing: nothing more to relay
      if (!isBinary) {
        outcome = 'refused a text frame'
        return closeClient(1003, 'edgepg-proxy: expected binary frames')
      }
      const chunk = data as Buffer
      bytesIn += chunk.length
      if (relaying) return toUpstream(chunk)
      if (refused) return // Postgres said no; it is closing, and gets nothing more
      fromClient.push(chunk)
      if (fromClient.length > MAX_HELD_BYTES) ws.pause() // pipelined queries wait for upstream auth
    })
    tcp.on('drain', () => ws.resume())
    tcp.on('data', (chunk) => (relaying ? toClient(chunk) : fromUpstream.push(chunk)))

    if (offload) runStartup({ client: fromClient, upstream: fromUpstream, toClient, toUpstream, passwordsAllowed }).then(
      (result) => {
        if (result.kind === 'refused') {
          outcome = `refused by Postgres: ${result.code} ${result.message}`
          refused = true
          fromClient.rest() // queries held for a session that will not be: dropped
          return
        }
        relaying = true
        const held = fromClient.rest()
        if (held.length) toUpstream(held)
        const early = fromUpstream.rest()
        if (early.length) toClient(early)
        ws.resume()
      },
      (err: Error) => {
        if (!(err instanceof ProtocolError || err instanceof UpstreamError)) return // the session closed first
        outcome = `startup refused: ${err.message}`
        toClient(errorResponse(err instanceof ProtocolError ? err.code : '08P01', err.message))
        closeClient(1000)
      }
    )

    tcp.on('error', (err: NodeJS.ErrnoException) => {
      outcome = connected ? `upstream error: ${err.code ?? err.message}` : `upstream ${upstreamName} unreachable: ${err.code ?? err.message}`
      closeClient(1011, `edgepg-proxy: ${outcome}`.slice(0, 123))
    })
    tcp.on('close', () => {
      fromUpstream.fail(new Error('upstream closed'))
      if (ws.readyState === ws.OPEN) {
        if (outcome === 'closed by client') outcome = 'closed by upstream'
        closeClient(1000)
      }
    })
    ws.on('close', () => {
      fromClient.fail(new Error('client closed'))
      tcp.destroy()
      sessions.delete(ws)
      options.log?.({ peer, upstream: upstreamName, durationMs: Date.now() - started, bytesIn, bytesOut, outcome })
    })
    ws.on('error', (err) => {
      outcome = `client error: ${err.message}`
      tcp.destroy()
    })
  }

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

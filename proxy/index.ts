import http, { type Server } from 'node:http'
import net from 'node:net'
import type { AddressInfo } from 'node:net'
import { WebSocketServer, type WebSocket, type RawData } from 'ws'
import { formatHostPort, parseHostPort, type HostPort } from './address'

export interface ProxyOptions {
  /** The Postgres this proxy relays to: `host:port`. */
  upstream: string
  /** Further `host:port` upstreams a client may pick with `?address=`; matched exactly. */
  allow?: string[]
  /** Largest WebSocket message accepted from a client, in bytes. Default 64 MiB. */
  maxMessageBytes?: number
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

export function createProxy(options: ProxyOptions): Proxy {
  const upstream = parseHostPort(options.upstream)
  const allowed = new Set([upstream, ...(options.allow ?? []).map((a) => parseHostPort(a))].map(formatHostPort))
  // handleProtocols: a plain relay speaks no subprotocol, so it selects none (ws would otherwise
  // select the first one offered, e.g. edgepg's `edgepg.v1`, which announces auth offload).
  const wss = new WebSocketServer({ noServer: true, maxPayload: options.maxMessageBytes ?? 64 << 20, perMessageDeflate: false, handleProtocols: () => false })
  const sessions = new Set<WebSocket>()

  const server = http.createServer((req, res) => {
    res.writeHead(426, { 'content-type': 'text/plain', upgrade: 'websocket' })
    res.end('edgepg-proxy: connect with a WebSocket to /v1 or /v2\n')
  })

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
    wss.handleUpgrade(req, socket, head, (ws) => relay(ws, target, req.socket.remoteAddress ?? '?'))
  })

  function relay(ws: WebSocket, target: HostPort, peer: string) {
    sessions.add(ws)
    const started = Date.now()
    const upstreamName = formatHostPort(target)
    let bytesIn = 0
    let bytesOut = 0
    let outcome = 'closed by client'
    let connected = false
    const tcp = net.connect({ host: target.host, port: target.port, noDelay: true }, () => (connected = true))

    // Ends the session from our side. The client may be paused by backpressure; read (and drop)
    // what it still sends, or its close reply would wait behind that until ws's 30 s close timeout.
    const closeClient = (code: number, reason?: string) => {
      ws.resume()
      ws.close(code, reason)
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
      if (!tcp.write(chunk)) ws.pause()
    })
    tcp.on('drain', () => ws.resume())

    // Postgres → client, pausing Postgres while the client is slow to read.
    tcp.on('data', (chunk) => {
      bytesOut += chunk.length
      ws.send(chunk, () => {
        if (tcp.isPaused() && ws.bufferedAmount < HIGH_WATER / 2) tcp.resume()
      })
      if (ws.bufferedAmount > HIGH_WATER) tcp.pause()
    })

    tcp.on('error', (err: NodeJS.ErrnoException) => {
      outcome = connected ? `upstream error: ${err.code ?? err.message}` : `upstream ${upstreamName} unreachable: ${err.code ?? err.message}`
      closeClient(1011, `edgepg-proxy: ${outcome}`.slice(0, 123))
    })
    tcp.on('close', () => {
      if (ws.readyState === ws.OPEN) {
        if (outcome === 'closed by client') outcome = 'closed by upstream'
        closeClient(1000)
      }
    })
    ws.on('close', () => {
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

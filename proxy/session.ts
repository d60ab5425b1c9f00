import net from 'node:net'
import tls from 'node:tls'
import type { WebSocket, RawData } from 'ws'
import { formatHostPort, type HostPort } from './address'
import { ByteQueue, ProtocolError } from './bytes'
import { errorResponse, runStartup, UpstreamError } from './startup'

/** TLS from the proxy to Postgres, as libpq's sslmode names it. */
export interface UpstreamTls {
  mode: 'require' | 'verify-ca' | 'verify-full'
  /** PEM of the CA(s) that signed Postgres's certificate (needed for verify-ca / verify-full). */
  ca?: string | Buffer
}

export interface SessionLog {
  peer: string
  upstream: string
  durationMs: number
  bytesIn: number
  bytesOut: number
  outcome: string
}

export interface SessionOptions {
  target: HostPort
  peer: string
  /** Ask the client for a cleartext password and authenticate upstream on its behalf. */
  offload: boolean
  /** Whether a cleartext password may cross the client's link. */
  passwordsAllowed: boolean
  upstreamTls?: UpstreamTls
  log?: (entry: SessionLog) => void
}

/** Bytes queued on a client's WebSocket past which we stop reading from Postgres. */
const HIGH_WATER = 1 << 20
/** Bytes a client may pipeline behind its password before we stop reading until auth is done. */
const MAX_HELD_BYTES = 1 << 20
const SSL_REQUEST = Buffer.from([0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f])

/**
 * One client's session: connects to Postgres, runs the startup phase (auth offload) unless told
 * not to, then relays bytes both ways with backpressure, and logs one line when it ends.
 */
export function runSession(ws: WebSocket, o: SessionOptions) {
  const started = Date.now()
  const upstreamName = formatHostPort(o.target)
  let bytesIn = 0
  let bytesOut = 0
  let outcome = 'closed by client'
  let connected = false
  /** Startup is over (or left to Postgres): bytes flow straight through. */
  let relaying = !o.offload
  let refused = false
  const fromClient = new ByteQueue()
  const fromUpstream = new ByteQueue()
  const tcp = net.connect({ host: o.target.host, port: o.target.port, noDelay: true }, () => (connected = true))
  /** Where Postgres's bytes come from and go to: the TCP socket, or TLS over it. */
  let up: net.Socket = tcp

  // Ends the session from our side. The client may be paused by backpressure; read (and drop)
  // what it still sends, or its close reply would wait behind that until ws's 30 s close timeout.
  const closeClient = (code: number, reason?: string) => {
    ws.resume()
    ws.close(code, reason)
  }
  const toUpstream = (chunk: Buffer) => {
    if (!up.write(chunk)) ws.pause()
  }
  // Only the chunk that crosses the mark gets a callback: nothing is sent after it while paused,
  // so once it is written the queue has drained.
  const resume = () => up.resume()
  const toClient = (chunk: Buffer) => {
    bytesOut += chunk.length
    const congested = ws.bufferedAmount + chunk.length > HIGH_WATER
    ws.send(chunk, congested ? resume : undefined)
    if (congested) up.pause()
  }
  const onUpstreamData = (chunk: Buffer) => (relaying ? toClient(chunk) : fromUpstream.push(chunk))

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
  tcp.on('data', onUpstreamData)

  /** SSLRequest, then TLS over the same socket; SCRAM can then bind to the channel (-PLUS). */
  async function secureUpstream(): Promise<tls.TLSSocket> {
    const { mode, ca } = o.upstreamTls!
    tcp.write(SSL_REQUEST)
    if ((await fromUpstream.read(1))[0] !== 0x53) throw new UpstreamError(`Postgres at ${upstreamName} does not accept TLS (upstream sslmode=${mode})`)
    tcp.off('data', onUpstreamData)
    const secure = tls.connect({
      socket: tcp,
      ca,
      servername: net.isIP(o.target.host) ? undefined : o.target.host,
      rejectUnauthorized: mode !== 'require',
      ...(mode === 'verify-ca' && { checkServerIdentity: () => undefined }),
    })
    await new Promise<void>((resolve, reject) => {
      secure.once('secureConnect', resolve)
      secure.once('error', (err) => reject(new UpstreamError(`TLS to Postgres at ${upstreamName} failed: ${err.message}`)))
    })
    secure.on('data', onUpstreamData)
    secure.on('drain', () => ws.resume())
    secure.on('error', () => {}) // reported through tcp's close
    up = secure
    return secure
  }

  if (o.offload) {
    runStartup({
      client: fromClient,
      upstream: fromUpstream,
      toClient,
      toUpstream,
      passwordsAllowed: o.passwordsAllowed,
      secureUpstream: o.upstreamTls && secureUpstream,
    }).then(
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
  }

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
    up.destroy()
    tcp.destroy()
    o.log?.({ peer: o.peer, upstream: upstreamName, durationMs: Date.now() - started, bytesIn, bytesOut, outcome })
  })
  ws.on('error', (err) => {
    outcome = `client error: ${err.message}`
    tcp.destroy()
  })
}

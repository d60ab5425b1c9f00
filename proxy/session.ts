import net from 'node:net'
import tls from 'node:tls'
import type { WebSocket, RawData } from 'ws'
import { formatHostPort, type HostPort } from './address'
import { ByteQueue, ProtocolError } from './bytes'
import { BackendKeyWatch, cancelRequest, errorResponse, runStartup, UpstreamError, type BackendKey } from './startup'

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
  /** The startup is done (or left to Postgres): the handshake timeout no longer applies. */
  onEstablished?: () => void
  /** Bytes moved, either way: the idle timeout starts again. */
  onActivity?: () => void
  /** The TCP connection to Postgres is up, after this many seconds. */
  onUpstreamConnect?: (seconds: number) => void
}

/** Bytes queued on a client's WebSocket past which we stop reading from Postgres. */
const HIGH_WATER = 1 << 20
/** Bytes a client may pipeline behind its password before we stop reading until auth is done. */
const MAX_HELD_BYTES = 1 << 20
const SSL_REQUEST = Buffer.from([0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f])
/** Terminate: a client that ends its session cleanly sends it last. */
const TERMINATE = Buffer.from([0x58, 0, 0, 0, 4])
/** How long a CancelRequest's own connection may take before it is given up. */
const CANCEL_TIMEOUT_MS = 5000

/**
 * One client's session: connects to Postgres, runs the startup phase (auth offload) unless told
 * not to, then relays bytes both ways with backpressure, and logs one line when it ends.
 *
 * A client that goes away without Terminate (its WebSocket dropped, or the proxy closing it) may
 * leave a query running, and PostgreSQL notices a closed socket only when it next reads or writes:
 * a backend in `pg_sleep(30)` would linger 30 s. So the session remembers the backend's cancel key
 * (BackendKeyData, watched for as it is relayed) and, before hanging up, sends a CancelRequest on a
 * connection of its own (over TLS when the session's is); the cancelled backend then finds the
 * socket closed and exits. The key is unknown when the client runs TLS inside the socket with
 * Postgres itself: such a backend runs its query to the end, unless the operator sets Postgres's
 * `client_connection_check_interval` (PostgreSQL 14+), which makes it check for a gone client.
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
  const connectStarted = performance.now()
  const tcp = net.connect({ host: o.target.address ?? o.target.host, port: o.target.port, noDelay: true }, () => {
    connected = true
    o.onUpstreamConnect?.((performance.now() - connectStarted) / 1000)
  })
  /** Where Postgres's bytes come from and go to: the TCP socket, or TLS over it. */
  let up: net.Socket = tcp
  /** Watches Postgres's first messages, while they are relayed, for the backend's cancel key. */
  let keyWatch = relaying ? new BackendKeyWatch() : undefined
  let backendKey: BackendKey | undefined
  /** Postgres hung up (or the socket broke): there is no backend left to cancel. */
  let upstreamGone = false
  /** The client's last message was Terminate: the backend is exiting by itself. */
  let clientTerminated = false

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
    o.onActivity?.()
    bytesOut += chunk.length
    const congested = ws.bufferedAmount + chunk.length > HIGH_WATER
    ws.send(chunk, congested ? resume : undefined)
    if (congested) up.pause()
  }
  const watchForKey = (chunk: Buffer) => {
    if (!keyWatch?.feed(chunk)) return
    backendKey = keyWatch.key
    keyWatch = undefined
  }
  const onUpstreamData = (chunk: Buffer) => {
    if (!relaying) return fromUpstream.push(chunk)
    if (keyWatch) watchForKey(chunk)
    toClient(chunk)
  }

  // Client → Postgres. Frames that arrive before the TCP connect are queued by the socket.
  ws.on('message', (data: RawData, isBinary: boolean) => {
    if (ws.readyState !== ws.OPEN || tcp.destroyed) return // closing: nothing more to relay
    if (!isBinary) {
      outcome = 'refused a text frame'
      return closeClient(1003, 'edgepg-proxy: expected binary frames')
    }
    const chunk = data as Buffer
    o.onActivity?.()
    bytesIn += chunk.length
    clientTerminated = chunk.length >= 5 && chunk.subarray(-5).equals(TERMINATE)
    if (relaying) return toUpstream(chunk)
    if (refused) return // Postgres said no; it is closing, and gets nothing more
    fromClient.push(chunk)
    if (fromClient.length > MAX_HELD_BYTES) ws.pause() // pipelined queries wait for upstream auth
  })
  tcp.on('drain', () => ws.resume())
  tcp.on('data', onUpstreamData)

  /** SSLRequest, then TLS over the same socket; SCRAM can then bind to the channel (-PLUS). */
  async function secureUpstream(): Promise<tls.TLSSocket> {
    const { mode } = o.upstreamTls!
    tcp.write(SSL_REQUEST)
    if ((await fromUpstream.read(1))[0] !== 0x53) throw new UpstreamError(`Postgres at ${upstreamName} does not accept TLS (upstream sslmode=${mode})`)
    tcp.off('data', onUpstreamData)
    const secure = upstreamTlsOver(tcp)
    await new Promise<void>((resolve, reject) => {
      secure.once('secureConnect', resolve)
      secure.once('error', (err) => reject(new UpstreamError(`TLS to Postgres at ${upstreamName} failed: ${err.message}`)))
    })
    secure.on('data', onUpstreamData)
    secure.on('drain', () => ws.resume())
    secure.on('error', () => {}) // reported through tcp's close
    secure.on('end', () => (upstreamGone = true))
    up = secure
    return secure
  }

  /** TLS to Postgres over `socket` (after its SSLRequest was accepted), as the operator configured it. */
  function upstreamTlsOver(socket: net.Socket): tls.TLSSocket {
    const { mode, ca } = o.upstreamTls!
    return tls.connect({
      socket,
      ca,
      servername: net.isIP(o.target.host) ? undefined : o.target.host,
      rejectUnauthorized: mode !== 'require',
      ...(mode === 'verify-ca' && { checkServerIdentity: () => undefined }),
    })
  }

  /**
   * Asks Postgres to cancel whatever the backend runs, as libpq's PQcancel does: a CancelRequest on
   * a new connection to the same upstream (TLS first, with its own SSLRequest, when the session's
   * connection is TLS). Postgres closes that connection once it has read the request; it is cut
   * after CANCEL_TIMEOUT_MS whatever happens. Nothing is reported: it is best effort.
   */
  function sendCancel(key: BackendKey) {
    const packet = cancelRequest(key)
    const socket = net.connect({ host: o.target.address ?? o.target.host, port: o.target.port, noDelay: true })
    const timeout = setTimeout(() => socket.destroy(), CANCEL_TIMEOUT_MS).unref()
    socket.on('close', () => clearTimeout(timeout))
    socket.on('error', () => socket.destroy())
    if (up === tcp) {
      socket.write(packet)
      return
    }
    socket.write(SSL_REQUEST)
    socket.once('data', (answer: Buffer) => {
      if (answer[0] !== 0x53) return socket.destroy() // never in clear where the session used TLS
      const secure = upstreamTlsOver(socket)
      secure.on('error', () => socket.destroy())
      secure.once('secureConnect', () => secure.write(packet))
      secure.on('close', () => socket.destroy())
    })
  }

  /**
   * The client is gone: if it left without Terminate while Postgres is still there, cancel what
   * the backend may be running (so it finds out now, not at its next write), then hang up.
   */
  function abandonUpstream() {
    if (backendKey && !clientTerminated && !upstreamGone && !tcp.destroyed) sendCancel(backendKey)
    backendKey = undefined
    up.destroy()
    tcp.destroy()
  }

  if (!o.offload) o.onEstablished?.()
  else {
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
        o.onEstablished?.()
        // BackendKeyData follows AuthenticationOk (usually in the same chunk); Postgres's replies
        // to a client whose SSLRequest it refused are in clear too. Over TLS to Postgres they are not.
        if (result.kind === 'authenticated' || result.plaintext) keyWatch = new BackendKeyWatch()
        const held = fromClient.rest()
        if (held.length) toUpstream(held)
        const early = fromUpstream.rest()
        if (early.length) {
          watchForKey(early)
          toClient(early)
        }
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
  tcp.on('end', () => (upstreamGone = true))
  tcp.on('close', () => {
    upstreamGone = true
    // Postgres may refuse (e.g. no such database) and hang up before the client sent its password:
    // pass its ErrorResponse on rather than a bare close.
    if (o.offload && !relaying && !refused && ws.readyState === ws.OPEN) {
      const error = firstErrorResponse(fromUpstream.rest())
      if (error) {
        toClient(error)
        outcome = 'refused by Postgres before the password'
      }
    }
    fromUpstream.fail(new Error('upstream closed'))
    if (ws.readyState === ws.OPEN) {
      // After the client's Terminate, Postgres hanging up is the client's doing.
      if (outcome === 'closed by client' && !clientTerminated) outcome = 'closed by upstream'
      closeClient(1000)
    }
  })
  ws.on('close', () => {
    fromClient.fail(new Error('client closed'))
    abandonUpstream()
    o.log?.({ peer: o.peer, upstream: upstreamName, durationMs: Date.now() - started, bytesIn, bytesOut, outcome })
  })
  ws.on('error', (err) => {
    outcome = `client error: ${err.message}`
    abandonUpstream()
  })
}

/** The first complete ErrorResponse among whole backend messages, if any. */
function firstErrorResponse(bytes: Buffer): Buffer | undefined {
  for (let at = 0; at + 5 <= bytes.length; ) {
    const end = at + 1 + bytes.readInt32BE(at + 1)
    if (end <= at + 4 || end > bytes.length) return
    if (bytes[at] === 0x45) return bytes.subarray(at, end)
    at = end
  }
}

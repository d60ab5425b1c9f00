import net, { type Socket } from 'node:net'
import tls, { type TLSSocket } from 'node:tls'
import { formatHostPort, type HostPort } from './address'
import { ByteQueue } from '../wire/bytes'
import { cancelRequest, UpstreamError, type BackendKey } from '../wire/startup'
import { SslAnswer } from '../wire/codes'

/**
 * pg's words when Postgres refuses TLS, and what to do: the client's `ssl` (a Neon URL's
 * sslmode=require, say) asked for TLS to a Postgres that has none.
 */
const NO_TLS =
  "The server does not support SSL connections (edgepg: `ssl` or sslmode asks edgepg-proxy for TLS to Postgres, which has none; the WebSocket (wss://) is what crosses the network. As Neon's driver does: set config.forceDisablePgSSL = true, or drop sslmode)"

/**
 * TCP keepalive on links to Postgres, after this long idle: a link across a WAN (NATs and firewalls
 * drop idle flows) is kept open, and one that died is noticed by the kernel rather than at its next use.
 */
const KEEPALIVE_MS = 30_000

/**
 * TLS from the proxy to Postgres, as libpq's sslmode names it: the operator's floor (clients may
 * ask for more with pg's `ssl`, never for less).
 */
export interface UpstreamTls {
  mode: 'disable' | 'require' | 'verify-ca' | 'verify-full'
  /**
   * PEM of the CA(s) that signed Postgres's certificate: needed for verify-ca / verify-full, and
   * trusted when a client asks to verify it (else Node's own roots are).
   */
  ca?: string | Buffer
  /** TLS from the first byte, with ALPN `postgresql` (PostgreSQL 17+), instead of an SSLRequest. */
  direct?: boolean
  /** The name Postgres's certificate must carry (and SNI); default: the upstream host, if a name. */
  servername?: string
}

/** The TLS a client asked for in its login (pg's `ssl`): made as asked, and never weaker than the operator's. */
export type ClientTls = Pick<UpstreamTls, 'direct' | 'servername'> & { mode: 'require' | 'verify-ca' | 'verify-full' }

const STRENGTH = { disable: -1, require: 0, 'verify-ca': 1, 'verify-full': 2 }

/** TLS made at a client's request failed: the error pg would have had from its own TLS socket. */
export class TlsError extends Error {
  constructor(message: string, readonly code?: string) {
    super(message)
  }
}

const SSL_REQUEST = Buffer.from([0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f])
/** How long a CancelRequest's own connection may take before it is given up. */
const CANCEL_TIMEOUT_MS = 5000

/**
 * One session's connection to Postgres: TCP, then TLS when the operator asks for it. What Postgres
 * sends is queued (`queue`, read by the startup) until `relay()` hands the stream to the session.
 */
export class Upstream {
  readonly name: string
  readonly queue = new ByteQueue()
  /** Where Postgres's bytes come from and go to: the TCP socket, or TLS over it. */
  socket: Socket
  connected = false
  /** Postgres hung up (or the socket broke). */
  gone = false
  /** The TCP socket has closed. */
  closed = false
  /** Why the TCP socket failed, if it did. */
  error?: NodeJS.ErrnoException
  /** The socket written to has drained (backpressure). */
  onDrain?: () => void
  /** The TCP socket has closed: for whoever holds the connection now (a field, not a listener added and removed with each holder). */
  onClose?: () => void
  private onData: (chunk: Buffer) => void = (chunk) => this.queue.push(chunk)
  private readonly fromTcp = (chunk: Buffer) => this.onData(chunk)
  private readonly tcp: Socket

  /**
   * Connects when connect() is called: no Postgres connection before it is needed. `connected`: a
   * socket already logged in, handed over by another worker (proxy/pool/asks.ts).
   */
  constructor(readonly target: HostPort, private tlsOptions?: UpstreamTls, connected?: Socket) {
    this.name = formatHostPort(target)
    this.tcp = this.socket = (connected ?? new net.Socket()).setNoDelay(true).setKeepAlive(true, KEEPALIVE_MS)
    this.connected = !!connected
    this.tcp.on('data', this.fromTcp)
    this.tcp.on('drain', () => this.socket === this.tcp && this.onDrain?.())
    this.tcp.on('end', () => (this.gone = true))
    this.tcp.on('error', (err) => (this.error ??= err))
    this.tcp.on('close', () => {
      this.gone = this.closed = true
      const refused = !this.connected && this.error
      this.queue.fail(new Error(refused ? `upstream ${this.name} unreachable: ${refused.code ?? refused.message}` : 'upstream closed'))
      this.onClose?.()
    })
  }

  connect(onConnect?: () => void) {
    if (this.tcp.connecting || this.connected || this.tcp.destroyed) return
    this.tcp.connect({ host: this.target.address ?? this.target.host, port: this.target.port }, () => {
      this.connected = true
      onConnect?.()
    })
  }

  /** Errors and the close come from the TCP socket, with TLS over it or not. */
  on(event: 'error', listener: (err: NodeJS.ErrnoException) => void): void
  on(event: 'close', listener: () => void): void
  on(event: string, listener: (...args: any[]) => void) {
    this.tcp.on(event, listener)
  }

  off(event: 'error' | 'close', listener: (...args: any[]) => void) {
    this.tcp.off(event, listener)
  }

  get destroyed() {
    return this.tcp.destroyed
  }

  write(chunk: Buffer): boolean {
    return this.socket.write(chunk)
  }

  pause() {
    this.socket.pause()
  }

  resume() {
    this.socket.resume()
  }

  /**
   * Its plain TCP socket, to hand to another process: this Upstream lets go of it (undefined over
   * TLS, which cannot move, or with bytes of Postgres's not yet read, which would be lost).
   */
  release(): Socket | undefined {
    if (this.socket !== this.tcp || this.tcp.destroyed || this.tcp.readableLength || this.queue.length) return undefined
    this.tcp.removeAllListeners()
    this.tcp.on('error', () => {}) // (until Node sends it on: it may wait for an earlier socket's to be acknowledged)
    this.tcp.pause()
    return this.tcp
  }

  /** From now on Postgres's bytes go to `onData`; returns those queued so far. */
  relay(onData: (chunk: Buffer) => void): Buffer {
    this.onData = onData
    return this.queue.rest()
  }

  /**
   * Over TLS, where the operator configured it or the client asked (the stronger of the two):
   * SSLRequest, then TLS on the same socket, or TLS at once for direct negotiation. Fails as pg
   * would for a client's request (TlsError), with the operator's setting named otherwise.
   */
  async secure(asked?: ClientTls): Promise<TLSSocket | undefined> {
    const operator = this.tlsOptions
    const floor = operator?.mode === 'disable' ? undefined : operator
    const options = asked ? { ...operator, ...asked, mode: floor && STRENGTH[floor.mode] > STRENGTH[asked.mode] ? floor.mode : asked.mode } : floor
    if (!options) return undefined
    this.tlsOptions = options
    if (!options.direct) {
      this.tcp.write(SSL_REQUEST)
      const answer = (await this.queue.read(1))[0]
      if (answer !== SslAnswer.Yes) {
        if (!asked) throw new UpstreamError(`Postgres at ${this.name} does not accept TLS (upstream sslmode=${options.mode})`)
        throw new TlsError(answer === SslAnswer.No ? NO_TLS : 'There was an error establishing an SSL connection')
      }
    }
    this.tcp.off('data', this.fromTcp)
    const secure = this.tlsOver(this.tcp)
    await new Promise<void>((resolve, reject) => {
      secure.once('secureConnect', resolve)
      secure.once('error', (err: NodeJS.ErrnoException) =>
        reject(asked ? new TlsError(err.message, err.code) : new UpstreamError(`TLS to Postgres at ${this.name} failed: ${err.message}`))
      )
    })
    secure.on('data', (chunk: Buffer) => this.onData(chunk))
    secure.on('drain', () => this.onDrain?.())
    secure.on('error', () => {}) // reported through the TCP socket's close
    secure.on('end', () => (this.gone = true))
    this.socket = secure
    return secure
  }

  private tlsOver(socket: Socket): TLSSocket {
    const { mode, ca, direct, servername } = this.tlsOptions!
    const { host } = this.target
    return tls.connect({
      socket,
      ca,
      host, // the name (or address) checked when no servername is sent
      servername: servername ?? (net.isIP(host) ? undefined : host),
      rejectUnauthorized: mode !== 'require',
      ...(direct && { ALPNProtocols: ['postgresql'] }),
      ...(mode === 'verify-ca' && { checkServerIdentity: () => undefined }),
    })
  }

  /**
   * Hangs up. A backend whose client vanished may still be running a query, and PostgreSQL notices
   * a closed socket only when it next reads or writes: with its key, ask Postgres to cancel first,
   * as libpq's PQcancel does (a CancelRequest on a connection of its own, over TLS when this one is;
   * cut after CANCEL_TIMEOUT_MS; best effort, nothing reported).
   */
  close(cancelWith?: BackendKey) {
    if (cancelWith && !this.gone && !this.tcp.destroyed) this.cancel(cancelWith)
    this.socket.destroy()
    this.tcp.destroy()
  }

  /** Asks Postgres to cancel what the backend with `key` runs (see close()). */
  cancel(key: BackendKey) {
    const packet = cancelRequest(key)
    const socket = net.connect({ host: this.target.address ?? this.target.host, port: this.target.port, noDelay: true })
    const timeout = setTimeout(() => socket.destroy(), CANCEL_TIMEOUT_MS).unref()
    socket.on('close', () => clearTimeout(timeout))
    socket.on('error', () => socket.destroy())
    if (this.socket === this.tcp) {
      socket.write(packet)
      return
    }
    const cancelOverTls = () => {
      const secure = this.tlsOver(socket)
      secure.on('error', () => socket.destroy())
      secure.once('secureConnect', () => secure.write(packet))
      secure.on('close', () => socket.destroy())
    }
    if (this.tlsOptions?.direct) return cancelOverTls()
    socket.write(SSL_REQUEST)
    socket.once('data', (answer: Buffer) => (answer[0] === SslAnswer.Yes ? cancelOverTls() : socket.destroy())) // never in clear where the session used TLS
  }
}

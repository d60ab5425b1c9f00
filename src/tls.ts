import { QueuedSocket } from './queued-socket'
import type { RootCertsDatabase, ReadQueue } from 'subtls'
import type { WebSocketSocket } from './socket'
import type { Tls } from './tls-handshake'

export interface TlsOptions {
  /** Name to verify the server certificate against (and send as SNI). Default: the host pg connects to. */
  host?: string
  /** PEM of the CA certificate(s) to trust. */
  rootCerts: string
  /**
   * Send the SSLRequest and the TLS ClientHello in one WebSocket message, without waiting for
   * Postgres's 'S': one round trip fewer. Needs PostgreSQL 17+ or a proxy that handles SSLRequest
   * (edgepg-proxy does); PostgreSQL ≤ 16 hangs on a ClientHello pipelined behind an SSLRequest.
   */
  pipelineTLS?: boolean
}

const SSL_REQUEST_LENGTH = 8

type Handshake = typeof import('./tls-handshake')
let handshakeModule: Promise<Handshake> | undefined
/** The handshake and subtls are loaded on first use, so that bundlers can split them out of the driver. */
const loadHandshake = () => (handshakeModule ??= import('./tls-handshake').catch((err) => {
  handshakeModule = undefined
  throw err
}))

/**
 * TLS 1.3 to Postgres itself, inside the WebSocket (via subtls), so the proxy relays only
 * ciphertext. Wraps a WebSocketSocket and offers the same net.Socket surface to pg's Connection:
 * 'connect' is emitted once the TLS handshake (and certificate verification) has succeeded, 'data'
 * carries decrypted bytes, and writes are encrypted in order, those of one tick in one record.
 */
export class TlsSocket extends QueuedSocket {
  /** As tls.TLSSocket's (subtls offers no ALPN). */
  readonly encrypted = true
  readonly alpnProtocol = false
  private queue?: ReadQueue
  private tls?: Tls
  private writing = false
  private reading = false
  private errored = false
  private innerClosed = false
  /** The WebSocket is open and the TLS handshake under way. */
  private handshaking = false
  private where = ''
  /** The first bytes Postgres sent, kept until the handshake is done, to explain a refusal. */
  private early: Uint8Array[] = []

  constructor(readonly inner: WebSocketSocket, private readonly options: TlsOptions) {
    super()
    this.transport = inner // (its backlog leaves out the batch being encrypted: at most what write() allowed)
  }

  /** SSLRequest and ClientHello go together (in the upgrade) unless told otherwise. */
  private get pipelined(): boolean {
    return this.options.pipelineTLS !== false
  }

  /** The WebSocket URL, for messages. */
  get url(): string {
    return this.inner.url
  }

  ref() {
    this.inner.ref()
    return this
  }

  unref() {
    this.inner.unref()
    return this
  }

  connect(port: number | string, host: string) {
    const name = this.options.host || host
    this.where = `${name}:${port}`
    this.writable = true
    // Load subtls and parse the roots while the WebSocket opens.
    const ready = loadHandshake().then(async (module) => ({ module, db: await module.rootDatabase(this.options.rootCerts) }))
    ready.catch(() => {}) // handled in handshake(); the socket may fail first

    this.inner.on('data', (chunk: Uint8Array) => {
      if (!this.tls && this.early.length < 16) this.early.push(chunk)
      this.queue?.enqueue(chunk)
    })
    this.inner.on('error', (err: Error) => {
      if (this.errored) return
      this.errored = true
      this.emit('error', err)
    })
    this.inner.on('end', () => this.emit('end'))
    this.inner.on('close', () => {
      this.innerClosed = true
      this.writable = this.readable = false
      this.queue?.dequeue() // a read waiting for more now gets what there is
      if (this.closed) return
      this.closed = true
      this.pending = []
      for (const cb of this.callbacks.splice(0)) cb()
      this.emit('close', false)
    })
    this.inner.once('connect', () => {
      this.handshake(name, ready).catch((err) => this.fail(err))
    })
    // Pipelined, SSLRequest and ClientHello ride in the upgrade; edgepg-proxy sends the ClientHello
    // on once Postgres said 'S'. A server that did not take them gets the SSLRequest alone first
    // (PostgreSQL ≤ 16 hangs on a ClientHello behind it), unless pipelineTLS says it copes.
    this.inner.deferOpen = this.pipelined
    this.inner.fallback = (first) => {
      const split = this.options.pipelineTLS ? first.length : SSL_REQUEST_LENGTH
      this.inner.send(first.subarray(0, split))
      if (split < first.length) this.inner.once('data', (answer: Uint8Array) => answer[0] === 0x53 && this.inner.send(first.subarray(split)))
    }
    this.inner.connect(port, host)
    return this
  }

  private async handshake(name: string, ready: Promise<{ module: Handshake; db: RootCertsDatabase }>) {
    let module: Handshake, db: RootCertsDatabase
    try {
      ;({ module, db } = await ready)
    } catch (err) {
      throw new Error(`edgepg: TLS to Postgres at ${this.where} (via ${this.url}) cannot start: ${(err as Error).message}`, { cause: err })
    }
    if (this.innerClosed || this.ending) return
    this.handshaking = true
    const { queue, tls } = module.handshake(
      { name, where: this.where, url: this.url, pipelined: this.pipelined, early: this.early, write: (data) => void this.inner.write(data), closed: () => this.innerClosed },
      db
    )
    this.queue = queue
    try {
      const session = await tls
      if (this.closed || this.ending) return
      this.tls = session
    } catch (err) {
      if (this.errored || this.closed || this.ending) return // the socket failed or was ended meanwhile
      throw err
    } finally {
      this.handshaking = false
    }
    this.early = []
    this.readable = true
    this.emit('connect')
    // subtls sends the client Finished with the first write, or alone on the first read: so the
    // first flush (of pg's StartupMessage, and whatever a corked pipelined connect adds) starts
    // the reading. Nothing to write: read at once.
    queueMicrotask(() => (this.pending.length || this.corked ? this.flush() : this.readLoop()))
  }

  private async readLoop() {
    if (this.reading || !this.tls) return
    this.reading = true
    try {
      for (;;) {
        const data = await this.tls.read()
        if (!data || this.closed) return
        if (data.length) this.push(Buffer.from(data.buffer, data.byteOffset, data.byteLength))
      }
    } catch (err) {
      if (this.errored || this.closed || this.ending || this.innerClosed) return
      this.fail(new Error(`edgepg: TLS to Postgres at ${this.where} (via ${this.url}) failed: ${(err as Error).message}`, { cause: err }))
    }
  }

  protected scheduleFlush() {
    if (this.tls && this.pending.length && !this.flushQueued && !this.writing) {
      this.flushQueued = true
      queueMicrotask(() => this.flush())
    }
  }

  /**
   * Encrypts what is queued as one batch. One batch at a time: subtls numbers records as it
   * encrypts them, so overlapping writes could leave out of order. Writes made meanwhile form the next.
   */
  private async flush(): Promise<void> {
    this.flushQueued = false
    if (!this.tls || this.writing || this.corked || !this.pending.length || this.innerClosed) return
    this.writing = true
    const { data, callbacks } = this.takePending()
    try {
      const written = this.tls.write(data)
      this.readLoop() // no-op once reading
      await written
    } catch (err) {
      this.writing = false
      for (const cb of callbacks) cb()
      return this.fail(new Error(`edgepg: TLS to Postgres at ${this.where} (via ${this.url}) failed to encrypt: ${(err as Error).message}`, { cause: err }))
    }
    this.writing = false
    for (const cb of callbacks) cb()
    if (this.pending.length) return this.flush()
    if (this.ending) this.inner.end()
  }

  /** Sends what is queued (encrypted), then closes the WebSocket; 'close' follows. */
  protected close() {
    // Before the handshake is done there is nothing we may send: just close.
    if (!this.tls || (!this.writing && !this.pending.length)) this.inner.end()
    else if (!this.writing) this.flush()
  }

  /** Closes at once: 'error' (if given) then 'close'. */
  destroy(err?: Error) {
    if (this.closed) return this
    this.ending = true
    this.writable = false
    this.pending = []
    if (err && !this.errored) {
      this.errored = true
      // pg destroys with a bare reason (e.g. 'timeout expired'); say which connection, and when.
      const during = this.handshaking ? ' during the TLS handshake' : ''
      const hint =
        this.handshaking && this.pipelined
          ? " (PostgreSQL ≤ 16 hangs on a ClientHello pipelined behind an SSLRequest, unless edgepg-proxy answers it; or set pipelineTLS: false)"
          : ''
      this.emit('error', new Error(`edgepg: TLS to Postgres at ${this.where} (via ${this.url}) failed: ${err.message}${during}${hint}`, { cause: err }))
    }
    this.inner.destroy()
    return this
  }

  private fail(err: Error) {
    if (this.errored || this.closed) return
    this.errored = true
    this.emit('error', err)
    this.destroy()
  }
}

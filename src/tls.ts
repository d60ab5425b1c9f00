import { QueuedSocket } from './queued-socket'
import type { RootCertsDatabase, ReadQueue as SubtlsReadQueue } from 'subtls'
import type { WebSocketSocket } from './socket'

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

/** SSLRequest: int32 length 8, int32 code 80877103. */
const SSL_REQUEST = new Uint8Array([0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f])
const S = 0x53
const N = 0x4e
const E = 0x45

type Subtls = typeof import('subtls')
let subtlsModule: Promise<Subtls> | undefined
/** subtls is loaded on first use, so that bundlers can split it out of the driver. */
const loadSubtls = () => (subtlsModule ??= import('subtls').catch((err) => {
  subtlsModule = undefined
  throw err
}))

const databases = new Map<string, Promise<RootCertsDatabase>>()
/** The trusted-roots database for a PEM, built once per PEM. */
function rootDatabase(subtls: Subtls, pem: string): Promise<RootCertsDatabase> {
  let db = databases.get(pem)
  if (!db) {
    db = (async () => {
      if (!/-----BEGIN CERTIFICATE-----/.test(pem)) throw new Error('rootCerts holds no PEM certificate (-----BEGIN CERTIFICATE-----)')
      return subtls.TrustedCert.databaseFromPEM(pem)
    })()
    db.catch(() => databases.delete(pem))
    databases.set(pem, db)
  }
  return db
}

const isIP = (host: string) => /^\d{1,3}(\.\d{1,3}){3}$/.test(host) || host.includes(':')

/**
 * TLS 1.3 to Postgres itself, inside the WebSocket (via subtls), so the proxy relays only
 * ciphertext. Wraps a WebSocketSocket and offers the same net.Socket surface to pg's Connection:
 * 'connect' is emitted once the TLS handshake (and certificate verification) has succeeded, 'data'
 * carries decrypted bytes, and writes are encrypted in order, those of one tick in one record.
 */
export class TlsSocket extends QueuedSocket {
  /** The proxy sees only ciphertext, so it cannot offload auth. */
  readonly authOffload = false
  private queue?: SubtlsReadQueue
  private tls?: { read(): Promise<Uint8Array | undefined>; write(data: Uint8Array): Promise<void> }
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
  }

  /** Pipelined unless told otherwise, where the proxy announced it handles SSLRequest. */
  private get pipelined(): boolean {
    return this.options.pipelineTLS ?? this.inner.authOffload
  }

  /** The WebSocket URL, for messages. */
  get url(): string {
    return this.inner.url
  }

  connect(port: number | string, host: string) {
    const name = this.options.host || host
    this.where = `${name}:${port}`
    this.writable = true
    // Load subtls and parse the roots while the WebSocket opens.
    const ready = loadSubtls().then(async (subtls) => ({ subtls, db: await rootDatabase(subtls, this.options.rootCerts) }))
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
    this.inner.connect(port, host)
    return this
  }

  private async handshake(name: string, ready: Promise<{ subtls: Subtls; db: RootCertsDatabase }>) {
    let subtls: Subtls, db: RootCertsDatabase
    try {
      ;({ subtls, db } = await ready)
    } catch (err) {
      throw new Error(`edgepg: TLS to Postgres at ${this.where} (via ${this.url}) cannot start: ${(err as Error).message}`, { cause: err })
    }
    if (this.innerClosed || this.ending) return
    this.handshaking = true
    try {
      await this.negotiate(subtls, db, name)
    } finally {
      this.handshaking = false
    }
    if (!this.tls) return
    this.early = []
    this.readable = true
    this.emit('connect')
    // subtls sends the client Finished with the first write, or alone on the first read: so the
    // first flush (of pg's StartupMessage, and whatever a corked pipelined connect adds) starts
    // the reading. Nothing to write: read at once.
    queueMicrotask(() => (this.pending.length || this.corked ? this.flush() : this.readLoop()))
  }

  /** SSLRequest, 'S', then the TLS handshake; sets `this.tls` unless the socket closed meanwhile. */
  private async negotiate(subtls: Subtls, db: RootCertsDatabase, name: string) {
    const self = this
    const queue = (this.queue = new (class extends subtls.ReadQueue {
      moreDataMayFollow() {
        return !self.innerClosed
      }
    })())
    for (const chunk of this.early) queue.enqueue(chunk)
    const read = (bytes: number, mode?: number) => queue.read(bytes, mode)
    const write = (data: Uint8Array) => void this.inner.write(data)
    const tlsOptions: Parameters<Subtls['startTls']>[4] = { useSNI: !isIP(name) }

    try {
      if (this.pipelined) {
        tlsOptions.writePreData = SSL_REQUEST
        tlsOptions.expectPreData = new Uint8Array([S])
      } else {
        this.inner.write(SSL_REQUEST)
        const answer = await read(1)
        if (answer?.[0] !== S) throw new Error('Pre data did not match expectation')
      }
      const tls = await subtls.startTls(name, db, read as any, write, tlsOptions)
      if (this.closed || this.ending) return
      this.tls = tls
    } catch (err) {
      if (this.errored || this.closed || this.ending) return // the socket failed or was ended meanwhile
      throw this.explain(err as Error)
    }
  }

  /** Turns subtls's terse errors into a message that says what is wrong, keeping it as `cause`. */
  private explain(err: Error): Error {
    const msg = err.message
    let reason: string
    if (/^Pre data did not match/.test(msg)) {
      const first = this.early.length ? this.early[0][0] : undefined
      if (first === N) {
        return new Error(`edgepg: Postgres at ${this.where} (via ${this.url}) does not accept TLS (it answered the SSLRequest with 'N'); enable ssl on the server or connect without TLS`, { cause: err })
      }
      reason =
        first === E ? `Postgres answered the SSLRequest with an error${this.errorText()}`
        : first === undefined ? 'the connection closed before Postgres answered the SSLRequest'
        : `Postgres answered the SSLRequest with byte 0x${first.toString(16)}, not 'S'`
    } else if (/^No matching subjectAltName/.test(msg)) {
      const name = this.where.replace(/:\d+$/, '')
      reason = `certificate does not match host name "${name}" (no matching DNS subjectAltName)`
      if (isIP(name)) reason += '; subtls verifies DNS names only, so connect by host name'
    } else if (/^End-user certificate is not valid now/.test(msg)) {
      reason = 'certificate has expired or is not yet valid'
    } else if (/^Signing certificate is not valid now/.test(msg)) {
      reason = 'a CA certificate in the chain has expired or is not yet valid'
    } else if (/trusted root/.test(msg)) {
      reason = 'certificate is not trusted (unknown CA: it does not chain to any certificate in rootCerts)'
    } else if (/no TLS server extKeyUsage/.test(msg)) {
      reason = 'certificate is not for TLS servers (no serverAuth extended key usage)'
    } else if (/keyUsage does not include digital signatures/.test(msg)) {
      reason = 'a CA certificate in the chain lacks digitalSignature in its keyUsage (subtls requires it)'
    } else if (/basicConstraints do not indicate a CA/.test(msg)) {
      reason = 'certificate is signed by a certificate that is not a CA'
    } else if (/certificate verify failed|Invalid server verify hash/.test(msg)) {
      reason = `a signature in the handshake did not verify (${msg})`
    } else if (/Fatal alert|HelloRetryRequest|Unsupported|Unexpected TLS record type/.test(msg)) {
      reason = `Postgres and subtls could not agree on TLS parameters (${msg}); subtls needs TLS 1.3 with TLS_AES_128_GCM_SHA256, P-256 key exchange, and an ECDSA P-256 or RSA-PSS server certificate`
    } else if (this.innerClosed || /Not enough data/.test(msg)) {
      reason = `the connection closed during the TLS handshake (${msg})`
    } else {
      reason = msg
    }
    return new Error(`edgepg: TLS to Postgres at ${this.where} (via ${this.url}) failed: ${reason}`, { cause: err })
  }

  /** The M field of an ErrorResponse among the early bytes, if complete. */
  private errorText(): string {
    const bytes = Buffer.concat(this.early)
    const end = Math.min(bytes.length, 1 + (bytes.length >= 5 ? bytes.readInt32BE(1) : 0))
    for (let i = 5; i < end; ) {
      const stop = bytes.indexOf(0, i + 1)
      if (stop < 0 || stop > end) break
      if (bytes[i] === 0x4d) return `: ${bytes.toString('utf8', i + 1, stop)}`
      i = stop + 1
    }
    return ''
  }

  private async readLoop() {
    if (this.reading || !this.tls) return
    this.reading = true
    try {
      for (;;) {
        const data = await this.tls.read()
        if (!data || this.closed) return
        if (data.length) this.emit('data', Buffer.from(data.buffer, data.byteOffset, data.byteLength))
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
          ? " (PostgreSQL ≤ 16 hangs on a ClientHello pipelined behind an SSLRequest unless the proxy handles SSLRequest, as edgepg-proxy does; or set pipelineTLS: false)"
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

import { EventEmitter } from 'events'

/**
 * Bytes not yet sent past which write() returns false, and 'drain' follows once they are under it
 * again; and bytes read but held (paused) past which the transport stops reading. Streams such
 * as pg-copy-streams wait on both, which keeps a 100 MB COPY's memory to about this much.
 */
const HIGH_WATER = 1 << 20
/** How often a backlog is looked at while a writer waits for 'drain' (WebSockets have no drain event). */
const DRAIN_POLL_MS = 1

/**
 * The part of net.Socket's surface that pg's Connection and the streams built on it (pg-copy-streams,
 * pg-query-stream) drive, shared by the WebSocket and the TLS-inside-it sockets. Writes queue up (as
 * one batch per flush), cork/uncork hold them, and each write's callback runs once its bytes have
 * been handed on; write() says when to wait for 'drain'. Reads flow as 'data', or, paused, wait
 * for read() (announced by 'readable').
 */
export abstract class QueuedSocket extends EventEmitter {
  writable = false
  readable = false
  readonly writableHighWaterMark = HIGH_WATER
  protected pending: Uint8Array[] = []
  protected pendingBytes = 0
  protected callbacks: Array<() => void> = []
  protected flushQueued = false
  protected corked = 0
  /** end() or destroy() was called. */
  protected ending = false
  /** 'close' is emitted (or about to be). */
  protected closed = false
  /** As net.Socket's: no more I/O on this socket. */
  get destroyed() {
    return this.closed
  }
  /** Writes so far (the Client tells from it whether a query went out). */
  writes = 0
  private drainTimer?: ReturnType<typeof setTimeout>
  private flowing = true
  private held: Buffer[] = []
  private heldBytes = 0

  /** Arranges for `pending` to be sent (now or on a microtask). */
  protected abstract scheduleFlush(): void
  /** Sends what is queued, then closes; 'close' follows. */
  protected abstract close(): void
  /** Bytes handed to the transport that it has not sent yet. */
  protected abstract get transportBacklog(): number
  /** Stop and restart reading from the transport, while what was read waits for read(). */
  protected abstract pauseTransport(): void
  protected abstract resumeTransport(): void

  /** As net.Socket's: bytes written and not yet sent. */
  get writableLength() {
    return this.pendingBytes + this.transportBacklog
  }

  end(data?: Uint8Array | (() => void), cb?: () => void) {
    if (typeof data === 'function') cb = data
    else if (data) this.write(data)
    if (cb) this.once('close', cb)
    if (this.ending || this.closed) return this
    this.ending = true
    this.writable = false
    this.close()
    return this
  }

  write(data: Uint8Array | string, encoding?: unknown, cb?: () => void): boolean {
    if (typeof encoding === 'function') cb = encoding as () => void
    if (!this.writable) {
      if (cb) queueMicrotask(cb)
      return false
    }
    this.writes++
    const bytes = typeof data === 'string' ? Buffer.from(data) : data
    this.pending.push(bytes)
    this.pendingBytes += bytes.length
    if (cb) this.callbacks.push(cb)
    if (!this.corked) this.scheduleFlush()
    if (this.writableLength < HIGH_WATER) return true
    this.awaitDrain()
    return false
  }

  private awaitDrain() {
    if (this.drainTimer || this.closed) return
    this.drainTimer = setTimeout(() => {
      this.drainTimer = undefined
      if (this.closed) return
      if (this.writableLength >= HIGH_WATER) return this.awaitDrain()
      this.emit('drain')
    }, DRAIN_POLL_MS)
  }

  // ── reading: flowing ('data') or paused (read(), 'readable'), as a net.Socket ──

  /** Hands on bytes read from the transport. */
  protected push(chunk: Buffer) {
    if (this.flowing && !this.held.length) return void this.emit('data', chunk)
    this.held.push(chunk)
    this.heldBytes += chunk.length
    if (this.heldBytes >= HIGH_WATER) this.pauseTransport()
    if (!this.flowing) this.emit('readable')
  }

  pause() {
    this.flowing = false
    return this
  }

  resume() {
    if (this.flowing) return this
    this.flowing = true
    queueMicrotask(() => {
      const data = this.read()
      if (data && !this.closed) this.emit('data', data)
    })
    return this
  }

  isPaused() {
    return !this.flowing
  }

  /** Everything read and held, or null if nothing is. */
  read(): Buffer | null {
    if (!this.held.length) return null
    const data = this.held.length === 1 ? this.held[0] : Buffer.concat(this.held)
    this.held = []
    this.heldBytes = 0
    this.resumeTransport()
    return data
  }

  /** pg corks around each query's messages; nothing leaves until the matching uncork. */
  cork() {
    this.corked++
  }

  uncork() {
    if (this.corked > 0 && --this.corked === 0 && this.pending.length) this.scheduleFlush()
  }

  /** Closed: nothing queued will be sent, nor held data read. */
  protected dropPending() {
    this.pending = []
    this.pendingBytes = 0
    this.held = []
    this.heldBytes = 0
    clearTimeout(this.drainTimer)
  }

  /** Everything queued, as one chunk, with the callbacks to run once it is handed on. */
  protected takePending(): { data: Uint8Array; callbacks: Array<() => void> } {
    const { pending, callbacks } = this
    this.pending = []
    this.pendingBytes = 0
    this.callbacks = []
    return { data: pending.length === 1 ? pending[0] : Buffer.concat(pending), callbacks }
  }

  // pg calls these on every connect; a WebSocket has no Nagle or keep-alive knobs to turn.
  setNoDelay() { return this }
  setKeepAlive() { return this }
  ref() { return this }
  unref() { return this }
}

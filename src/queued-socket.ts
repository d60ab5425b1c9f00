import { EventEmitter } from 'events'

/**
 * Bytes not yet sent past which write() returns false, and 'drain' follows once they are under it
 * again. pg-copy-streams waits on it, which keeps a 100 MB COPY FROM STDIN's memory to about this.
 */
export const HIGH_WATER = 1 << 20
/** How often a backlog is looked at while a writer waits for 'drain'. */
const DRAIN_POLL_MS = 1
const addLength = (bytes: number, chunk: Uint8Array) => bytes + chunk.length

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
  protected pending: Uint8Array[] = []
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

  /** Arranges for `pending` to be sent (now or on a microtask). */
  protected abstract scheduleFlush(): void
  /** Sends what is queued, then closes; 'close' follows. */
  protected abstract close(): void
  /**
   * What the bytes go through: its backlog counts as not yet sent, and it stops reading while what
   * was read waits for read(). (Browsers' WebSockets cannot stop reading; Node's `ws` can.)
   */
  protected transport?: { bufferedAmount?: number; pause?(): unknown; resume?(): unknown }

  /** Bytes written and not yet sent, queued or handed on (named as a WebSocket's, for a socket on top of this one). */
  get bufferedAmount(): number {
    return this.pending.reduce(addLength, this.transport?.bufferedAmount ?? 0)
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
    this.pending.push(typeof data === 'string' ? Buffer.from(data) : data)
    if (cb) this.callbacks.push(cb)
    if (!this.corked) this.scheduleFlush()
    return this.bufferedAmount < HIGH_WATER || this.awaitDrain()
  }

  /** Looks at the backlog until it is under the mark, then emits 'drain' (WebSockets have no such event). */
  private awaitDrain(): false {
    this.drainTimer ??= setTimeout(() => {
      this.drainTimer = undefined
      if (!this.closed) this.bufferedAmount < HIGH_WATER ? this.emit('drain') : this.awaitDrain()
    }, DRAIN_POLL_MS)
    return false
  }

  // ── reading: flowing ('data') or paused (read(), 'readable'), as a net.Socket ──

  /** Hands on bytes read from the transport; held while paused, when the transport stops reading too. */
  protected push(chunk: Buffer) {
    if (this.flowing) return void this.emit('data', chunk) // (resume() hands on what was held first)
    this.held.push(chunk)
    this.transport?.pause?.()
    this.emit('readable')
  }

  pause() {
    this.flowing = false
  }

  resume() {
    this.flowing = true
    const data = this.read()
    if (data) this.emit('data', data)
  }

  /** Everything read and held, or null if nothing is. */
  read(): Buffer | null {
    if (!this.held.length) return null
    const data = Buffer.concat(this.held)
    this.held = []
    this.transport?.resume?.()
    return data
  }

  /** pg corks around each query's messages; nothing leaves until the matching uncork. */
  cork() {
    this.corked++
  }

  uncork() {
    if (this.corked > 0 && --this.corked === 0 && this.pending.length) this.scheduleFlush()
  }

  /** Everything queued, as one chunk, with the callbacks to run once it is handed on. */
  protected takePending(): { data: Uint8Array; callbacks: Array<() => void> } {
    const { pending, callbacks } = this
    this.pending = []
    this.callbacks = []
    return { data: pending.length === 1 ? pending[0] : Buffer.concat(pending), callbacks }
  }

  // pg calls these on every connect; a WebSocket has no Nagle or keep-alive knobs to turn.
  setNoDelay() { return this }
  setKeepAlive() { return this }
  ref() { return this }
  unref() { return this }
}

import { EventEmitter } from 'events'

/**
 * The part of net.Socket's surface that pg's Connection writes through, shared by the WebSocket
 * and the TLS-inside-it sockets: writes queue up (as one batch per flush), cork/uncork hold them,
 * and each write's callback runs once its bytes have been handed on.
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

  /** Arranges for `pending` to be sent (now or on a microtask). */
  protected abstract scheduleFlush(): void
  /** Sends what is queued, then closes; 'close' follows. */
  protected abstract close(): void

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
    return true
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

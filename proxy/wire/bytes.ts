/**
 * Bytes arriving in chunks, read back by exact length: lets the startup phase be written as
 * straight-line async code. After the startup phase, `rest()` hands over what is left.
 */
export class ByteQueue {
  private chunks: Buffer[] = []
  private size = 0
  private waiter?: { n: number; peek: boolean; resolve: (b: Buffer) => void; reject: (e: Error) => void }
  private error?: Error

  get length() {
    return this.size
  }

  push(chunk: Buffer) {
    if (chunk.length === 0) return // an empty frame: nothing to hold (it would cost a slot per frame)
    this.chunks.push(chunk)
    this.size += chunk.length
    // Tiny chunks (one-byte frames) cost far more than their bytes, and each pins the socket read it
    // was cut from: once they are many and under 256 bytes on average, merge them (a merge copies
    // at most ~256 bytes per chunk pushed since the last one).
    if (this.chunks.length > 64 && this.chunks.length * 256 > this.size) this.chunks = [Buffer.concat(this.chunks, this.size)]
    if (this.waiter && this.size >= this.waiter.n) {
      const { n, peek, resolve } = this.waiter
      this.waiter = undefined
      resolve(peek ? this.view(n) : this.take(n))
    }
  }

  /** Every pending and later read rejects with `err`. */
  fail(err: Error) {
    this.error ??= err
    this.waiter?.reject(err)
    this.waiter = undefined
  }

  read(n: number, peek = false): Promise<Buffer> {
    if (this.size >= n) return Promise.resolve(peek ? this.view(n) : this.take(n))
    if (this.error) return Promise.reject(this.error)
    return new Promise((resolve, reject) => (this.waiter = { n, peek, resolve, reject }))
  }

  /**
   * One tagged protocol message: its type byte, body (without the length) and raw bytes. One whose
   * length is out of bounds is refused and left in the queue.
   */
  async message(maxLength: number): Promise<{ type: string; body: Buffer; raw: Buffer }> {
    const length = (await this.read(5, true)).readInt32BE(1)
    if (length < 4 || length > maxLength) throw new FramingError(`invalid message length ${length}`)
    const raw = await this.read(1 + length)
    return { type: String.fromCharCode(raw[0]), body: raw.subarray(5), raw }
  }

  rest(): Buffer {
    return this.take(this.size)
  }

  private take(n: number): Buffer {
    const head = this.view(n)
    this.chunks = this.size > n ? [this.chunks[0].subarray(n)] : []
    this.size -= n
    return head
  }

  /** The first n bytes, still queued (merged into one chunk). */
  private view(n: number): Buffer {
    if (!this.chunks.length) return Buffer.alloc(0)
    if (this.chunks.length > 1) this.chunks = [Buffer.concat(this.chunks, this.size)]
    return this.chunks[0].subarray(0, n)
  }
}

/** The client broke the protocol or may not go on; answered with a FATAL ErrorResponse and a close. */
export class ProtocolError extends Error {
  constructor(message: string, readonly code = '08P01') {
    super(message)
  }
}

/** The whole protocol messages at the start of `bytes` (up to a partial or malformed one), as views. */
export function messages(bytes: Buffer): Buffer[] {
  const out: Buffer[] = []
  for (let at = 0; at + 5 <= bytes.length; ) {
    const end = at + 1 + bytes.readInt32BE(at + 1)
    if (end <= at + 4 || end > bytes.length) break
    out.push(bytes.subarray(at, end))
    at = end
  }
  return out
}

/** Bytes that do not frame as protocol messages (left unread in the queue). */
export class FramingError extends ProtocolError {}

/** Splits a byte stream into whole protocol messages, keeping a partial one for the next chunk. */
export class Framer {
  private rest = Buffer.alloc(0)

  /** The whole messages so far; throws a FramingError on a length no message can have. */
  push(chunk: Buffer): Buffer[] {
    const buf = this.rest.length ? Buffer.concat([this.rest, chunk]) : chunk
    const out = messages(buf)
    const used = out.reduce((n, m) => n + m.length, 0)
    if (buf.length - used >= 5 && buf.readInt32BE(used + 1) < 4) throw new FramingError(`invalid message length ${buf.readInt32BE(used + 1)}`)
    this.rest = used < buf.length ? Buffer.from(buf.subarray(used)) : Buffer.alloc(0)
    return out
  }
}

/** No bytes (one, shared: nothing can be written into it). */
export const EMPTY = Buffer.alloc(0)

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
    if (!this.chunks.length) return EMPTY
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

/**
 * `bytes`, to be held a while. A view pins the whole buffer it was cut from (a socket read): kept
 * only while it is most of that buffer, else copied, so that what is held is what is counted.
 */
export const kept = (bytes: Buffer): Buffer => (bytes.length * 2 >= bytes.buffer.byteLength ? bytes : Buffer.from(bytes))

/** A message declares more bytes than its reader may hold (`length`: what it declared). */
export class MessageTooLarge extends FramingError {
  constructor(readonly length: number, readonly limit: number) {
    super(`a message of ${length} bytes, over the limit of ${limit}`)
  }
}

/**
 * Splits a byte stream into whole protocol messages. Whole messages within a chunk are views into
 * it; one cut across chunks is kept as a list of pieces and joined once, when its last byte is in,
 * so its cost is linear in its size however finely it is cut.
 */
export class Framer {
  private pieces: Buffer[] = []
  /** Bytes in `pieces`. */
  private have = 0
  /** The length of the message under way (type byte included), once its header is in. */
  private need = 0

  /** `maxLength`: the largest message it holds (a length past it is refused at its header). */
  constructor(private readonly maxLength = 0x7fffffff) {}

  /** What the message under way holds, or has declared it will. */
  get holding(): number {
    return Math.max(this.have, this.need)
  }

  /** The whole messages so far; throws a FramingError on a length no message can have, or one over maxLength. */
  push(chunk: Buffer): Buffer[] {
    const out: Buffer[] = []
    this.each(chunk, (bytes, start, end) => out.push(start === 0 && end === bytes.length ? bytes : bytes.subarray(start, end)))
    return out
  }

  /** The same, each whole message as `f(bytes, start, end)`: read in place where it lies whole in `chunk` (no view made for it), else joined. */
  each(chunk: Buffer, f: (bytes: Buffer, start: number, end: number) => void) {
    let at = 0
    if (this.have) at = this.continue(chunk, f)
    while (at + 5 <= chunk.length) {
      const end = at + this.declared(chunk.readInt32BE(at + 1))
      if (end > chunk.length) break
      f(chunk, at, end)
      at = end
    }
    if (at < chunk.length) {
      this.need = at + 5 <= chunk.length ? this.declared(chunk.readInt32BE(at + 1)) : 0
      this.hold(chunk.subarray(at))
    }
  }

  /** Feeds the message under way from the start of `chunk`; returns where the rest begins. */
  private continue(chunk: Buffer, f: (bytes: Buffer, start: number, end: number) => void): number {
    let at = 0
    if (!this.need) {
      // Its header was cut: gathered first (at most 4 bytes copied).
      at = Math.min(5 - this.have, chunk.length)
      this.pieces = [Buffer.concat([...this.pieces, chunk.subarray(0, at)])]
      this.have += at
      if (this.have < 5) return at
      this.need = this.declared(this.pieces[0].readInt32BE(1))
    }
    const n = Math.min(this.need - this.have, chunk.length - at)
    if (n) this.hold(chunk.subarray(at, at + n))
    if (this.have < this.need) return chunk.length
    const message = this.pieces.length === 1 ? this.pieces[0] : Buffer.concat(this.pieces, this.have)
    this.pieces = []
    this.have = this.need = 0
    f(message, 0, message.length)
    return at + n
  }

  /** A message's whole length from the length field of its header. */
  private declared(length: number): number {
    if (length < 4) throw new FramingError(`invalid message length ${length}`)
    if (length + 1 > this.maxLength) throw new MessageTooLarge(length + 1, this.maxLength)
    return length + 1
  }

  private hold(piece: Buffer) {
    this.pieces.push(kept(piece))
    this.have += piece.length
  }
}

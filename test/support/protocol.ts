/**
 * The Postgres wire protocol by hand, for tests that must send exact (or broken) bytes or control
 * their own reading: frontend packets and messages, and a splitter for backend messages.
 */

export const PROTOCOL_3 = 196608
export const SSL_CODE = 80877103
export const GSSENC_CODE = 80877104
export const CANCEL_CODE = 80877102

export const int32 = (n: number) => {
  const b = Buffer.alloc(4)
  b.writeInt32BE(n | 0)
  return b
}
/** Null-terminated strings, back to back. */
export const cstrings = (parts: string[]) => Buffer.from(parts.map((p) => p + '\0').join(''))

/** An untyped startup-phase packet: length, code, body. */
export const packet = (code: number, body: Buffer = Buffer.alloc(0)) => Buffer.concat([int32(8 + body.length), int32(code), body])
export const sslRequest = () => packet(SSL_CODE)
export const gssencRequest = () => packet(GSSENC_CODE)
/** A StartupMessage with these parameters (in order); `terminated: false` leaves out the final NUL. */
export function startupMessage(params: Record<string, string> | Array<[string, string]>, { code = PROTOCOL_3, terminated = true } = {}) {
  const pairs = Array.isArray(params) ? params : Object.entries(params)
  return packet(code, Buffer.concat([cstrings(pairs.flat()), terminated ? Buffer.from([0]) : Buffer.alloc(0)]))
}

/** A typed message: tag, length, body. */
export const message = (type: string, body: Buffer) => Buffer.concat([Buffer.from(type, 'latin1'), int32(4 + body.length), body])
export const passwordMessage = (pw: string) => message('p', cstrings([pw]))
/** A simple-protocol Query. */
export const queryMessage = (sql: string) => message('Q', cstrings([sql]))
export const TERMINATE = message('X', Buffer.alloc(0))

/** Splits a byte stream into backend messages, whatever the chunks. */
export function backendReader(onMessage: (type: string, body: Buffer) => void) {
  let pending: Buffer = Buffer.alloc(0)
  return (chunk: Buffer) => {
    const buf = pending.length ? Buffer.concat([pending, chunk]) : chunk
    let off = 0
    while (buf.length - off >= 5) {
      const len = buf.readInt32BE(off + 1)
      if (buf.length - off < 1 + len) break
      onMessage(String.fromCharCode(buf[off]), buf.subarray(off + 5, off + 1 + len))
      off += 1 + len
    }
    pending = Buffer.from(buf.subarray(off)) // a copy: do not pin the whole chunk
  }
}

/** A result of `rows` DataRows of 1,000 bytes each (~1 KB a row), for reading slowly: see `bigResultRowError`. */
export const bigResultQuery = (rows: number) => `SELECT lpad(i::text, 10, '0') || repeat('x', 990) FROM generate_series(1, ${rows}) i`
const BIG_ROW_TAIL = Buffer.alloc(990, 'x')
/** What is wrong with DataRow number `n` (from 1) of bigResultQuery's result, or '' when it is intact. */
export function bigResultRowError(body: Buffer, n: number): string {
  const ok = body.readInt16BE(0) === 1 && body.readInt32BE(2) === 1000 && body.toString('latin1', 6, 16) === String(n).padStart(10, '0') && body.subarray(16).equals(BIG_ROW_TAIL)
  return ok ? '' : `row ${n}: ${body.subarray(0, 40).toString('latin1')}`
}

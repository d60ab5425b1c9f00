import { ProtocolError } from './bytes'
import { ServerMessage } from './codes'

/**
 * The startup phase on the wire: a client's first packet (StartupMessage, SSLRequest,
 * CancelRequest, GSSENCRequest), the backend's cancel key, and Postgres's errors as it words them.
 */

const SSL_REQUEST = 80877103
const GSSENC_REQUEST = 80877104
const CANCEL_REQUEST = 80877102
/** PostgreSQL's own limit for a startup packet. */
export const MAX_STARTUP_PACKET = 10000
/** Largest message accepted during authentication, either way. */
export const MAX_AUTH_MESSAGE = 64 * 1024

/** A client's first packet, parsed. */
export type StartupPacket =
  | { kind: 'startup'; packet: Buffer; user: string; database: string }
  | { kind: 'ssl'; packet: Buffer }
  | { kind: 'cancel'; packet: Buffer }
  | { kind: 'gssenc'; packet: Buffer }

/**
 * Parses a whole startup-phase packet (length included); throws a ProtocolError for anything else.
 * `anyUser`: a StartupMessage may name no user (a login by token: the token names the role).
 */
export function parseStartupPacket(packet: Buffer, anyUser = false): StartupPacket {
  const length = packet.length >= 8 ? packet.readInt32BE(0) : 0
  if (length < 8 || length > MAX_STARTUP_PACKET || length !== packet.length) throw new ProtocolError(`invalid startup packet length ${length}`)
  const code = packet.readInt32BE(4)
  if (code === SSL_REQUEST) return { kind: 'ssl', packet }
  if (code === CANCEL_REQUEST) return { kind: 'cancel', packet }
  if (code === GSSENC_REQUEST) return { kind: 'gssenc', packet }
  if (code >> 16 !== 3) throw new ProtocolError(`unsupported frontend protocol ${code >> 16}.${code & 0xffff}`)
  const params = parseStartupParams(packet.subarray(8))
  if (!params.user && !anyUser) throw new ProtocolError('no PostgreSQL user name specified in startup packet', '28000')
  return { kind: 'startup', packet, user: params.user ?? '', database: params.database ?? params.user ?? '' }
}

/** What a CancelRequest for one backend needs: its BackendKeyData. */
export interface BackendKey {
  pid: number
  /** 4 bytes with protocol 3.0; up to 256 with 3.2 (PostgreSQL 18). */
  secret: Buffer
}

/** PostgreSQL 18's limit on a cancel key (protocol 3.2). */
const MAX_CANCEL_KEY = 256

/**
 * Watches the messages Postgres sends at the start of a session, as they are relayed (it is shown
 * each chunk and holds nothing back), for BackendKeyData ('K') and the ReadyForQuery that ends the
 * login. It stops at ReadyForQuery (`ready`), an ErrorResponse, or at anything that does not frame
 * as protocol messages (TLS records, a lone SSLRequest answer): `key` is then what it found.
 */
export class LoginWatch {
  key?: BackendKey
  ready = false
  /** A message not yet complete: at most one, kept as a copy (chunks go on to the client). */
  private partial?: Buffer

  /** Looks at the next bytes from Postgres; true once it is done looking. */
  feed(chunk: Buffer): boolean {
    const buf = this.partial ? Buffer.concat([this.partial, chunk]) : chunk
    this.partial = undefined
    let at = 0
    while (buf.length - at >= 5) {
      const type = buf[at]
      const length = buf.readInt32BE(at + 1)
      if (length < 4 || length > MAX_AUTH_MESSAGE) return true // not protocol messages after all
      if (buf.length - at < 1 + length) break
      if (type === ServerMessage.BackendKeyData) {
        // BackendKeyData: process ID, then the secret key, which is the rest of the message.
        const secret = buf.subarray(at + 9, at + 1 + length)
        if (secret.length >= 4 && secret.length <= MAX_CANCEL_KEY) this.key = { pid: buf.readInt32BE(at + 5), secret: Buffer.from(secret) }
      }
      if (type === ServerMessage.ReadyForQuery) return (this.ready = true)
      if (type === ServerMessage.ErrorResponse) return true // refused: Postgres hangs up
      at += 1 + length
    }
    if (at < buf.length) this.partial = Buffer.from(buf.subarray(at))
    return false
  }
}

/** A CancelRequest for `key`, as libpq sends it on a connection of its own. */
export function cancelRequest(key: BackendKey): Buffer {
  const packet = Buffer.alloc(12 + key.secret.length)
  packet.writeInt32BE(packet.length, 0)
  packet.writeInt32BE(CANCEL_REQUEST, 4)
  packet.writeInt32BE(key.pid, 8)
  key.secret.copy(packet, 12)
  return packet
}

/** Postgres misbehaved or asked for what the proxy cannot do. */
export class UpstreamError extends Error {}

/** Postgres (or whatever answers in its place) sent what the login did not expect: `raw`. */
export class UnexpectedMessage extends UpstreamError {
  constructor(readonly raw: Buffer) {
    super(`unexpected message type '${String.fromCharCode(raw[0])}' from Postgres during authentication`)
  }
}

export function cString(buf: Buffer): string {
  const end = buf.indexOf(0)
  return buf.toString('utf8', 0, end < 0 ? buf.length : end)
}

/** A StartupMessage like `packet` (protocol and parameters, in order) but for `user`. */
export function startupAs(packet: Buffer, user: string): Buffer {
  const params = { ...parseStartupParams(packet.subarray(8)), user }
  const body = Buffer.from(Object.entries(params).map(([k, v]) => `${k}\0${v}\0`).join('') + '\0', 'utf8')
  const head = Buffer.alloc(8)
  head.writeInt32BE(8 + body.length, 0)
  head.writeInt32BE(packet.readInt32BE(4), 4)
  return Buffer.concat([head, body])
}

export function parseStartupParams(buf: Buffer): Record<string, string> {
  if (buf.length === 0 || buf[buf.length - 1] !== 0) throw new ProtocolError('startup packet parameters are not terminated')
  const parts = buf.toString('utf8', 0, buf.length - 1).split('\0')
  if (parts.at(-1) !== '' || parts.length % 2 !== 1) throw new ProtocolError('malformed startup packet parameters')
  const params: Record<string, string> = {}
  for (let i = 0; i + 1 < parts.length; i += 2) params[parts[i]] = parts[i + 1]
  return params
}

export function parseErrorFields(body: Buffer): { code: string; message: string } {
  const fields: Record<string, string> = {}
  for (let i = 0; i < body.length && body[i] !== 0; ) {
    const end = body.indexOf(0, i + 1)
    if (end < 0) break
    fields[String.fromCharCode(body[i])] = body.toString('utf8', i + 1, end)
    i = end + 1
  }
  return { code: fields.C ?? '', message: fields.M ?? '' }
}

/** An ErrorResponse (FATAL unless told), or a NoticeResponse (WARNING, NOTICE), as Postgres would send it. */
export function errorResponse(code: string, message: string, severity: 'FATAL' | 'ERROR' | 'WARNING' | 'NOTICE' = 'FATAL'): Buffer {
  const fields = Buffer.from(`S${severity}\0V${severity}\0C${code}\0M${message}\0\0`, 'utf8')
  const head = Buffer.alloc(5)
  head[0] = severity === 'FATAL' || severity === 'ERROR' ? ServerMessage.ErrorResponse : ServerMessage.NoticeResponse
  head.writeInt32BE(fields.length + 4, 1)
  return Buffer.concat([head, fields])
}

/// <reference path="../src/pg-internals.d.ts" />
import type { TLSSocket } from 'node:tls'
import { serialize } from 'pg-protocol'
import sasl from 'pg/lib/crypto/sasl.js'
import pgCrypto from 'pg/lib/crypto/utils.js'
import { ProtocolError, type ByteQueue } from './bytes'

/**
 * The startup phase of one session, with auth offload: the client authenticates to the proxy with
 * a cleartext password, and the proxy authenticates upstream with whatever Postgres asks for
 * (trust, password, md5, SCRAM-SHA-256, SCRAM-SHA-256-PLUS over TLS). SASL never reaches the
 * client. The password comes in the WebSocket upgrade (proxy/login.ts) or, here, in band: the
 * proxy asks for it with AuthenticationCleartextPassword.
 *
 * A client that starts with SSLRequest wants TLS with Postgres itself: the proxy forwards the
 * SSLRequest, waits for Postgres's answer (PostgreSQL ≤ 16 would hang on a ClientHello pipelined
 * behind it), passes the answer on, and from then on only relays.
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

/** Parses a whole startup-phase packet (length included); throws a ProtocolError for anything else. */
export function parseStartupPacket(packet: Buffer): StartupPacket {
  const length = packet.length >= 8 ? packet.readInt32BE(0) : 0
  if (length < 8 || length > MAX_STARTUP_PACKET || length !== packet.length) throw new ProtocolError(`invalid startup packet length ${length}`)
  const code = packet.readInt32BE(4)
  if (code === SSL_REQUEST) return { kind: 'ssl', packet }
  if (code === CANCEL_REQUEST) return { kind: 'cancel', packet }
  if (code === GSSENC_REQUEST) return { kind: 'gssenc', packet }
  if (code >> 16 !== 3) throw new ProtocolError(`unsupported frontend protocol ${code >> 16}.${code & 0xffff}`)
  const params = parseStartupParams(packet.subarray(8))
  if (!params.user) throw new ProtocolError('no PostgreSQL user name specified in startup packet', '28000')
  return { kind: 'startup', packet, user: params.user, database: params.database ?? params.user }
}

/** Refused unless a cleartext password may cross the client's link. */
export function checkPasswordsAllowed(allowed: boolean) {
  if (allowed) return
  throw new ProtocolError(
    'edgepg-proxy refuses passwords over unencrypted ws:// from a non-loopback client; connect with wss://, ' +
      'use TLS inside the socket, or start the proxy with --allow-insecure-passwords if TLS ends in front of it',
    '28000'
  )
}

export interface StartupIO {
  client: ByteQueue
  upstream: ByteQueue
  toClient(data: Buffer): void
  toUpstream(data: Buffer): void
  /** Whether a cleartext password may cross the client's link (wss, loopback, or operator's say-so). */
  passwordsAllowed: boolean
  /** TLS to Postgres, where the operator configured it: negotiated before the startup is forwarded. */
  secureUpstream(): Promise<TLSSocket | undefined>
  /** Authenticate upstream on the client's behalf; else the startup goes on untouched. */
  offload: boolean
  /**
   * Connects to Postgres, which nothing does before the client's first packet (and, with auth
   * offload, its password) is in: for a `login`, once the login gate admits it (proxy/logins.ts).
   */
  connect(login: boolean): Promise<void>
  /** The CancelRequest to forward for the one the client sent, or why none goes. */
  routeCancel(packet: Buffer): { packet: Buffer } | { refused: string }
}

export type StartupOutcome =
  /** Postgres said AuthenticationOk (offload); or the startup went on untouched (`relayed`), for Postgres to answer. */
  | { kind: 'authenticated' | 'relayed' }
  /** A CancelRequest, sent on (`why` undefined) or not. */
  | { kind: 'cancel'; why?: string }
  /**
   * SSLRequest: relay bytes as they are from now on. `plaintext`: Postgres's
   * replies stay readable protocol messages (an SSLRequest it refused; the client goes on in clear).
   */
  | { kind: 'passthrough'; plaintext: boolean }
  /** Postgres refused (e.g. wrong password); its ErrorResponse was passed to the client. */
  | { kind: 'refused'; code: string; message: string }

/** The startup phase in band: the client's packets come over the WebSocket, the password when asked for. */
export async function runStartup(io: StartupIO): Promise<StartupOutcome> {
  const read = async () => {
    const head = await io.client.read(4)
    const length = head.readInt32BE(0)
    if (length < 8 || length > MAX_STARTUP_PACKET) throw new ProtocolError(`invalid startup packet length ${length}`)
    return parseStartupPacket(Buffer.concat([head, await io.client.read(length - 4)]))
  }
  let startup = await read()
  if (startup.kind === 'gssenc') {
    // Once, as Postgres does: a second is an unsupported protocol.
    io.toClient(Buffer.from('N'))
    startup = await read()
  }
  if (startup.kind === 'gssenc') throw new ProtocolError('unsupported frontend protocol 1234.5680')
  if (startup.kind === 'cancel') {
    const routed = io.routeCancel(startup.packet)
    if ('refused' in routed) return { kind: 'cancel', why: routed.refused }
    await io.connect(false)
    io.toUpstream(routed.packet)
    return { kind: 'cancel' }
  }
  if (startup.kind === 'ssl') {
    await io.connect(true)
    io.toUpstream(startup.packet)
    const answer = await io.upstream.read(1)
    io.toClient(answer)
    return { kind: 'passthrough', plaintext: answer[0] !== 0x53 } // 'N': the client goes on in clear
  }
  if (!io.offload) {
    await io.connect(true)
    io.toUpstream(startup.packet)
    return { kind: 'relayed' }
  }
  checkPasswordsAllowed(io.passwordsAllowed)
  io.toClient(AUTH_CLEARTEXT)
  const reply = await io.client.message(MAX_AUTH_MESSAGE)
  if (reply.type !== 'p') {
    // Any byte may come here; a NUL inside the ErrorResponse's message field would cut it short.
    const shown = /^[\x21-\x7e]$/.test(reply.type) ? `'${reply.type}'` : `0x${reply.type.charCodeAt(0).toString(16).padStart(2, '0')}`
    throw new ProtocolError(`expected a password message, got message type ${shown}`, '28000')
  }
  await io.connect(true)
  const upstreamTls = await io.secureUpstream()
  io.toUpstream(startup.packet)
  const refusal = await authenticate(io, startup.user, cString(reply.body), upstreamTls)
  return refusal ? { kind: 'refused', ...refusal } : { kind: 'authenticated' }
}

/**
 * Answers whatever Postgres asks for with `password`, after the StartupMessage went upstream, up
 * to and including AuthenticationOk. AuthenticationOk, NegotiateProtocolVersion and an
 * ErrorResponse are for the client: they go to `toClient`. Resolves with Postgres's refusal, if any.
 */
export async function authenticate(
  io: Pick<StartupIO, 'upstream' | 'toUpstream' | 'toClient'>,
  user: string,
  password: string,
  upstreamTls?: TLSSocket
): Promise<{ code: string; message: string } | undefined> {
  let session: any
  for (;;) {
    const msg = await io.upstream.message(MAX_AUTH_MESSAGE)
    if (msg.type === 'E') {
      io.toClient(msg.raw)
      return parseErrorFields(msg.body)
    }
    if (msg.type === 'v') {
      io.toClient(msg.raw) // NegotiateProtocolVersion is for the client to see
      continue
    }
    if (msg.type !== 'R' || msg.body.length < 4) throw new UnexpectedMessage(msg.raw)
    const method = msg.body.readInt32BE(0)
    const data = msg.body.subarray(4)
    try {
      switch (method) {
        case 0: // AuthenticationOk: from here on the session is a plain relay
          io.toClient(msg.raw)
          return undefined
        case 3:
          io.toUpstream(serialize.password(password))
          break
        case 5:
          io.toUpstream(serialize.password(await pgCrypto.postgresMd5PasswordHash(user, password, data)))
          break
        case 10:
          session = sasl.startSession(data.toString('utf8').split('\0').filter(Boolean), upstreamTls)
          io.toUpstream(serialize.sendSASLInitialResponseMessage(session.mechanism, session.response))
          break
        case 11:
          await sasl.continueSession(session, password, data.toString('utf8'), upstreamTls)
          io.toUpstream(serialize.sendSCRAMClientFinalMessage(session.response))
          break
        case 12:
          sasl.finalizeSession(session, data.toString('utf8'))
          break
        default:
          throw new UpstreamError(`Postgres asked for an authentication method edgepg-proxy does not support (code ${method})`)
      }
    } catch (err) {
      if (err instanceof UpstreamError) throw err
      // pg's SCRAM rejects what cannot succeed (an empty password, a forged server signature).
      throw new ProtocolError(`authentication failed for user "${user}": ${(err as Error).message}`, '28P01')
    }
  }
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
      if (type === 0x4b) {
        // BackendKeyData: process ID, then the secret key, which is the rest of the message.
        const secret = buf.subarray(at + 9, at + 1 + length)
        if (secret.length >= 4 && secret.length <= MAX_CANCEL_KEY) this.key = { pid: buf.readInt32BE(at + 5), secret: Buffer.from(secret) }
      }
      if (type === 0x5a) return (this.ready = true)
      if (type === 0x45) return true // refused: Postgres hangs up
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

const AUTH_CLEARTEXT = Buffer.from([0x52, 0, 0, 0, 8, 0, 0, 0, 3])

export function cString(buf: Buffer): string {
  const end = buf.indexOf(0)
  return buf.toString('utf8', 0, end < 0 ? buf.length : end)
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

/** A FATAL ErrorResponse, as Postgres would send it. */
export function errorResponse(code: string, message: string): Buffer {
  const fields = Buffer.from(`SFATAL\0VFATAL\0C${code}\0M${message}\0\0`, 'utf8')
  const head = Buffer.alloc(5)
  head[0] = 0x45
  head.writeInt32BE(fields.length + 4, 1)
  return Buffer.concat([head, fields])
}

/// <reference path="../../src/pg-internals.d.ts" />
import type { TLSSocket } from 'node:tls'
import { serialize } from 'pg-protocol'
import sasl from 'pg/lib/crypto/sasl.js'
import pgCrypto from 'pg/lib/crypto/utils.js'
import { ProtocolError, type ByteQueue } from '../wire/bytes'
import { cString, MAX_AUTH_MESSAGE, MAX_STARTUP_PACKET, parseErrorFields, parseStartupPacket, UnexpectedMessage, UpstreamError } from '../wire/startup'
import { ServerMessage, SslAnswer } from '../wire/codes'

/**
 * The startup phase of one session, with auth offload: the client authenticates to the proxy with
 * a cleartext password, and the proxy authenticates upstream with whatever Postgres asks for
 * (trust, password, md5, SCRAM-SHA-256, SCRAM-SHA-256-PLUS over TLS). SASL never reaches the
 * client. The password comes in the WebSocket upgrade (proxy/login/in-upgrade.ts) or, here, in band: the
 * proxy asks for it with AuthenticationCleartextPassword.
 *
 * A client that starts with SSLRequest wants TLS with Postgres itself: the proxy forwards the
 * SSLRequest, waits for Postgres's answer (PostgreSQL ≤ 16 would hang on a ClientHello pipelined
 * behind it), passes the answer on, and from then on only relays.
 */

/** Why a cleartext password may not cross the client's link. */
export const passwordsRefused = () =>
  new ProtocolError(
    'edgepg-proxy refuses passwords over unencrypted ws:// from a non-loopback client; connect with wss://, ' +
      'use TLS inside the socket, or start the proxy with --allow-insecure-passwords if TLS ends in front of it',
    '28000'
  )

/** Refused unless a cleartext password may cross the client's link. */
export function checkPasswordsAllowed(allowed: boolean) {
  if (!allowed) throw passwordsRefused()
}

/** Where a CancelRequest goes (proxy/ws/cancels.ts): on to Postgres as `packet`, or nowhere. */
export type Routed = { packet: Buffer } | { refused: string }

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
   * offload, its password) is in: for a `login`, once the login gate admits it (proxy/login/gate.ts).
   */
  connect(login: boolean): Promise<void>
  /** The CancelRequest to forward for the one the client sent, or why none goes. */
  routeCancel(packet: Buffer): Routed | Promise<Routed>
  /** Who the StartupMessage says logs in, to which database (Postgres's default: the user's name), for the log. */
  named?(user: string, database: string): void
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
  if (startup.kind === 'startup' && startup.user) io.named?.(startup.user, startup.database || startup.user)
  if (startup.kind === 'cancel') {
    const routed = await io.routeCancel(startup.packet)
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
    return { kind: 'passthrough', plaintext: answer[0] !== SslAnswer.Yes } // 'N': the client goes on in clear
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

const AUTH_CLEARTEXT = Buffer.from([ServerMessage.Authentication, 0, 0, 0, 8, 0, 0, 0, 3])

/**
 * The login in the WebSocket upgrade. The driver offers, next to edgepg's subprotocol, one more
 * subprotocol value, `edgepg.login.<base64url>`, carrying its first flight: a StartupMessage and
 * (with auth offload) a PasswordMessage, or an SSLRequest and the TLS ClientHello behind it, or a
 * CancelRequest. A subprotocol is the one header a browser lets a page set. Ahead of a
 * StartupMessage or CancelRequest may come edgepg's UPSTREAM_TLS_REQUEST (pg's `ssl`): the proxy
 * then reaches Postgres over TLS first, verified as asked.
 *
 * The proxy takes that flight to Postgres before it answers the upgrade, and answers with what
 * Postgres said: the whole login (AuthenticationOk … ReadyForQuery), or its ErrorResponse, or the
 * authentication request the client must answer itself (no password given), or 'S' for TLS. So
 * pg's own handshake code sees an ordinary login that took one round trip.
 */
import type { TLSSocket } from 'node:tls'
import type { ByteQueue } from '../wire/bytes'
import { EMPTY, FramingError, ProtocolError } from '../wire/bytes'
import { authenticate, checkPasswordsAllowed, type Routed } from './in-band'
import {
  cString,
  MAX_AUTH_MESSAGE,
  MAX_STARTUP_PACKET,
  parseErrorFields,
  parseStartupPacket,
  parseStartupParams,
  UnexpectedMessage,
  type StartupPacket,
} from '../wire/startup'
import { Upstream, type ClientTls, type UpstreamTls } from '../upstream/connection'
import type { HostPort } from '../upstream/address'
import { LOGIN_PREFIX, MAX_LOGIN_CHARS, TOKEN_MESSAGE, UPSTREAM_TLS_REQUEST } from '../../src/config'
import { ClientMessage, SslAnswer } from '../wire/codes'

export interface Login {
  /** Its size, decoded: bytes the client sent (for the session log). */
  bytes: number
  first: StartupPacket
  /** The password from the PasswordMessage behind a StartupMessage, if the client sent one. */
  password?: string
  /** Or a signed token (edgepg's TOKEN_MESSAGE), for proxy/auth/tokens.ts: the proxy logs in as the role it names. */
  token?: string
  /** What followed an SSLRequest: the TLS ClientHello. */
  rest: Buffer
  /** TLS to Postgres the client asked the proxy for. */
  tls?: ClientTls
}

/**
 * Takes the login out of a `Sec-WebSocket-Protocol` header. Returns the header without it (what
 * `ws` goes on to negotiate) and the login, or the reason it is malformed.
 */
export function takeLogin(header: string | undefined): { protocols?: string; login?: Login; problem?: ProtocolError } {
  if (!header?.includes(LOGIN_PREFIX)) return { protocols: header }
  const values = header.split(',').map((v) => v.trim())
  const logins = values.filter((v) => v.startsWith(LOGIN_PREFIX))
  const protocols = values.filter((v) => !v.startsWith(LOGIN_PREFIX)).join(', ') || undefined
  try {
    if (logins.length > 1) throw new ProtocolError('more than one login offered')
    const encoded = logins[0].slice(LOGIN_PREFIX.length)
    if (encoded.length > MAX_LOGIN_CHARS) throw new ProtocolError(`the login is too large (${encoded.length} characters; at most ${MAX_LOGIN_CHARS})`)
    if (!/^[A-Za-z0-9_-]+$/.test(encoded)) throw new ProtocolError('the login is not base64url')
    const bytes = Buffer.from(encoded, 'base64url')
    return { protocols, login: { bytes: bytes.length, ...parseLogin(bytes) } }
  } catch (err) {
    const { code, message } = err as ProtocolError
    return { protocols, problem: new ProtocolError(`malformed login in the WebSocket upgrade: ${message}`, code) }
  }
}

/** `rawHeaders` without the login, for whatever may print them. */
export function redactLogin(rawHeaders: string[]): string[] {
  return rawHeaders.map((value, i) => (i % 2 && rawHeaders[i - 1].toLowerCase() === 'sec-websocket-protocol' ? takeLogin(value).protocols ?? '' : value))
}

function parseLogin(bytes: Buffer): Omit<Login, 'bytes'> {
  const length = bytes.length >= 8 ? bytes.readInt32BE(0) : 0
  if (length < 8 || length > MAX_STARTUP_PACKET || length > bytes.length) throw new ProtocolError(`invalid startup packet length ${length}`)
  if (bytes.readInt32BE(4) === UPSTREAM_TLS_REQUEST) {
    const behind = parseLogin(bytes.subarray(length))
    if (behind.tls || behind.first.kind === 'ssl') throw new ProtocolError('TLS asked for twice')
    return { ...behind, tls: parseTlsRequest(bytes.subarray(8, length)) }
  }
  const rest = bytes.subarray(length)
  const first = parseStartupPacket(bytes.subarray(0, length), rest[0] === TOKEN_MESSAGE)
  if (first.kind === 'gssenc') throw new ProtocolError('GSSAPI encryption is not supported')
  if (first.kind === 'ssl') return { first, rest }
  if (first.kind === 'cancel' || rest.length === 0) {
    if (rest.length) throw new ProtocolError('unexpected bytes after the CancelRequest')
    return { first, rest }
  }
  // A PasswordMessage (or a token), and nothing after it.
  if ((rest[0] !== ClientMessage.Password && rest[0] !== TOKEN_MESSAGE) || rest.length < 5 || rest.readInt32BE(1) !== rest.length - 1) {
    throw new ProtocolError('expected one password message after the startup message')
  }
  const secret = cString(rest.subarray(5))
  return rest[0] === TOKEN_MESSAGE ? { first, rest: Buffer.alloc(0), token: secret } : { first, rest: Buffer.alloc(0), password: secret }
}

function parseTlsRequest(body: Buffer): ClientTls {
  const { sslmode, sslnegotiation, servername } = parseStartupParams(body)
  if (sslmode !== 'require' && sslmode !== 'verify-ca' && sslmode !== 'verify-full') throw new ProtocolError(`invalid sslmode "${sslmode}"`)
  if (sslnegotiation !== 'postgres' && sslnegotiation !== 'direct') throw new ProtocolError(`invalid sslnegotiation "${sslnegotiation}"`)
  return { mode: sslmode, direct: sslnegotiation === 'direct', servername: servername || undefined }
}

export interface LoginIO {
  upstream: ByteQueue
  toUpstream(data: Buffer): void
  /** Whether a cleartext password may cross the client's link. */
  passwordsAllowed: boolean
  /** Authenticate upstream on the client's behalf when it sent a password. */
  offload: boolean
  secureUpstream(asked?: ClientTls): Promise<TLSSocket | undefined>
  /** Connects to Postgres (see StartupIO.connect). */
  connect(login: boolean): Promise<void>
  /** See StartupIO.routeCancel. */
  routeCancel(packet: Buffer): Routed | Promise<Routed>
}

export type LoginOutcome =
  /** Logged in: `answer` is Postgres's whole answer, through ReadyForQuery. */
  | { kind: 'ready'; answer: Buffer }
  /** Postgres asked the client to authenticate (no password came): relay from here on. */
  | { kind: 'relay'; answer: Buffer }
  /** Postgres refused: `answer` ends with its ErrorResponse. */
  | { kind: 'refused'; answer: Buffer; code: string; message: string; /** The proxy refused it (a token), not Postgres. */ byProxy?: boolean }
  /** SSLRequest (answered with `answer`): bytes are relayed as they are from now on. */
  | { kind: 'passthrough'; answer: Buffer; plaintext: boolean }
  /** A CancelRequest, sent on (`why` undefined) or not. */
  | { kind: 'cancel'; answer: Buffer; why?: string }

/** Runs the login upstream, before the upgrade is answered. */
export async function runLogin(io: LoginIO, login: Login): Promise<LoginOutcome> {
  const { first } = login
  if (first.kind === 'cancel') {
    const routed = await io.routeCancel(first.packet)
    if ('refused' in routed) return { kind: 'cancel', answer: Buffer.alloc(0), why: routed.refused }
    await io.connect(false)
    if (login.tls) await io.secureUpstream(login.tls)
    io.toUpstream(routed.packet)
    return { kind: 'cancel', answer: Buffer.alloc(0) }
  }
  if (first.kind === 'startup' && io.offload) checkPasswordsAllowed(io.passwordsAllowed)
  await io.connect(true)
  if (first.kind === 'ssl') {
    io.toUpstream(first.packet)
    const answer = await io.upstream.read(1)
    const tls = answer[0] === SslAnswer.Yes
    if (tls && login.rest.length) io.toUpstream(login.rest) // the ClientHello, once Postgres said yes
    return { kind: 'passthrough', answer, plaintext: !tls }
  }
  if (first.kind !== 'startup') throw new ProtocolError('unsupported startup packet')
  const upstreamTls = await io.secureUpstream(login.tls)
  io.toUpstream(first.packet)
  const answer: Buffer[] = []
  const toClient = (raw: Buffer) => void answer.push(raw)
  const done = () => Buffer.concat(answer)
  try {
    if (io.offload && login.password !== undefined) {
      const refusal = await authenticate({ ...io, toClient }, first.user, login.password, upstreamTls)
      if (refusal) return { kind: 'refused', answer: done(), ...refusal }
    } else {
      // The client authenticates itself: whatever Postgres asks for is its to answer.
      for (;;) {
        const msg = await io.upstream.message(MAX_AUTH_MESSAGE)
        answer.push(msg.raw)
        if (msg.type === 'E') return { kind: 'refused', answer: done(), ...parseErrorFields(msg.body) }
        if (msg.type === 'v') continue
        if (msg.type !== 'R' || msg.body.length < 4 || msg.body.readInt32BE(0) !== 0) return { kind: 'relay', answer: done() }
        break
      }
    }
    // AuthenticationOk: ParameterStatus, BackendKeyData, notices… until ReadyForQuery, or an error
    // (no such database comes now).
    for (;;) {
      const msg = await io.upstream.message(MAX_AUTH_MESSAGE)
      answer.push(msg.raw)
      if (msg.type === 'Z') return { kind: 'ready', answer: done() }
      if (msg.type === 'E') return { kind: 'refused', answer: done(), ...parseErrorFields(msg.body) }
    }
  } catch (err) {
    // Not the PostgreSQL protocol: pass it on as it is, for the client's own parser to refuse (so
    // pg says what it says over TCP); what follows is relayed.
    if (err instanceof UnexpectedMessage) answer.push(err.raw)
    else if (!(err instanceof FramingError)) throw err
    return { kind: 'relay', answer: done() }
  }
}

/** A key's login as the workers pass it to each other (proxy/cluster/worker.ts): its startup packet (base64); throws if that does not parse. */
export function passedLogin(m: { packet: string; password?: string; tls?: unknown }): Login {
  return { bytes: 0, first: parseStartupPacket(Buffer.from(m.packet, 'base64')), password: m.password, rest: EMPTY, tls: m.tls as ClientTls | undefined }
}

/**
 * A login the proxy runs by itself with the password it was given (a warm backend for a pool key,
 * a /sql request's): Postgres never waits on a client here. `connecting` sees the Upstream first.
 */
export async function loginAs(target: HostPort, upstreamTls: UpstreamTls | undefined, login: Login, connecting?: (upstream: Upstream) => void) {
  const upstream = new Upstream(target, upstreamTls)
  connecting?.(upstream)
  upstream.connect()
  const io: LoginIO = {
    upstream: upstream.queue,
    toUpstream: (b) => void upstream.write(b),
    passwordsAllowed: true,
    offload: true,
    secureUpstream: (asked) => upstream.secure(asked),
    connect: async () => {},
    routeCancel: () => ({ refused: 'not a cancel' }),
  }
  return { upstream, outcome: await runLogin(io, login) }
}

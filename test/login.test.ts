/**
 * The login in the WebSocket upgrade (proxy/login/in-upgrade.ts), from the wire: what the proxy does with a
 * login offered as a subprotocol value, well formed or not. Malformed and oversized values get a
 * clear refusal (the upgrade completes, then a FATAL ErrorResponse, as Postgres refuses a bad
 * startup packet); the login is never echoed in the upgrade response and never reaches a log.
 */
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import http from 'node:http'
import net from 'node:net'
import { WebSocket } from 'ws'
import { LOGIN_PREFIX, MAX_LOGIN_CHARS, SUBPROTOCOL, UPSTREAM_TLS_REQUEST } from '../src/config'
import type { SessionLog } from '../proxy/index'
import { backendReader, CANCEL_CODE, gssencRequest, int32, packet, passwordMessage, startupMessage } from './support/protocol'
import { startProxy, testPostgres, within } from './support/helpers'
import { PASSWORD } from './support/stack'

const PG = testPostgres()
let proxy: Awaited<ReturnType<typeof startProxy>>
const logs: SessionLog[] = []

before(async () => (proxy = await startProxy({ log: (entry) => logs.push(entry) })))
after(() => proxy.close())

const b64 = (bytes: Buffer) => bytes.toString('base64url')
const login = (user = 'scram_user', password: string | undefined = PASSWORD) =>
  Buffer.concat([startupMessage({ user, database: PG.database }), ...(password === undefined ? [] : [passwordMessage(password)])])

interface Upgraded {
  status: number
  /** The selected subprotocol and the raw upgrade response headers. */
  protocol?: string
  headers: http.IncomingHttpHeaders
  /** Backend message types received, and each ErrorResponse's fields; then the close code. */
  messages: string[]
  errors: Array<Record<string, string>>
  close?: number
}

/** Reads backend messages into `got`: each type, and each ErrorResponse's fields. */
const recordInto = (got: Upgraded) =>
  backendReader((type, body) => {
    got.messages.push(type)
    if (type !== 'E') return
    const fields: Record<string, string> = {}
    for (const f of body.toString('utf8').split('\0').filter(Boolean)) fields[f[0]] = f.slice(1)
    got.errors.push(fields)
  })

/** Opens a WebSocket offering `protocols` (raw values) and records what comes back until it closes. */
function offer(protocols: string[]): Promise<Upgraded> {
  return within(10000, 'the upgrade and its answer', new Promise((resolve, reject) => {
    const ws = new WebSocket(proxy.url, protocols)
    const got: Upgraded = { status: 0, headers: {}, messages: [], errors: [] }
    const read = recordInto(got)
    ws.on('upgrade', (res) => ((got.status = 101), (got.headers = res.headers)))
    ws.on('open', () => {
      got.protocol = ws.protocol
      // A login that succeeded: end the session cleanly once ReadyForQuery is in.
      const ready = setInterval(() => got.messages.includes('Z') && (clearInterval(ready), ws.close()), 20)
      ws.once('close', () => clearInterval(ready))
    })
    ws.on('message', (data: Buffer) => read(data))
    ws.on('close', (code) => resolve({ ...got, close: code }))
    ws.on('unexpected-response', (_req, res) => resolve({ ...got, status: res.statusCode ?? 0 }))
    ws.on('error', reject)
  }))
}

/**
 * The same with a hand-written upgrade request: `ws` itself refuses to offer values that are not
 * tokens, or the same value twice. Reads unmasked server frames: binary ones, and the close.
 */
function offerRaw(header: string): Promise<Upgraded> {
  return within(10000, 'the raw upgrade and its answer', new Promise((resolve, reject) => {
    const got: Upgraded = { status: 0, headers: {}, messages: [], errors: [] }
    const read = recordInto(got)
    const socket = net.connect(proxy.port, '127.0.0.1')
    socket.on('error', reject)
    socket.write(`GET /v2 HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Protocol: ${header}\r\n\r\n`)
    let buf = Buffer.alloc(0)
    let inHeaders = true
    socket.on('data', (chunk) => {
      buf = Buffer.concat([buf, chunk])
      if (inHeaders) {
        const end = buf.indexOf('\r\n\r\n')
        if (end < 0) return
        const head = buf.subarray(0, end).toString('latin1').split('\r\n')
        got.status = Number(head[0].split(' ')[1])
        for (const line of head.slice(1)) got.headers[line.slice(0, line.indexOf(':')).toLowerCase()] = line.slice(line.indexOf(':') + 1).trim()
        got.protocol = got.headers['sec-websocket-protocol'] as string | undefined
        buf = buf.subarray(end + 4)
        inHeaders = false
      }
      while (buf.length >= 2) {
        const short = buf[1] & 0x7f
        const [length, at] = short === 126 ? [buf.length >= 4 ? buf.readUInt16BE(2) : Infinity, 4] : [short, 2]
        if (buf.length < at + length) return
        const payload = buf.subarray(at, at + length)
        if ((buf[0] & 0x0f) === 2) read(payload)
        if ((buf[0] & 0x0f) === 8) {
          got.close = payload.readUInt16BE(0)
          socket.destroy()
          return resolve(got)
        }
        buf = buf.subarray(at + length)
      }
    })
    socket.on('close', () => resolve(got))
  }))
}

test("a good login: Postgres's whole answer is the first frame; the response selects edgepg.v2 and never echoes the login", async () => {
  const value = LOGIN_PREFIX + b64(login())
  const r = await offer([SUBPROTOCOL, value])
  assert.equal(r.status, 101)
  assert.equal(r.protocol, SUBPROTOCOL)
  assert.equal(r.headers['sec-websocket-protocol'], SUBPROTOCOL, 'only edgepg.v2 in the response')
  assert.ok(!JSON.stringify(r.headers).includes(b64(login()).slice(0, 20)), 'the login is nowhere in the response headers')
  assert.deepEqual(r.messages.filter((m) => m !== 'S'), ['R', 'K', 'Z'], 'AuthenticationOk, ParameterStatus…, BackendKeyData, ReadyForQuery')
})

test('malformed or oversized logins: the upgrade completes, then a FATAL 08P01 saying what is wrong, and a normal close', async () => {
  const tlsRequest = packet(UPSTREAM_TLS_REQUEST, Buffer.from('sslmode\0require\0sslnegotiation\0postgres\0\0'))
  const cases: Array<[string, string[], RegExp]> = [
    ['not base64url', [SUBPROTOCOL, `${LOGIN_PREFIX}abc/def=`], /the login is not base64url/],
    ['too large', [SUBPROTOCOL, LOGIN_PREFIX + 'A'.repeat(MAX_LOGIN_CHARS + 4)], new RegExp(`the login is too large \\(${MAX_LOGIN_CHARS + 4} characters; at most ${MAX_LOGIN_CHARS}\\)`)],
    ['two logins', [SUBPROTOCOL, LOGIN_PREFIX + b64(login()), LOGIN_PREFIX + b64(login())], /more than one login offered/],
    ['a length beyond the bytes', [SUBPROTOCOL, LOGIN_PREFIX + b64(Buffer.concat([int32(200), int32(196608)]))], /invalid startup packet length 200/],
    ['an unknown protocol version', [SUBPROTOCOL, LOGIN_PREFIX + b64(packet(0x00020000, Buffer.from('user\0x\0\0')))], /unsupported frontend protocol 2\.0/],
    ['no user', [SUBPROTOCOL, LOGIN_PREFIX + b64(startupMessage({ database: 'postgres' }))], /no PostgreSQL user name specified/],
    ['garbage after the startup', [SUBPROTOCOL, LOGIN_PREFIX + b64(Buffer.concat([login('scram_user', undefined), Buffer.from('Qxyz')]))], /expected one password message after the startup message/],
    ['bytes after a CancelRequest', [SUBPROTOCOL, LOGIN_PREFIX + b64(Buffer.concat([packet(CANCEL_CODE, Buffer.alloc(8)), Buffer.from('x')]))], /unexpected bytes after the CancelRequest/],
    ['GSSENCRequest', [SUBPROTOCOL, LOGIN_PREFIX + b64(gssencRequest())], /GSSAPI encryption is not supported/],
    ['a TLS request with an unknown sslmode', [SUBPROTOCOL, LOGIN_PREFIX + b64(Buffer.concat([packet(UPSTREAM_TLS_REQUEST, Buffer.from('sslmode\0sometimes\0sslnegotiation\0postgres\0\0')), login()]))], /invalid sslmode "sometimes"/],
    ['TLS asked for twice', [SUBPROTOCOL, LOGIN_PREFIX + b64(Buffer.concat([tlsRequest, tlsRequest, login()]))], /TLS asked for twice/],
    ['a TLS request and nothing behind it', [SUBPROTOCOL, LOGIN_PREFIX + b64(tlsRequest)], /invalid startup packet length 0/],
  ]
  for (const [what, protocols, reason] of cases) {
    const r = await offerRaw(protocols.join(', '))
    assert.equal(r.status, 101, `${what}: the upgrade completes`)
    assert.deepEqual(r.messages, ['E'], `${what}: one ErrorResponse`)
    const [{ S, C, M }] = r.errors
    assert.deepEqual({ S, C }, { S: 'FATAL', C: what === 'no user' ? '28000' : '08P01' }, `${what}: ${M}`)
    assert.match(M, /^malformed login in the WebSocket upgrade: /, what)
    assert.match(M, reason, what)
    assert.equal(r.close, 1000, `${what}: closed normally after the error`)
  }
  // The proxy is unharmed.
  const good = await offer([SUBPROTOCOL, LOGIN_PREFIX + b64(login())])
  assert.ok(good.messages.includes('Z'), 'a good login still works')
})

test('the password never reaches the session log, nor the metrics', async () => {
  const before = logs.length
  for (const user of ['scram_user', 'password_user', 'md5_user']) await offer([SUBPROTOCOL, LOGIN_PREFIX + b64(login(user))])
  await offer([SUBPROTOCOL, LOGIN_PREFIX + b64(login('scram_user', 'wrong-password'))])
  const sessions = () => logs.slice(before).filter((l) => /^(closed by client|refused by Postgres)/.test(l.outcome))
  const deadline = Date.now() + 5000
  while (sessions().length < 4 && Date.now() < deadline) await new Promise((r) => setTimeout(r, 20))
  assert.equal(sessions().length, 4, JSON.stringify(logs.slice(before)))
  const text = JSON.stringify(logs) + (await proxy.metrics.registry.metrics())
  for (const secret of [PASSWORD, 'wrong-password', b64(login()).slice(8, 40), LOGIN_PREFIX]) assert.ok(!text.includes(secret), `"${secret}" appears in the log or metrics`)
  assert.ok(sessions().every((l) => l.bytesIn > 0), 'the login counts as bytes in')
})

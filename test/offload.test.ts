/**
 * Auth offload, the login in the WebSocket upgrade, and end-to-end authentication, observed from
 * both ends of the proxy:
 *
 * - what the CLIENT sends and receives: every WebSocket the driver opens is a `ws` WebSocket
 *   subclass that records each message both ways (`recorder()`), parsed as Postgres protocol;
 * - what POSTGRES sends and receives: the proxies' upstream is a recording TCP relay in front of
 *   the test Postgres (`startRelay()`), so the order of upstream auth and held queries is visible;
 * - where SCRAM's PBKDF2 runs: pg's `deriveKey` (shared by pg's client and the in-process proxy)
 *   is wrapped to note its caller.
 *
 * Non-loopback peers come from a network namespace the test creates (veth pair, 10.x addresses)
 * with a tiny TCP forwarder inside it; without root/iproute2 those tests are skipped with a reason.
 * SCRAM-SHA-256-PLUS is not tested: it needs the proxy→Postgres link over TLS, not built yet.
 */
import { test, describe, before, after } from 'node:test'
import assert from 'node:assert/strict'
import http from 'node:http'
import net from 'node:net'
import { execFile, spawn, type ChildProcess } from 'node:child_process'
import { createRequire } from 'node:module'
import { promisify } from 'node:util'
import { setTimeout as sleep } from 'node:timers/promises'
import { WebSocket, type ClientOptions, type RawData } from 'ws'
import pg from 'pg'
import { neonConfig, Client as NeonClient } from '@neondatabase/serverless'
import { createProxy, type ProxyOptions, type SessionLog } from '../proxy/index'
import { Client, Pool, type ClientConfig } from '../src/index'
import { LOGIN_PREFIX, SUBPROTOCOL, SUBPROTOCOL_CANCEL, SUBPROTOCOL_POSITIONS, SUBPROTOCOL_POSITIONS_FRAMED } from '../src/config'
import { PASSWORD, type Role } from './support/stack'
import { edgeConfig, pgConfig, startPlainWebSocketRelay, testPostgres, within } from './support/helpers'
import { generateCerts, type TestCerts } from './support/certs'

const PG = testPostgres()
const run = promisify(execFile)

// ---------------------------------------------------------------------------------------------
// Nothing may escape: unhandled rejections and uncaught exceptions (an unheard 'error' event).

const escaped: string[] = []
const onUnhandled = (reason: unknown) => escaped.push(`unhandledRejection: ${(reason as Error)?.stack ?? reason}`)
const onUncaught = (err: Error) => escaped.push(`uncaughtException: ${err?.stack ?? err}`)

/** Lets late events (a socket's close after an error) surface, then checks nothing escaped. */
async function nothingEscaped(what: string) {
  await sleep(50)
  assert.deepEqual(escaped, [], `nothing escaped (${what})`)
}

// Every Client and Pool a test makes is ended after the file (and before the namespace's proxies
// close), even when a test fails half-way, so one failure does not cascade into stray errors.
type Endable = { end(): Promise<void>; on(event: 'error', listener: (err: Error) => void): unknown }
const tracked = new Set<Endable>()
function track<T extends Endable>(client: T): T {
  tracked.add(client)
  return client
}
async function endTracked() {
  for (const c of tracked) {
    if ((c as any)._ending || (c as any).ending) continue // end() already called (a second call may never settle)
    c.on('error', () => {}) // the test is over; only closing remains
    await within(5000, 'ending a leftover client', c.end()).catch(() => {})
  }
  tracked.clear()
}

// ---------------------------------------------------------------------------------------------
// Where SCRAM's key derivation runs. pg's sasl.js calls `utils.deriveKey` through the module
// object, and the proxy (in this process) reuses that module, so one wrapper sees both callers.

const pgCryptoUtils = createRequire(import.meta.url)('pg/lib/crypto/utils.js')
const originalDeriveKey = pgCryptoUtils.deriveKey
/** One entry per PBKDF2 run: 'proxy', 'pg client' or 'other'. */
const derivations: string[] = []
function wrappedDeriveKey(this: unknown, ...args: unknown[]) {
  // Synchronous up to here from sasl.continueSession, so the stack names its caller.
  const stack = new Error().stack ?? ''
  derivations.push(/proxy[\\/]login[\\/]in-band\.ts/.test(stack) ? 'proxy' : /pg[\\/]lib[\\/]client\.js/.test(stack) ? 'pg client' : `other: ${stack}`)
  return originalDeriveKey.apply(this, args)
}

// ---------------------------------------------------------------------------------------------
// Postgres protocol, parsed from recorded bytes.

interface Msg {
  /** Tag ('R', 'p', 'P', …) or 'startup' for the untagged StartupMessage. */
  type: string
  body: Buffer
  /** Index (in the recording) of the chunk that completed this message. */
  at: number
}

/** Messages in a byte stream recorded as chunks `{data, at}`; `startup`: it opens with a StartupMessage. */
function parse(chunks: Array<{ data: Buffer; at: number }>, startup: boolean): Msg[] {
  const ends: number[] = []
  let total = 0
  for (const c of chunks) ends.push((total += c.data.length))
  const all = Buffer.concat(chunks.map((c) => c.data))
  const atOffset = (end: number) => chunks[ends.findIndex((e) => e >= end)].at
  const msgs: Msg[] = []
  let i = 0
  if (startup && all.length >= 8) {
    const len = all.readInt32BE(0)
    assert.equal(all.readInt32BE(4), 196608, 'the stream opens with a protocol 3.0 StartupMessage')
    msgs.push({ type: 'startup', body: all.subarray(8, len), at: atOffset(len) })
    i = len
  }
  while (i + 5 <= all.length) {
    const len = all.readInt32BE(i + 1)
    if (i + 1 + len > all.length) break
    msgs.push({ type: String.fromCharCode(all[i]), body: all.subarray(i + 5, i + 1 + len), at: atOffset(i + 1 + len) })
    i += 1 + len
  }
  assert.equal(i, all.length, 'the recording ends on a message boundary')
  return msgs
}

const types = (msgs: Msg[]) => msgs.map((m) => m.type)
/** Authentication request codes (R messages): 0 Ok, 3 cleartext, 5 md5, 10/11/12 SASL. */
const authCodes = (msgs: Msg[]) => msgs.filter((m) => m.type === 'R').map((m) => m.body.readInt32BE(0))

/** Fields of an ErrorResponse body. */
function errorFields(body: Buffer): Record<string, string> {
  const fields: Record<string, string> = {}
  for (let i = 0; i < body.length && body[i] !== 0; ) {
    const end = body.indexOf(0, i + 1)
    fields[String.fromCharCode(body[i])] = body.toString('utf8', i + 1, end)
    i = end + 1
  }
  return fields
}

// ---------------------------------------------------------------------------------------------
// The client's side: a `ws` WebSocket that records every message, in order, both ways.

interface WsLog {
  url: string
  offered?: string | string[]
  /** The subprotocol the server selected ('' for none); undefined until open. */
  protocol?: string
  events: Array<{ dir: 'out' | 'in'; data: Buffer; at: number }>
}

const toBuffer = (data: RawData | ArrayBuffer | string): Buffer =>
  Buffer.isBuffer(data) ? data
  : Array.isArray(data) ? Buffer.concat(data)
  : typeof data === 'string' ? Buffer.from(data)
  : Buffer.from(new Uint8Array(data as ArrayBuffer))

function recorder(wsOptions: ClientOptions = {}) {
  const logs: WsLog[] = []
  /** The headers of each upgrade response. */
  const upgradeHeaders: http.IncomingHttpHeaders[] = []
  class RecordingWebSocket extends WebSocket {
    private readonly log: WsLog
    constructor(url: string, protocols?: string | string[]) {
      super(url, protocols, wsOptions)
      const log: WsLog = (this.log = { url, offered: protocols, events: [] })
      logs.push(log)
      this.on('open', () => (log.protocol = this.protocol))
      this.on('upgrade', (res: http.IncomingMessage) => upgradeHeaders.push(res.headers))
      this.on('message', (data: RawData) => log.events.push({ dir: 'in', data: toBuffer(data), at: log.events.length }))
    }
    send(data: any, ...rest: any[]) {
      this.log.events.push({ dir: 'out', data: toBuffer(data), at: this.log.events.length })
      return (super.send as any)(data, ...rest)
    }
  }
  return {
    WebSocket: RecordingWebSocket as unknown as typeof WebSocket,
    logs,
    upgradeHeaders,
    /** The one WebSocket that opened (a first attempt refused for its subprotocol does not count). */
    session(): WsLog {
      const opened = logs.filter((l) => l.protocol !== undefined)
      assert.equal(opened.length, 1, `exactly one WebSocket opened (${logs.length} attempted)`)
      return opened[0]
    },
  }
}

// The login the client offered in its upgrade (proxy/login/in-upgrade.ts), parsed.

/** The `edgepg.login.` value the WebSocket offered, decoded; undefined if it offered none. */
function loginOf(log: WsLog): Buffer | undefined {
  const offered = ([] as string[]).concat(log.offered ?? [])
  const login = offered.find((p) => p.startsWith(LOGIN_PREFIX))
  return login === undefined ? undefined : Buffer.from(login.slice(LOGIN_PREFIX.length), 'base64url')
}
/** The login's messages: StartupMessage, then the PasswordMessage if there is one. */
const loginMessages = (log: WsLog) => parse([{ data: loginOf(log) ?? Buffer.alloc(0), at: 0 }], true)

/** Whether the client's stream opens with its StartupMessage in band (the proxy did not take a login from the upgrade). */
const startupInBand = (log: WsLog) => !(loginOf(log) && log.protocol === SUBPROTOCOL)
/** WebSocket messages the client sent, each parsed on its own (the first may open with the StartupMessage). */
const sentMessages = (log: WsLog) => log.events.filter((e) => e.dir === 'out').map((e, n) => parse([e], n === 0 && startupInBand(log)))
/** Everything the client received, parsed as one backend stream. */
const received = (log: WsLog) => parse(log.events.filter((e) => e.dir === 'in'), false)
/** Everything the client sent, parsed as one frontend stream. */
const sent = (log: WsLog) => parse(log.events.filter((e) => e.dir === 'out'), startupInBand(log))

// ---------------------------------------------------------------------------------------------
// Postgres's side: a TCP relay in front of it that records both directions per connection.

interface RelaySession {
  events: Array<{ dir: 'toPg' | 'fromPg'; data: Buffer; at: number }>
}

async function startRelay() {
  const sessions: RelaySession[] = []
  const sockets = new Set<net.Socket>()
  const server = net.createServer((client) => {
    const session: RelaySession = { events: [] }
    sessions.push(session)
    const upstream = net.connect(PG.port, PG.host)
    for (const s of [client, upstream]) {
      sockets.add(s)
      s.on('close', () => sockets.delete(s))
      s.on('error', () => {})
    }
    client.on('data', (data) => {
      session.events.push({ dir: 'toPg', data, at: session.events.length })
      upstream.write(data)
    })
    upstream.on('data', (data) => {
      session.events.push({ dir: 'fromPg', data, at: session.events.length })
      client.write(data)
    })
    client.on('close', () => upstream.destroy())
    upstream.on('close', () => client.destroy())
  })
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
  return {
    address: `127.0.0.1:${(server.address() as net.AddressInfo).port}`,
    sessions,
    close() {
      for (const s of sockets) s.destroy()
      return new Promise<void>((resolve) => server.close(() => resolve()))
    },
  }
}
type Relay = Awaited<ReturnType<typeof startRelay>>

/** The relay sessions opened since `from`; asserts there is exactly one and returns it, parsed. */
function upstreamSession(relay: Relay, from: number) {
  const opened = relay.sessions.slice(from)
  assert.equal(opened.length, 1, `exactly one upstream connection (got ${opened.length})`)
  const { events } = opened[0]
  return {
    toPg: parse(events.filter((e) => e.dir === 'toPg'), true),
    fromPg: parse(events.filter((e) => e.dir === 'fromPg'), false),
  }
}

// ---------------------------------------------------------------------------------------------

async function startProxy(options: Partial<ProxyOptions> & { upstream: string }, host = '127.0.0.1') {
  const logs: SessionLog[] = []
  const proxy = createProxy({ log: (entry) => logs.push(entry), ...options })
  const { port } = await proxy.listen(0, host)
  return { ...proxy, port, logs }
}
type TestProxy = Awaited<ReturnType<typeof startProxy>>

/** The proxy logs a session when its WebSocket has closed on the proxy's side, maybe after the client's end(). */
async function sessionsLogged(proxy: TestProxy, n: number) {
  const deadline = Date.now() + 5000
  while (proxy.logs.length < n && Date.now() < deadline) await sleep(10)
  assert.equal(proxy.logs.length, n, `${n} session(s) logged by the proxy`)
}

/** The error a promise rejects with (fails if it resolves). */
async function rejection(promise: Promise<unknown>, what: string): Promise<any> {
  return within(10000, what, promise).then(
    (value) => assert.fail(`${what}: expected a rejection, got ${JSON.stringify(value)}`),
    (err) => err
  )
}

/** pg over TCP, straight to Postgres: the reference for error codes and messages. */
async function tcpError(config: pg.ClientConfig) {
  const client = new pg.Client(config)
  const err = await rejection(client.connect(), 'pg over TCP connect')
  await client.end().catch(() => {})
  assert.ok(err instanceof pg.DatabaseError, `pg over TCP fails with a DatabaseError: ${err}`)
  return err as pg.DatabaseError
}

function assertSameDatabaseError(err: any, expected: pg.DatabaseError, what: string) {
  assert.ok(err instanceof pg.DatabaseError, `${what}: a DatabaseError, got ${err?.stack ?? err}`)
  assert.doesNotMatch(err.message, /Connection terminated unexpectedly/, `${what}: not a bare termination`)
  assert.deepEqual({ code: err.code, severity: err.severity, message: err.message }, { code: expected.code, severity: expected.severity, message: expected.message }, `${what}: Postgres's own error`)
}

let relay: Relay
/** The default proxy: auth offload on. */
let offload: TestProxy
/** authOffload: false — relays the startup untouched. */
let plain: TestProxy

before(async () => {
  process.on('unhandledRejection', onUnhandled)
  process.on('uncaughtException', onUncaught)
  pgCryptoUtils.deriveKey = wrappedDeriveKey
  relay = await startRelay()
  offload = await startProxy({ upstream: relay.address, pool: { enabled: false } }) // every login goes to Postgres, to be recorded
  plain = await startProxy({ upstream: relay.address, authOffload: false })
})

after(async () => {
  await endTracked()
  await offload?.close()
  await plain?.close()
  await relay?.close()
  pgCryptoUtils.deriveKey = originalDeriveKey
  process.off('unhandledRejection', onUnhandled)
  process.off('uncaughtException', onUncaught)
  assert.deepEqual(escaped, [], 'no unhandled rejections or uncaught exceptions in the whole file')
})

/** An edgepg Client through `proxy`, its WebSockets recorded by `rec`. */
const recordedClient = (proxy: TestProxy, role: Role, rec: ReturnType<typeof recorder>, extra: ClientConfig = {}) =>
  track(new Client(edgeConfig(proxy.port, role, { webSocketConstructor: rec.WebSocket as any, connectionTimeoutMillis: 10000, ...extra })))

// ---------------------------------------------------------------------------------------------

describe('auth offload: every upstream method; the login rides in the upgrade and the client sees only AuthenticationOk', () => {
  const ROLE_METHOD: Record<Role, string> = { trust_user: 'nothing (trust)', password_user: 'a cleartext password', md5_user: 'an md5 hash', scram_user: 'SCRAM-SHA-256' }
  /** What Postgres asks the proxy for, per role (pg_hba.conf in test/support/stack.ts). */
  const upstreamAuth: Record<Role, number[]> = {
    trust_user: [0],
    password_user: [3, 0],
    md5_user: [5, 0],
    scram_user: [10, 11, 12, 0],
  }

  for (const role of Object.keys(upstreamAuth) as Role[]) {
    test(role, async () => {
      const rec = recorder()
      const from = relay.sessions.length
      derivations.length = 0
      const client = recordedClient(offload, role, rec)
      await within(10000, 'connect', client.connect())
      const { rows } = await within(10000, 'query', client.query('SELECT current_user AS u, $1::int AS n', [7]))
      assert.deepEqual(rows, [{ u: role, n: 7 }])
      await within(5000, 'end', client.end())

      const log = rec.session()
      assert.deepEqual(types(loginMessages(log)), ['startup', 'p'], 'the upgrade carried the StartupMessage and the PasswordMessage')
      assert.equal(loginMessages(log)[1].body.toString('utf8'), `${PASSWORD}\0`, 'the cleartext password, to the proxy (loopback)')
      assert.equal(types(sent(log)).includes('startup'), false, 'nothing of the login went in band')
      const codes = authCodes(received(log))
      assert.deepEqual(codes, [0], `the client saw AuthenticationOk and no request (got ${codes})`)
      // What Postgres asked for went to the proxy, never further.
      const upstream = upstreamSession(relay, from)
      assert.deepEqual(authCodes(upstream.fromPg), upstreamAuth[role], `Postgres asked the proxy for ${ROLE_METHOD[role]}`)
      const cleartextUpstream = upstream.toPg.some((m) => m.body.includes(PASSWORD))
      assert.equal(cleartextUpstream, role === 'password_user', 'the cleartext password went upstream only where Postgres asked for it')
      if (role === 'md5_user') {
        const hash = upstream.toPg.find((m) => m.type === 'p')!.body.toString('utf8')
        assert.match(hash, /^md5[0-9a-f]{32}\0$/, 'the proxy answered the md5 challenge')
      }
      if (role === 'scram_user') {
        const first = upstream.toPg.find((m) => m.type === 'p')!.body
        assert.ok(first.includes('SCRAM-SHA-256\0'), 'the proxy chose SCRAM-SHA-256 upstream (no TLS upstream: not -PLUS)')
        assert.deepEqual(derivations, ['proxy'], `one PBKDF2 run, in the proxy (got ${derivations.join(', ') || 'none'})`)
      } else {
        assert.deepEqual(derivations, [], 'no SCRAM derivation anywhere')
      }
    })
  }
})

// ---------------------------------------------------------------------------------------------

describe('end-to-end authentication (authOffload: false): the proxy relays the login untouched', () => {
  for (const [what, proxy, extra] of [
    ['the client asks for it', () => offload, { authOffload: false }],
    ['the proxy is started with authOffload: false', () => plain, {}],
  ] as const) {
    test(`${what}: SCRAM between the client and Postgres, and still pg's connect()`, async () => {
      const rec = recorder()
      const from = relay.sessions.length
      derivations.length = 0
      const client = recordedClient(proxy(), 'scram_user', rec, extra)
      await within(10000, 'connect', client.connect())
      assert.ok(Number.isInteger((client as any).processID), 'connected: processID set')
      assert.deepEqual((await within(10000, 'query', client.query('SELECT current_user AS u, $1::int AS n', [3]))).rows, [{ u: 'scram_user', n: 3 }])
      await within(5000, 'end', client.end())
      const log = rec.session()
      assert.equal(log.protocol, SUBPROTOCOL, 'the proxy took the login')
      if ('authOffload' in extra) assert.deepEqual(types(loginMessages(log)), ['startup'], 'the upgrade carried the StartupMessage and no password')
      assert.deepEqual(authCodes(received(log)), [10, 11, 12, 0], 'SCRAM end to end with Postgres')
      assert.deepEqual(derivations, ['pg client'], 'the client derived the SCRAM key')
      const upstream = upstreamSession(relay, from)
      assert.ok(!upstream.toPg.some((m) => m.body.includes(PASSWORD)), 'the password itself never went upstream')
      assert.deepEqual(authCodes(upstream.fromPg), [10, 11, 12, 0])
    })
  }

  test('a wrong password end to end: the same 28P01 as pg over TCP', async () => {
    const expected = await tcpError({ ...pgConfig('scram_user'), password: 'wrong-password' })
    const client = track(new Client(edgeConfig(offload.port, 'scram_user', { password: 'wrong-password', authOffload: false })))
    assertSameDatabaseError(await rejection(client.connect(), 'connect'), expected, 'authOffload: false')
    await within(5000, 'end after failure', client.end())
    await nothingEscaped('end to end, wrong password')
  })
})

// ---------------------------------------------------------------------------------------------

describe("pg's connect(): resolved by ReadyForQuery, one round trip after the upgrade; the first query is the next flight", () => {
  test('await client.connect(); await client.query(…): the upgrade, then the query alone; processID known at once', async () => {
    const rec = recorder()
    const from = relay.sessions.length
    const client = recordedClient(offload, 'scram_user', rec)
    await within(10000, 'connect', client.connect())
    const log = rec.session()
    const before = log.events.length
    assert.ok(log.events.every((e) => e.dir === 'in'), 'connect() resolved on what the proxy sent; the client sent nothing in band')
    assert.deepEqual(types(received(log)).at(-1), 'Z', 'the last thing before connect() resolved: ReadyForQuery')
    const { rows } = await within(10000, 'query', client.query('SELECT pg_backend_pid() AS pid, $1::int AS n', [1]))
    assert.deepEqual(rows, [{ pid: (client as any).processID, n: 1 }], 'processID is the backend’s pid, set when connect() resolved')
    assert.ok(Buffer.isBuffer((client as any).secretKey) || Number.isInteger((client as any).secretKey), 'secretKey set')
    assert.deepEqual(types(sentMessages(log)[0]), ['P', 'B', 'D', 'E', 'S'], 'the first WebSocket message: the query, alone')
    assert.equal(log.events[before].dir, 'out', 'sent after connect() resolved')
    await within(5000, 'end', client.end())
    const { toPg, fromPg } = upstreamSession(relay, from)
    const ready = fromPg.find((m) => m.type === 'Z')!
    assert.ok(toPg.find((m) => m.type === 'P')!.at > ready.at, 'the query reached Postgres after its ReadyForQuery')
  })

  test('queries issued together after connect() leave in one message', async () => {
    const rec = recorder()
    const client = recordedClient(offload, 'scram_user', rec)
    await within(10000, 'connect', client.connect())
    const [a, b] = await within(10000, 'queries', Promise.all([client.query('SELECT $1::int AS n', [1]), client.query('SELECT $1::text AS t', ['two'])]))
    assert.deepEqual([a.rows, b.rows], [[{ n: 1 }], [{ t: 'two' }]])
    await within(5000, 'end', client.end())
    assert.deepEqual(types(sentMessages(rec.session())[0]), ['P', 'B', 'D', 'E', 'S', 'P', 'B', 'D', 'E', 'S'], 'both queries in the first message')
  })

  test("a fresh Pool's pool.query(): the login in the upgrade, then the query", async () => {
    const rec = recorder()
    const pool = track(new Pool({ ...edgeConfig(offload.port, 'scram_user', { webSocketConstructor: rec.WebSocket as any }), max: 1 }))
    try {
      const { rows } = await within(10000, 'pool.query', pool.query('SELECT $1::int AS n', [1]))
      assert.deepEqual(rows, [{ n: 1 }])
    } finally {
      await within(5000, 'pool.end', pool.end())
    }
    const log = rec.session()
    assert.deepEqual(types(loginMessages(log)), ['startup', 'p'])
    assert.deepEqual(types(sentMessages(log)[0]), ['P', 'B', 'D', 'E', 'S'])
  })

  test('a Pool whose password is wrong: the query rejects with 28P01, the failed client is gone, and the pool then serves a good one', async () => {
    const expected = await tcpError({ ...pgConfig('scram_user'), password: 'wrong-password' })
    const pool = track(new Pool({ ...edgeConfig(offload.port, 'scram_user', { password: 'wrong-password' }), max: 1 }))
    const poolErrors: Error[] = []
    pool.on('error', (e) => poolErrors.push(e))
    try {
      assertSameDatabaseError(await rejection(pool.query('SELECT 1'), 'pool.query'), expected, 'pool.query')
      assert.equal(pool.totalCount, 0, 'the failed client was removed from the pool')
      // Same pool, the password corrected (pg-pool builds each new client from pool.options).
      ;(pool as any).options.password = PASSWORD
      const { rows } = await within(10000, 'pool.query after fix', pool.query('SELECT current_user AS u'))
      assert.deepEqual(rows, [{ u: 'scram_user' }])
      assert.equal(pool.totalCount, 1, 'one healthy client')
    } finally {
      await within(5000, 'pool.end', pool.end())
    }
    assert.deepEqual(poolErrors.map((e) => e.message), [], 'no idle-client errors')
    await nothingEscaped('pool')
  })
})

// ---------------------------------------------------------------------------------------------

describe('clients that start in band (Neon’s driver, a login too large for the upgrade): the proxy asks for a cleartext password', () => {
  test('a StartupMessage too large for the upgrade goes in band; the password follows when asked', async () => {
    const rec = recorder()
    // options (a startup parameter) big enough that the login exceeds MAX_LOGIN_CHARS.
    const client = recordedClient(offload, 'scram_user', rec, { options: `-c application_name=${'x'.repeat(50)} ${'-c work_mem=64kB '.repeat(400)}` } as ClientConfig)
    await within(10000, 'connect', client.connect())
    assert.deepEqual((await within(10000, 'query', client.query('SELECT $1::int AS n', [1]))).rows, [{ n: 1 }])
    await within(5000, 'end', client.end())
    const log = rec.session()
    assert.equal(loginOf(log), undefined, 'no login offered: it would not fit')
    assert.equal(log.protocol, SUBPROTOCOL, 'edgepg’s subprotocol still selected')
    const messages = sentMessages(log)
    assert.deepEqual(types(messages[0]), ['startup'], 'first message: the StartupMessage alone')
    assert.deepEqual(types(messages[1]), ['p'], 'then the PasswordMessage alone')
    const asked = received(log).find((m) => m.type === 'R' && m.body.readInt32BE(0) === 3)!
    const outs = log.events.filter((e) => e.dir === 'out')
    assert.ok(outs[1].at > asked.at, 'the password left after the proxy asked for it')
    assert.deepEqual(authCodes(received(log)), [3, 0], 'cleartext request, then Ok')
  })

  describe('@neondatabase/serverless', () => {
    const keys = ['webSocketConstructor', 'useSecureWebSocket', 'pipelineConnect', 'wsProxy'] as const
    const saved: Record<string, unknown> = {}
    before(() => {
      for (const k of keys) saved[k] = (neonConfig as any)[k]
      neonConfig.useSecureWebSocket = false
      neonConfig.wsProxy = () => `127.0.0.1:${offload.port}/v2`
    })
    after(() => {
      for (const k of keys) (neonConfig as any)[k] = saved[k]
    })

    for (const mode of [false, 'password'] as const) {
      for (const role of ['scram_user', 'md5_user'] as const) {
        test(`pipelineConnect: ${JSON.stringify(mode)}, ${role}`, async () => {
          const rec = recorder()
          neonConfig.webSocketConstructor = rec.WebSocket as any
          neonConfig.pipelineConnect = mode
          derivations.length = 0
          const client = track(new NeonClient(pgConfig(role)))
          await within(10000, 'Neon connect', client.connect())
          try {
            const { rows } = await within(10000, 'Neon query', client.query('SELECT current_user AS u, $1::int AS n', [5]))
            assert.deepEqual(rows, [{ u: role, n: 5 }])
          } finally {
            await within(5000, 'Neon end', client.end())
          }
          const log = rec.session()
          assert.deepEqual(authCodes(received(log)), [3, 0], 'Neon saw only the cleartext-password request and Ok')
          const asked = received(log).find((m) => m.type === 'R')!
          const password = sent(log).find((m) => m.type === 'p')!
          if (mode === false) assert.ok(password.at > asked.at, 'pipelineConnect false: the password left after R 3 arrived')
          else assert.ok(password.at < asked.at, "'password': the password left before R 3 arrived (pipelined)")
          assert.deepEqual(derivations, role === 'scram_user' ? ['proxy'] : [], 'SCRAM (if any) ran in the proxy')
        })
      }
    }
  })
})

// ---------------------------------------------------------------------------------------------

describe('negotiation: edgepg’s subprotocol says the proxy took the login; other servers get it in band', () => {
  test('edgepg.v5, edgepg.v4, edgepg.v3, edgepg.v2 and the login offered; edgepg.v2 selected where the session cannot take a cancel (no pool); the login never echoed', async () => {
    const rec = recorder()
    const client = recordedClient(offload, 'scram_user', rec)
    await within(10000, 'connect', client.connect())
    await within(5000, 'end', client.end())
    const log = rec.session()
    const offered = [log.offered].flat()
    assert.equal(offered.length, 5, 'five values offered')
    assert.deepEqual(offered.slice(0, 4), [SUBPROTOCOL_POSITIONS, SUBPROTOCOL_POSITIONS_FRAMED, SUBPROTOCOL_CANCEL, SUBPROTOCOL], 'edgepg.v5 and edgepg.v4 (positions for replicas), edgepg.v3 (cancels on the session), then edgepg.v2')
    assert.match(offered[4]!, new RegExp(`^${LOGIN_PREFIX.replace(/\./g, '\\.')}[A-Za-z0-9_-]+$`), 'then the login, base64url')
    assert.equal(log.protocol, SUBPROTOCOL, 'the proxy selected edgepg.v2')
    assert.deepEqual(rec.upgradeHeaders.map((h) => h['sec-websocket-protocol']), [SUBPROTOCOL], 'the upgrade response names edgepg.v2 and nothing else')
  })

  /** A WebSocket → TCP relay to the test Postgres that knows nothing of edgepg. */
  const plainRelay = (select: (offered: Set<string>) => string | false) => startPlainWebSocketRelay({ host: PG.host, port: PG.port }, select)

  test('a relay that selects no subprotocol: the StartupMessage goes in band, the password only when asked; SCRAM by the client', async () => {
    const other = await plainRelay(() => false)
    try {
      const rec = recorder()
      derivations.length = 0
      const client = recordedClient(offload, 'scram_user', rec, { wsProxy: () => `ws://127.0.0.1:${other.port}/v2` })
      await within(10000, 'connect', client.connect())
      assert.deepEqual((await within(10000, 'query', client.query('SELECT current_user AS u'))).rows, [{ u: 'scram_user' }])
      await within(5000, 'end', client.end())
      const log = rec.session()
      assert.equal(log.protocol, '', 'nothing selected')
      const messages = sentMessages(log)
      assert.deepEqual(types(messages[0]), ['startup'], 'first message: the StartupMessage alone')
      assert.ok(!types(sent(log)).slice(0, 2).includes('p') || received(log)[0].at < log.events.findIndex((e) => e.dir === 'out' && e.data[0] === 0x70), 'no password before Postgres asked')
      assert.deepEqual(authCodes(received(log)), [10, 11, 12, 0], 'Postgres’s own SASL, answered by the client')
      assert.deepEqual(derivations, ['pg client'])
    } finally {
      await other.close()
    }
  })

  test("pipelineConnect: 'password' through such a relay: the password right behind the StartupMessage, where Postgres asks for cleartext", async () => {
    const other = await plainRelay(() => false)
    try {
      const rec = recorder()
      const client = recordedClient(offload, 'password_user', rec, { wsProxy: () => `ws://127.0.0.1:${other.port}/v2`, pipelineConnect: 'password' })
      await within(10000, 'connect', client.connect())
      assert.deepEqual((await within(10000, 'query', client.query('SELECT $1::int AS n', [1]))).rows, [{ n: 1 }])
      await within(5000, 'end', client.end())
      const log = rec.session()
      const outs = log.events.filter((e) => e.dir === 'out')
      assert.deepEqual(outs.slice(0, 2).map((e, i) => types(parse([e], i === 0))), [['startup'], ['p']], 'StartupMessage, then the PasswordMessage at once')
      assert.ok(outs[1].at < received(log)[0].at, 'the password left before anything came back')
      assert.deepEqual(authCodes(received(log)), [3, 0], 'Postgres itself asked for the cleartext password, and got it once')
    } finally {
      await other.close()
    }
  })

  test("pipelineConnect: 'password' where Postgres wants SCRAM: Postgres's own error, not a hang", async () => {
    const other = await plainRelay(() => false)
    try {
      const client = track(new Client(edgeConfig(other.port, 'scram_user', { pipelineConnect: 'password', connectionTimeoutMillis: 10000 })))
      const err = await rejection(client.connect(), 'connect')
      assert.ok(err instanceof pg.DatabaseError, `a DatabaseError, got ${err?.stack ?? err}`)
      // Postgres asked for SASL and read the pipelined PasswordMessage as a SASLInitialResponse.
      assert.deepEqual({ code: err.code, severity: err.severity, message: err.message }, { code: '08P01', severity: 'FATAL', message: 'client selected an invalid SASL authentication mechanism' }, 'Postgres’s own protocol error')
      await within(5000, 'end after failure', client.end())
      await nothingEscaped("'password' vs SCRAM")
    } finally {
      await other.close()
    }
  })

  test('Neon hosts get the password right behind the StartupMessage by rule, unless pipelineConnect: false', async () => {
    const other = await plainRelay(() => false)
    try {
      const firstTwo = async (host: string, extra: ClientConfig = {}) => {
        const rec = recorder()
        const client = track(new Client({ ...pgConfig('password_user'), host, webSocketConstructor: rec.WebSocket as any, wsProxy: () => `ws://127.0.0.1:${other.port}/v2`, connectionTimeoutMillis: 10000, ...extra }))
        await within(10000, `connect as ${host}`, client.connect())
        await within(5000, 'end', client.end())
        const log = rec.session()
        const firstIn = received(log)[0].at
        return log.events.filter((e) => e.dir === 'out' && e.at < firstIn).map((e, i) => types(parse([e], i === 0))[0])
      }
      assert.deepEqual(await firstTwo('ep-foo.neon.tech'), ['startup', 'p'], 'ep-foo.neon.tech')
      assert.deepEqual(await firstTwo('ep-foo.us-east-2.aws.neon.build'), ['startup', 'p'], '*.neon.build')
      assert.deepEqual(await firstTwo('neon.tech.example.com'), ['startup'], 'only a .neon.tech suffix counts')
      assert.deepEqual(await firstTwo('ep-foo.neon.tech', { pipelineConnect: false }), ['startup'], 'pipelineConnect: false wins')
    } finally {
      await other.close()
    }
  })

  test('a server that selects whatever is offered first but does not speak edgepg (a bare `ws` server): connect() fails clearly, never hangs', async () => {
    const other = await plainRelay((offered) => [...offered][0] ?? false)
    try {
      // It selects edgepg.v2 without taking the login: Postgres never sees a StartupMessage.
      const client = track(new Client(edgeConfig(other.port, 'scram_user', { connectionTimeoutMillis: 1000 })))
      const err = await rejection(client.connect(), 'connect')
      assert.match(err.message, /timeout expired/)
      await within(5000, 'end after failure', client.end())
      await nothingEscaped('blind subprotocol selection')
    } finally {
      await other.close()
    }
  })
})

// ---------------------------------------------------------------------------------------------

describe('cleartext passwords over plain ws:// only from loopback, over TLS, or with the operator’s flag', () => {
  test('loopback peers over ws:// are accepted (127.0.0.1 and ::1)', async (t) => {
    for (const host of ['127.0.0.1', '::1']) {
      let proxy: TestProxy
      try {
        proxy = await startProxy({ upstream: relay.address }, host)
      } catch (err) {
        t.diagnostic(`cannot listen on ${host}: ${(err as Error).message}`)
        continue
      }
      try {
        const url = `ws://${host.includes(':') ? `[${host}]` : host}:${proxy.port}/v2`
        const client = track(new Client(edgeConfig(proxy.port, 'scram_user', { wsProxy: () => url })))
        await within(10000, 'connect', client.connect())
        assert.deepEqual((await within(10000, 'query', client.query('SELECT 1 AS x'))).rows, [{ x: 1 }])
        await within(5000, 'end', client.end())
        await sessionsLogged(proxy, 1)
        assert.ok(proxy.logs.length === 1 && /^(127\.|::1$|::ffff:127\.)/.test(proxy.logs[0].peer), `peer ${proxy.logs[0]?.peer} is loopback`)
      } finally {
        await proxy.close()
      }
    }
  })

  describe('a non-loopback peer (from a network namespace)', () => {
    let ns: Netns | undefined
    let unavailable = ''
    let certs: TestCerts | undefined
    let strict: TestProxy, flagged: TestProxy, secure: TestProxy
    let forwarder: ChildProcess | undefined

    before(async () => {
      const made = await createNetns()
      if (typeof made === 'string') return void (unavailable = made)
      ns = made
      certs = await generateCerts()
      strict = await startProxy({ upstream: relay.address }, ns.hostAddress)
      flagged = await startProxy({ upstream: relay.address, allowInsecurePasswords: true }, ns.hostAddress)
      secure = await startProxy({ upstream: relay.address, tls: { cert: certs.server.cert, key: certs.server.key } }, ns.hostAddress)
      forwarder = await startForwarder(ns, [strict.port, flagged.port, secure.port])
    })
    after(async () => {
      await endTracked()
      forwarder?.kill()
      await strict?.close()
      await flagged?.close()
      await secure?.close()
      await certs?.cleanup()
      await ns?.remove()
    })

    /** Client options reaching `proxy` through the namespace: the proxy sees the peer `ns.peerAddress`. */
    const viaNetns = (proxy: TestProxy, rec: ReturnType<typeof recorder>, scheme: 'ws' | 'wss', extra: ClientConfig = {}) =>
      edgeConfig(proxy.port, 'scram_user', {
        webSocketConstructor: rec.WebSocket as any,
        wsProxy: () => `${scheme}://${ns!.peerAddress}:${proxy.port}/v2`,
        connectionTimeoutMillis: 10000,
        ...extra,
      })

    test('plain ws:// without the flag: refused with a FATAL 28000 naming the reason; no password reaches Postgres', async (t) => {
      if (!ns) return t.skip(`${unavailable}: this runs where the suite runs as root (CI does)`)
      const refusal = /refuses passwords over unencrypted ws:\/\//
      const from = relay.sessions.length

      // The default client: whatever it sent goes no further than the proxy.
      const rec = recorder()
      const client = track(new Client(viaNetns(strict, rec, 'ws')))
      const err = await rejection(client.connect().then(() => client.query('SELECT 1')), 'connect + query')
      assert.ok(err instanceof pg.DatabaseError, `a DatabaseError, got ${err?.stack ?? err}`)
      assert.equal(err.code, '28000', `28000 (${err.message})`)
      assert.equal(err.severity, 'FATAL', 'FATAL')
      assert.match(err.message, refusal, 'the message names the refusal')
      await within(5000, 'end after failure', client.end())
      const got = received(rec.session())
      assert.deepEqual(types(got), ['E'], 'the client got one ErrorResponse and no authentication request')
      assert.equal(errorFields(got[0].body).C, '28000', 'its SQLSTATE is 28000')

      // End to end: the same refusal (the proxy offloads auth, so it will not take a password here).
      const rec2 = recorder()
      const endToEnd = track(new Client(viaNetns(strict, rec2, 'ws', { authOffload: false })))
      const err2 = await rejection(endToEnd.connect(), 'end-to-end connect')
      assert.ok(err2 instanceof pg.DatabaseError && err2.code === '28000' && refusal.test(err2.message), `28000 refusal, got ${err2?.stack ?? err2}`)
      await within(5000, 'end after failure', endToEnd.end())
      for (const r of [rec, rec2]) {
        const login = types(loginMessages(r.session()))
        assert.deepEqual(login, ['startup'], `the password never left the client (the upgrade carried: ${login})`)
        // (end() may write pg's Terminate before the proxy's close arrives, as over TCP.)
        assert.deepEqual(types(sent(r.session())).filter((t) => t !== 'X'), [], 'and nothing went in band but a Terminate')
      }

      // One session per WebSocket the clients opened (an attempt declined for its subprotocol counts).
      await sessionsLogged(strict, rec.logs.length + rec2.logs.length)
      assert.ok(strict.logs.every((l) => l.peer === ns!.peerAddress), `the proxy saw the namespace address, not loopback: ${strict.logs.map((l) => l.peer)}`)
      const refused = strict.logs.filter((l) => /^startup refused: .*refuses passwords/.test(l.outcome))
      assert.equal(refused.length, 2, `both sessions refused: ${strict.logs.map((l) => l.outcome).join(' | ')}`)
      const toPg = relay.sessions.slice(from).flatMap((s) => s.events.filter((e) => e.dir === 'toPg'))
      assert.deepEqual(toPg, [], 'not a byte (no StartupMessage, no password) was forwarded to Postgres')
      await nothingEscaped('refusal')
    })

    test('plain ws:// with allowInsecurePasswords: true works', async (t) => {
      if (!ns) return t.skip(`${unavailable}: this runs where the suite runs as root (CI does)`)
      const rec = recorder()
      const client = track(new Client(viaNetns(flagged, rec, 'ws')))
      await within(10000, 'connect', client.connect())
      assert.deepEqual((await within(10000, 'query', client.query('SELECT current_user AS u'))).rows, [{ u: 'scram_user' }])
      await within(5000, 'end', client.end())
      // The driver keeps its password out of a plain ws:// upgrade to another host, so Postgres's own
      // SCRAM runs end to end.
      assert.deepEqual(types(loginMessages(rec.session())), ['startup'], 'no password in the upgrade')
      assert.deepEqual(authCodes(received(rec.session())), [10, 11, 12, 0], 'SCRAM between the client and Postgres')
      await sessionsLogged(flagged, 1)
      assert.deepEqual(flagged.logs.map((l) => l.peer), [ns.peerAddress], 'from the non-loopback peer')
    })

    test('wss:// (the proxy’s TLS listener) works without the flag', async (t) => {
      if (!ns) return t.skip(`${unavailable}: this runs where the suite runs as root (CI does)`)
      const rec = recorder({ ca: certs!.ca.cert, servername: 'localhost' } as ClientOptions) // the certificate names localhost
      const client = track(new Client(viaNetns(secure, rec, 'wss')))
      await within(10000, 'connect', client.connect())
      assert.deepEqual((await within(10000, 'query', client.query('SELECT current_user AS u'))).rows, [{ u: 'scram_user' }])
      await within(5000, 'end', client.end())
      const log = rec.session()
      assert.match(log.url, /^wss:\/\//, 'over wss://')
      assert.deepEqual(types(loginMessages(log)), ['startup', 'p'], 'the password rode in the upgrade, inside TLS')
      await sessionsLogged(secure, 1)
      assert.deepEqual(secure.logs.map((l) => l.peer), [ns.peerAddress], 'from the non-loopback peer')
    })
  })
})

// ---------------------------------------------------------------------------------------------
// A network namespace joined to this one by a veth pair: the only way, on one machine, to reach
// the proxy from an address that is not loopback. Created and removed by this file (needs root).

interface Netns {
  name: string
  /** This side of the veth pair (where the proxies listen). */
  hostAddress: string
  /** The namespace's side (the peer address the proxy sees). */
  peerAddress: string
  remove(): Promise<void>
}

async function createNetns(): Promise<Netns | string> {
  if (process.platform !== 'linux' || process.getuid?.() !== 0) return 'network namespaces need Linux and root'
  const pid = process.pid
  const name = `edgepg-test-${pid}`
  const hostIf = `epg${pid % 100000}h`
  const peerIf = `epg${pid % 100000}n`
  // A /30 chosen from the pid, so concurrent runs do not collide.
  const prefix = `10.${200 + (pid % 50)}.${Math.floor(pid / 50) % 256}`
  const hostAddress = `${prefix}.1`
  const peerAddress = `${prefix}.2`
  const remove = async () => {
    await run('ip', ['netns', 'del', name]).catch(() => {}) // takes the veth pair with it
    await run('ip', ['link', 'del', hostIf]).catch(() => {})
  }
  try {
    await run('ip', ['netns', 'add', name])
    await run('ip', ['link', 'add', hostIf, 'type', 'veth', 'peer', 'name', peerIf, 'netns', name])
    await run('ip', ['addr', 'add', `${hostAddress}/30`, 'dev', hostIf])
    await run('ip', ['link', 'set', hostIf, 'up'])
    await run('ip', ['-n', name, 'addr', 'add', `${peerAddress}/30`, 'dev', peerIf])
    await run('ip', ['-n', name, 'link', 'set', peerIf, 'up'])
  } catch (err) {
    await remove()
    return `cannot create a network namespace: ${(err as any).stderr?.trim() || (err as Error).message}`
  }
  return { name, hostAddress, peerAddress, remove }
}

/**
 * A TCP forwarder inside the namespace: `peerAddress:port` → `hostAddress:port` for each port. The
 * test's clients dial the namespace's address; the proxy sees connections from `peerAddress`.
 * Exits when its stdin closes, so it never outlives the test.
 */
async function startForwarder(ns: Netns, ports: number[]): Promise<ChildProcess> {
  const script = `
    const net = require('net')
    const [listenOn, target, ...ports] = process.argv.slice(1)
    let listening = 0
    for (const port of ports.map(Number)) {
      net.createServer((c) => {
        const u = net.connect(port, target)
        c.on('error', () => u.destroy()); u.on('error', () => c.destroy())
        c.pipe(u).pipe(c)
      }).listen(port, listenOn, () => { if (++listening === ports.length) process.stdout.write('ready\\n') })
    }
    process.stdin.on('end', () => process.exit(0)).resume()
  `
  const child = spawn('ip', ['netns', 'exec', ns.name, process.execPath, '-e', script, ns.peerAddress, ns.hostAddress, ...ports.map(String)], {
    stdio: ['pipe', 'pipe', 'inherit'],
  })
  await within(5000, 'the forwarder in the namespace to listen', new Promise<void>((resolve, reject) => {
    child.once('error', reject)
    child.once('exit', (code) => reject(new Error(`forwarder exited (${code})`)))
    child.stdout!.on('data', (d: Buffer) => d.toString().includes('ready') && resolve())
  }))
  return child
}

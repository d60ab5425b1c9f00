/**
 * Auth offload, negotiated capabilities and pipelined connect (the issue's requirements 1–3),
 * observed from both ends of the proxy:
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
import { SUBPROTOCOL } from '../src/config'
import { PASSWORD, type Role } from './stack'
import { edgeConfig, pgConfig, testPostgres, within } from './helpers'
import { generateCerts, type TestCerts } from './certs'

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
  derivations.push(/proxy[\\/]startup\.ts/.test(stack) ? 'proxy' : /pg[\\/]lib[\\/]client\.js/.test(stack) ? 'pg client' : `other: ${stack}`)
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
  class RecordingWebSocket extends WebSocket {
    private readonly log: WsLog
    constructor(url: string, protocols?: string | string[]) {
      super(url, protocols, wsOptions)
      const log: WsLog = (this.log = { url, offered: protocols, events: [] })
      logs.push(log)
      this.on('open', () => (log.protocol = this.protocol))
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
    /** The one WebSocket that opened (a first attempt refused for its subprotocol does not count). */
    session(): WsLog {
      const opened = logs.filter((l) => l.protocol !== undefined)
      assert.equal(opened.length, 1, `exactly one WebSocket opened (${logs.length} attempted)`)
      return opened[0]
    },
  }
}

/** WebSocket messages the client sent, each parsed on its own (the first opens with the StartupMessage). */
const sentMessages = (log: WsLog) => log.events.filter((e) => e.dir === 'out').map((e, n) => parse([e], n === 0))
/** Everything the client received, parsed as one backend stream. */
const received = (log: WsLog) => parse(log.events.filter((e) => e.dir === 'in'), false)
/** Everything the client sent, parsed as one frontend stream. */
const sent = (log: WsLog) => parse(log.events.filter((e) => e.dir === 'out'), true)

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
  offload = await startProxy({ upstream: relay.address })
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

describe('auth offload: every upstream method, the client only ever sees a cleartext-password request', () => {
  const ROLE_METHOD: Record<Role, string> = { trust_user: 'nothing (trust)', password_user: 'a cleartext password', md5_user: 'an md5 hash', scram_user: 'SCRAM-SHA-256' }
  /** What Postgres asks the proxy for, per role (pg_hba.conf in test/stack.ts). */
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

      const codes = authCodes(received(rec.session()))
      assert.deepEqual(codes, [3, 0], `the client saw AuthenticationCleartextPassword then AuthenticationOk, and nothing else (got ${codes})`)
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

        // Control, same client config: without auth offload, the client itself sees SASL and derives.
        const plainRec = recorder()
        derivations.length = 0
        const direct = recordedClient(plain, role, plainRec)
        await within(10000, 'connect (no offload)', direct.connect())
        assert.deepEqual((await within(10000, 'query', direct.query('SELECT 1 AS x'))).rows, [{ x: 1 }])
        await within(5000, 'end', direct.end())
        assert.deepEqual(authCodes(received(plainRec.session())), [10, 11, 12, 0], 'without offload the client does SCRAM itself')
        assert.deepEqual(derivations, ['pg client'], 'and the PBKDF2 then runs in the client: the counter sees client-side derivation')
      } else {
        assert.deepEqual(derivations, [], 'no SCRAM derivation anywhere')
      }
    })
  }
})

// ---------------------------------------------------------------------------------------------

describe('pipelined connect', () => {
  const QUERY = ['startup', 'p', 'P', 'B', 'D', 'E', 'S']

  /**
   * The held query reached Postgres only after upstream auth: in the relay's recording the query's
   * first message arrives after Postgres's AuthenticationOk, and the SASL exchange before it.
   */
  function assertHeldUntilAuth(from: number) {
    const { toPg, fromPg } = upstreamSession(relay, from)
    assert.deepEqual(types(toPg).slice(0, 8), ['startup', 'p', 'p', 'P', 'B', 'D', 'E', 'S'], 'upstream: StartupMessage, SASLInitialResponse, SASLResponse, then the query')
    const ok = fromPg.find((m) => m.type === 'R' && m.body.readInt32BE(0) === 0)
    assert.ok(ok, 'Postgres sent AuthenticationOk')
    const parse = toPg.find((m) => m.type === 'P')!
    assert.ok(parse.at > ok.at, `the held query reached Postgres after AuthenticationOk (event ${parse.at} vs ${ok.at})`)
  }

  test('await client.connect(); await client.query(…): Startup, password and the query leave in one WebSocket message', async () => {
    const rec = recorder()
    const from = relay.sessions.length
    const client = recordedClient(offload, 'scram_user', rec)
    await within(10000, 'connect', client.connect())
    const { rows } = await within(10000, 'query', client.query('SELECT $1::int AS n', [1]))
    assert.deepEqual(rows, [{ n: 1 }], 'the held query ran after auth, with the right result')
    await within(5000, 'end', client.end())

    const log = rec.session()
    const messages = sentMessages(log)
    assert.deepEqual(types(messages[0]), QUERY, 'first WebSocket message: StartupMessage, PasswordMessage, Parse/Bind/Describe/Execute/Sync')
    assert.equal(messages[0][1].body.toString('utf8'), `${PASSWORD}\0`, 'the PasswordMessage carries the cleartext password')
    assert.equal(log.events[0].dir, 'out', 'sent before anything arrived from the proxy')
    assertHeldUntilAuth(from)
  })

  test('queries issued together after connect() all join the first message', async () => {
    const rec = recorder()
    const client = recordedClient(offload, 'scram_user', rec)
    await within(10000, 'connect', client.connect())
    const [a, b] = await within(10000, 'queries', Promise.all([client.query('SELECT $1::int AS n', [1]), client.query('SELECT $1::text AS t', ['two'])]))
    assert.deepEqual([a.rows, b.rows], [[{ n: 1 }], [{ t: 'two' }]])
    await within(5000, 'end', client.end())
    assert.deepEqual(types(sentMessages(rec.session())[0]), [...QUERY, 'P', 'B', 'D', 'E', 'S'], 'both queries in the first message')
  })

  test("a fresh Pool's pool.query(): the same single first message", async () => {
    const rec = recorder()
    const from = relay.sessions.length
    const pool = track(new Pool({ ...edgeConfig(offload.port, 'scram_user', { webSocketConstructor: rec.WebSocket as any }), max: 1 }))
    try {
      const { rows } = await within(10000, 'pool.query', pool.query('SELECT $1::int AS n', [1]))
      assert.deepEqual(rows, [{ n: 1 }])
    } finally {
      await within(5000, 'pool.end', pool.end())
    }
    assert.deepEqual(types(sentMessages(rec.session())[0]), QUERY, 'first WebSocket message: StartupMessage, PasswordMessage and the query')
    assertHeldUntilAuth(from)
  })
})

// ---------------------------------------------------------------------------------------------

describe('wrong password, unknown database: Postgres’s own error, never a bare termination', () => {
  for (const role of ['password_user', 'md5_user', 'scram_user'] as const) {
    test(`wrong password for ${role} → 28P01`, async () => {
      const expected = await tcpError({ ...pgConfig(role), password: 'wrong-password' })
      assert.equal(expected.code, '28P01', 'pg over TCP: 28P01')

      // Pipelined (the default here): connect() may resolve; then the first query carries the error.
      const client = track(new Client(edgeConfig(offload.port, role, { password: 'wrong-password' })))
      const err = await rejection(client.connect().then(() => client.query('SELECT 1')), 'pipelined connect + query')
      assertSameDatabaseError(err, expected, 'pipelined')
      // A later query gets the same error, not a hang or another kind of failure.
      assertSameDatabaseError(await rejection(client.query('SELECT 2'), 'later query'), expected, 'later query')
      await within(5000, 'end after failure', client.end())

      // Not pipelined: connect() itself rejects.
      const unpipelined = track(new Client(edgeConfig(offload.port, role, { password: 'wrong-password', pipelineConnect: false })))
      assertSameDatabaseError(await rejection(unpipelined.connect(), 'unpipelined connect'), expected, 'pipelineConnect: false')
      await within(5000, 'end after failure', unpipelined.end())
      await nothingEscaped(role)
    })
  }

  test('unknown database → 3D000 (after auth succeeded in the proxy)', async () => {
    for (const role of ['scram_user', 'md5_user'] as const) {
      const expected = await tcpError({ ...pgConfig(role), database: 'no_such_db' })
      assert.equal(expected.code, '3D000', 'pg over TCP: 3D000')
      const client = track(new Client(edgeConfig(offload.port, role, { database: 'no_such_db' })))
      assertSameDatabaseError(await rejection(client.connect().then(() => client.query('SELECT 1')), 'connect + query'), expected, role)
      await within(5000, 'end after failure', client.end())
    }
    await nothingEscaped('unknown database')
  })

  test('a Pool: the query rejects with 28P01, the failed client is gone, and the pool then serves a good one', async () => {
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

describe('clients that do not pipeline: the proxy asks them for a cleartext password', () => {
  test('edgepg with pipelineConnect: false sends its password in its own message, after R 3', async () => {
    const rec = recorder()
    const client = recordedClient(offload, 'scram_user', rec, { pipelineConnect: false })
    await within(10000, 'connect', client.connect())
    assert.deepEqual((await within(10000, 'query', client.query('SELECT $1::int AS n', [1]))).rows, [{ n: 1 }])
    await within(5000, 'end', client.end())
    const log = rec.session()
    assert.equal(log.protocol, SUBPROTOCOL, 'the proxy did announce auth offload; the option overrode it')
    const messages = sentMessages(log)
    assert.deepEqual(types(messages[0]), ['startup'], 'first message: the StartupMessage alone')
    assert.deepEqual(types(messages[1]), ['p'], 'second message: the PasswordMessage alone')
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

describe('negotiation: the WebSocket subprotocol announces auth offload; pipelining follows it', () => {
  test('offloading proxy: edgepg.v1 offered and selected; the socket reports authOffload and the client pipelines', async () => {
    const rec = recorder()
    const client = recordedClient(offload, 'scram_user', rec)
    await within(10000, 'connect', client.connect())
    assert.equal((client.connection as any).stream.authOffload, true, 'client.connection.stream.authOffload')
    await within(10000, 'query', client.query('SELECT 1'))
    await within(5000, 'end', client.end())
    const log = rec.session()
    assert.equal(log.offered, SUBPROTOCOL, 'the driver offered edgepg.v1')
    assert.equal(log.protocol, SUBPROTOCOL, 'the proxy selected it')
    assert.deepEqual(types(sentMessages(log)[0]).slice(0, 2), ['startup', 'p'], 'pipelined')
  })

  test('authOffload: false: nothing selected, no pipelining, SCRAM by the client, and it works', async () => {
    const rec = recorder()
    derivations.length = 0
    const client = recordedClient(plain, 'scram_user', rec)
    await within(10000, 'connect', client.connect())
    assert.equal((client.connection as any).stream.authOffload, false, 'client.connection.stream.authOffload')
    assert.deepEqual((await within(10000, 'query', client.query('SELECT current_user AS u, $1::int AS n', [3]))).rows, [{ u: 'scram_user', n: 3 }])
    await within(5000, 'end', client.end())
    const log = rec.session()
    assert.equal(log.protocol, '', 'no subprotocol selected')
    assert.deepEqual(types(sentMessages(log)[0]), ['startup'], 'first message: only the StartupMessage')
    assert.deepEqual(authCodes(received(log)), [10, 11, 12, 0], 'SCRAM end to end with Postgres')
    assert.deepEqual(derivations, ['pg client'], 'the client derived the SCRAM key')
  })

  test("pipelineConnect: 'password' forces pipelining: fine where Postgres asks for a cleartext password", async () => {
    const rec = recorder()
    const client = recordedClient(plain, 'password_user', rec, { pipelineConnect: 'password' })
    await within(10000, 'connect', client.connect())
    assert.deepEqual((await within(10000, 'query', client.query('SELECT $1::int AS n', [1]))).rows, [{ n: 1 }])
    await within(5000, 'end', client.end())
    const log = rec.session()
    assert.equal(log.protocol, '', 'the proxy announced nothing')
    assert.deepEqual(types(sentMessages(log)[0]), ['startup', 'p', 'P', 'B', 'D', 'E', 'S'], 'pipelined anyway')
    assert.deepEqual(authCodes(received(log)), [3, 0], 'Postgres itself asked for the cleartext password')
  })

  test("pipelineConnect: 'password' where Postgres wants SCRAM: a clear Postgres error, not a hang", async (t) => {
    const client = track(new Client(edgeConfig(plain.port, 'scram_user', { pipelineConnect: 'password', connectionTimeoutMillis: 10000 })))
    const err = await rejection(client.connect().then(() => client.query('SELECT 1')), 'connect + query')
    assert.ok(err instanceof pg.DatabaseError, `a DatabaseError, got ${err?.stack ?? err}`)
    t.diagnostic(`Postgres said: ${err.code} ${err.message}`)
    assert.doesNotMatch(err.message, /Connection terminated unexpectedly/, 'not a bare termination')
    // Postgres asked for SASL and read the pipelined PasswordMessage as a SASLInitialResponse.
    assert.deepEqual({ code: err.code, severity: err.severity, message: err.message }, { code: '08P01', severity: 'FATAL', message: 'client selected an invalid SASL authentication mechanism' }, 'Postgres’s own protocol error')
    await within(5000, 'end after failure', client.end())
    await nothingEscaped("'password' vs SCRAM")
  })

  test('Neon hosts pipeline by rule, without an announcement', () => {
    const decide = (host: string, extra: ClientConfig = {}) => {
      const client = new Client({ host, user: 'u', password: 'p', database: 'd', webSocketConstructor: WebSocket as any, ...extra })
      ;(client.connection as any).stream.authOffload = false // as after opening to a proxy that selected nothing
      return (client as any).shouldPipelineConnect() as boolean
    }
    assert.equal(decide('ep-foo.neon.tech'), true, 'ep-foo.neon.tech')
    assert.equal(decide('ep-foo.us-east-2.aws.neon.build'), true, '*.neon.build')
    assert.equal(decide('db.example.com'), false, 'other hosts: off')
    assert.equal(decide('neon.tech.example.com'), false, 'only a .neon.tech suffix counts')
    assert.equal(decide('ep-foo.neon.tech', { pipelineConnect: false }), false, 'pipelineConnect: false wins')
    assert.equal(decide('db.example.com', { pipelineConnect: 'password' }), true, "'password' forces it on")
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

      // Not pipelined: the password never leaves the client at all.
      const rec2 = recorder()
      const unpipelined = track(new Client(viaNetns(strict, rec2, 'ws', { pipelineConnect: false })))
      const err2 = await rejection(unpipelined.connect(), 'unpipelined connect')
      assert.ok(err2 instanceof pg.DatabaseError && err2.code === '28000' && refusal.test(err2.message), `28000 refusal, got ${err2?.stack ?? err2}`)
      await within(5000, 'end after failure', unpipelined.end())
      const sentTypes = types(sent(rec2.session()))
      assert.ok(sentTypes[0] === 'startup' && !sentTypes.includes('p'), `the password never left the client (sent: ${sentTypes})`)

      // One session per WebSocket the clients opened (an attempt declined for its subprotocol counts).
      await sessionsLogged(strict, rec.logs.length + rec2.logs.length)
      assert.ok(strict.logs.every((l) => l.peer === ns!.peerAddress), `the proxy saw the namespace address, not loopback: ${strict.logs.map((l) => l.peer)}`)
      const refused = strict.logs.filter((l) => /^startup refused: .*refuses passwords/.test(l.outcome))
      assert.equal(refused.length, 2, `both sessions refused: ${strict.logs.map((l) => l.outcome).join(' | ')}`)
      const toPg = relay.sessions.slice(from).flatMap((s) => s.events.filter((e) => e.dir === 'toPg'))
      assert.deepEqual(toPg, [], 'not a byte (no StartupMessage, no password) was forwarded to Postgres')
      await nothingEscaped('refusal')
    })

    // The proxy declines edgepg.v1 where it will refuse passwords, so the driver does not pipeline
    // and its cleartext password never crosses the network.
    test(
      'plain ws:// without the flag: the driver is not invited to pipeline, so its password stays home',
      async (t) => {
        if (!ns) return t.skip(`${unavailable}: this runs where the suite runs as root (CI does)`)
        const rec = recorder()
        const client = track(new Client(viaNetns(strict, rec, 'ws')))
        await rejection(client.connect().then(() => client.query('SELECT 1')), 'connect + query')
        await within(5000, 'end after failure', client.end())
        const opened = rec.logs.filter((l) => l.protocol !== undefined)
        const sentTypes = opened.flatMap((l) => types(sent(l)))
        assert.ok(!sentTypes.includes('p'), `no PasswordMessage left the client over plain ws:// (sent: ${sentTypes}; subprotocol: ${opened.map((l) => JSON.stringify(l.protocol))})`)
      }
    )

    test('plain ws:// with allowInsecurePasswords: true works', async (t) => {
      if (!ns) return t.skip(`${unavailable}: this runs where the suite runs as root (CI does)`)
      const rec = recorder()
      const client = track(new Client(viaNetns(flagged, rec, 'ws')))
      await within(10000, 'connect', client.connect())
      assert.deepEqual((await within(10000, 'query', client.query('SELECT current_user AS u'))).rows, [{ u: 'scram_user' }])
      await within(5000, 'end', client.end())
      assert.deepEqual(authCodes(received(rec.session())), [3, 0], 'cleartext to the proxy, SCRAM upstream')
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
      assert.deepEqual(types(sentMessages(log)[0]).slice(0, 2), ['startup', 'p'], 'pipelined')
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

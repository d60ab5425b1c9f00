/**
 * connect() exactly as pg's: it resolves on Postgres's ReadyForQuery (the login rides in the
 * WebSocket upgrade, so that is one round trip) and rejects with what pg over TCP gets, field for
 * field. Around it, the socket behaves as pg's TCP socket does: timeouts, silent and garbage
 * upstreams, a Postgres that hangs up, errors on idle clients, no event after end(), no hold on
 * the event loop, domains; and concurrent queries raise no deprecation warning.
 */
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { spawn } from 'node:child_process'
import net from 'node:net'
import { setTimeout as sleep } from 'node:timers/promises'
import pg from 'pg'
import { Client, Pool, type ClientConfig } from '../src/index'
import { edgeConfig, pgConfig, startProxy, testPostgres, within, eventually } from './support/helpers'
import { freePort, hbaLines, PASSWORD, ROLES, startPostgres, type Postgres, type Role } from './support/stack'

// Nothing may escape: an 'error' event nobody listens to is an uncaught exception.
const escaped: string[] = []
const onUncaught = (err: Error) => escaped.push(`uncaughtException: ${err?.stack ?? err}`)
const onUnhandled = (reason: unknown) => escaped.push(`unhandledRejection: ${(reason as Error)?.stack ?? reason}`)

let proxy: Awaited<ReturnType<typeof startProxy>>
/** A Postgres of this file's own: few connections, and pg_hba.conf lines for named roles only. */
let own: Postgres
let ownProxy: Awaited<ReturnType<typeof startProxy>>
const MAX_CONNECTIONS = 6

before(async () => {
  process.on('uncaughtException', onUncaught)
  process.on('unhandledRejection', onUnhandled)
  proxy = await startProxy()
  own = await startPostgres({
    name: 'connect-pg',
    settings: { max_connections: String(MAX_CONNECTIONS), superuser_reserved_connections: '0', reserved_connections: '0' },
    roles: { ...ROLES, stranger: 'scram-sha-256' },
    // No line for `stranger`: "no pg_hba.conf entry".
    hba: ['local all all trust', ...hbaLines(ROLES), 'host all postgres 127.0.0.1/32 scram-sha-256'],
  })
  ownProxy = await startProxy({ upstream: `${own.host}:${own.port}` })
})

after(async () => {
  await proxy?.close()
  await ownProxy?.close()
  await own?.stop()
  process.off('uncaughtException', onUncaught)
  process.off('unhandledRejection', onUnhandled)
  assert.deepEqual(escaped, [], 'nothing escaped in the whole file')
})

/** Everything an error carries, to compare pg over TCP with edgepg field for field. */
function fields(err: any) {
  if (!(err instanceof Error)) return { notAnError: String(err) }
  return { ...err, kind: err instanceof pg.DatabaseError ? 'DatabaseError' : err.constructor.name, message: err.message }
}

type Connector = (config: ClientConfig) => Promise<unknown>
/** connect() four ways: Client with a promise, Client with a callback, pool.connect() with each. */
const CONNECTORS: Array<[string, Connector]> = [
  ['client.connect()', (config) => new Client(config).connect()],
  ['client.connect(callback)', (config) => new Promise((resolve, reject) => new Client(config).connect((err: Error | undefined) => (err ? reject(err) : resolve(undefined))))],
  ['pool.connect()', async (config) => {
    const pool = new Pool({ ...config, max: 1 })
    try {
      ;(await pool.connect()).release()
    } finally {
      await pool.end()
    }
  }],
  ['pool.connect(callback)', async (config) => {
    const pool = new Pool({ ...config, max: 1 })
    try {
      await new Promise((resolve, reject) => pool.connect((err, _client, release) => (err ? reject(err) : (release(), resolve(undefined)))))
    } finally {
      await pool.end()
    }
  }],
]

/** The rejection of `connect` through the proxy, against pg's own over TCP with the same config. */
async function sameRejection(what: string, tcp: pg.ClientConfig, edge: ClientConfig) {
  const client = new pg.Client(tcp)
  const expected = await within(10000, `${what}: pg over TCP`, client.connect()).then(() => assert.fail(`${what}: pg over TCP connected`), (e) => e)
  await client.end().catch(() => {})
  for (const [how, connect] of CONNECTORS) {
    const got = await within(10000, `${what}: ${how}`, connect(edge)).then(() => assert.fail(`${what}: ${how} resolved`), (e) => e)
    assert.deepEqual(fields(got), fields(expected), `${what}: ${how} rejects as pg over TCP does`)
  }
  return expected
}

const through = (port: number, role: Role | 'stranger' | 'nobody', extra: ClientConfig = {}, info = testPostgres()) => ({
  tcp: { ...pgConfig('scram_user', info), user: role, ...extra } as pg.ClientConfig,
  edge: edgeConfig(port, 'scram_user', { ...pgConfig('scram_user', info), user: role, ...extra }),
})

test("connect() rejects with Postgres's own error, field for field as pg over TCP, however it is called", async () => {
  for (const role of ['password_user', 'md5_user', 'scram_user'] as const) {
    const wrong = through(proxy.port, role, { password: 'wrong-password' })
    assert.equal((await sameRejection(`wrong password for ${role}`, wrong.tcp, wrong.edge)).code, '28P01')
    const empty = through(proxy.port, role, { password: '' })
    await sameRejection(`empty password for ${role}`, empty.tcp, empty.edge)
  }
  const unknownUser = through(proxy.port, 'nobody')
  assert.equal((await sameRejection('unknown user', unknownUser.tcp, unknownUser.edge)).code, '28P01')
  const unknownDb = through(proxy.port, 'scram_user', { database: 'no_such_db' })
  assert.equal((await sameRejection('unknown database', unknownDb.tcp, unknownDb.edge)).code, '3D000')
  const noHba = through(ownProxy.port, 'stranger', {}, own)
  const hbaError = await sameRejection('no pg_hba.conf entry', noHba.tcp, noHba.edge)
  assert.equal(hbaError.code, '28000')
  assert.match(hbaError.message, /no pg_hba\.conf entry/)
})

test('connect() rejects with 53300 when Postgres has no connection left, as over TCP', async () => {
  const holders: pg.Client[] = []
  try {
    for (let i = 0; i < MAX_CONNECTIONS; i++) {
      const c = new pg.Client(pgConfig('scram_user', own))
      await c.connect()
      holders.push(c)
    }
    const full = through(ownProxy.port, 'scram_user', {}, own)
    assert.equal((await sameRejection('too many connections', full.tcp, full.edge)).code, '53300')
  } finally {
    await Promise.all(holders.map((c) => c.end()))
  }
})

test('when connect() resolves, processID and secretKey are set, and they cancel a running query', async () => {
  for (const [how, open] of [
    ['Client', async () => { const c = new Client(edgeConfig(proxy.port)); await c.connect(); return { client: c, done: () => c.end() } }],
    ['pool.connect()', async () => { const p = new Pool({ ...edgeConfig(proxy.port), max: 1 }); const c = await p.connect(); return { client: c, done: async () => (c.release(), await p.end()) } }],
  ] as const) {
    const { client, done } = await open()
    const c = client as any
    assert.ok(Number.isInteger(c.processID) && c.processID > 0, `${how}: processID ${c.processID}`)
    assert.ok(c.secretKey !== null && c.secretKey !== undefined, `${how}: secretKey set`)
    assert.ok(c.processID >= 2 ** 30, `${how}: processID is the session's, one no backend has (transaction pooling): ${c.processID}`)
    const sleeping = client.query('SELECT pg_sleep(30)')
    await sleep(100)
    const started = Date.now()
    ;(new Client(edgeConfig(proxy.port)) as any).cancel(client, (client as any)._activeQuery ?? (client as any)._sentQueryQueue[0])
    const err: any = await within(5000, `${how}: the cancelled query`, sleeping.then(() => assert.fail('not cancelled'), (e) => e))
    assert.equal(err.code, '57014', `${how}: ${err.message}`)
    assert.ok(Date.now() - started < 3000, `${how}: cancelled promptly`)
    await done()
  }
})

// ---------------------------------------------------------------------------------------------
// Upstreams that do not behave: a server that never answers, one that answers garbage.

/** A TCP server on loopback; `onConnection` decides what it does with each socket. */
async function fakeUpstream(onConnection: (socket: net.Socket) => void) {
  const sockets = new Set<net.Socket>()
  const server = net.createServer((socket) => {
    sockets.add(socket)
    socket.on('close', () => sockets.delete(socket))
    socket.on('error', () => {})
    onConnection(socket)
  })
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
  const address = `127.0.0.1:${(server.address() as net.AddressInfo).port}`
  return {
    address,
    port: (server.address() as net.AddressInfo).port,
    close: () => new Promise<void>((resolve) => (sockets.forEach((s) => s.destroy()), server.close(() => resolve()))),
  }
}

test('connectionTimeoutMillis covers the whole login: a silent Postgres makes connect() reject, and nothing fires later', async () => {
  const silent = await fakeUpstream(() => {}) // accepts, never answers
  const p = await startProxy({ upstream: silent.address, handshakeTimeoutMs: 1500 })
  try {
    const client = new Client({ ...edgeConfig(p.port), connectionTimeoutMillis: 500 })
    const errors: Error[] = []
    client.on('error', (e) => errors.push(e))
    const started = Date.now()
    const err: Error = await within(5000, 'connect', client.connect().then(() => assert.fail('connected'), (e) => e))
    assert.ok(Date.now() - started < 1400, `rejected by the client's own timeout (${Date.now() - started} ms)`)
    // pg over TCP to the same silent server says the same, in its own words.
    const tcp = new pg.Client({ ...pgConfig('scram_user'), port: silent.port, connectionTimeoutMillis: 500 })
    const tcpErr: Error = await tcp.connect().then(() => assert.fail('connected'), (e) => e)
    assert.ok(err.message.includes(tcpErr.message), `"${err.message}" carries pg's "${tcpErr.message}"`)
    await client.end()
    await sleep(2000) // past the proxy's own timeout for the login
    assert.deepEqual(errors.map((e) => e.message), [], 'no error event after end()')
    await eventually(() => p.sessionCount === 0, 'the proxy to let the session go')

    // Without a client timeout the proxy's own ends the wait: a DatabaseError, not a hang.
    const patient = new Client(edgeConfig(p.port))
    const late: any = await within(5000, 'connect without a timeout', patient.connect().then(() => assert.fail('connected'), (e) => e))
    assert.ok(late instanceof pg.DatabaseError, `a DatabaseError: ${late?.stack ?? late}`)
    assert.match(late.message, /login timed out: Postgres at 127\.0\.0\.1:\d+ did not answer within 1500 ms/)
    await patient.end()
  } finally {
    await p.close()
    await silent.close()
  }
})

test('an upstream that answers garbage (a MySQL greeting): connect() fails as pg over TCP does', async () => {
  const greeting = Buffer.from('SgAAAAo4LjAuMjgAHwAAAB4dKyUJZ2p6AP///wIA/98VAAAAAAAAAAAAAAo1YiNJajgKKGkpfgBjYWNoaW5nX3NoYTJfcGFzc3dvcmQA', 'base64')
  const mysql = await fakeUpstream((socket) => socket.write(greeting))
  const p = await startProxy({ upstream: mysql.address })
  try {
    const tcp = new pg.Client({ ...pgConfig('scram_user'), port: mysql.port, connectionTimeoutMillis: 3000 })
    const expected = await tcp.connect().then(() => assert.fail('connected'), (e) => e)
    ;(tcp as any).connection.stream.destroy() // end() would wait for a server that never hangs up
    for (const extra of [{}, { authOffload: false }]) {
      const client = new Client({ ...edgeConfig(p.port), connectionTimeoutMillis: 3000, ...extra })
      const err = await within(5000, 'connect', client.connect().then(() => assert.fail('connected'), (e) => e))
      assert.deepEqual(fields(err), fields(expected), `${JSON.stringify(extra)}: as pg over TCP (${expected.message})`)
      await client.end()
    }
  } finally {
    await p.close()
    await mysql.close()
  }
})

// ---------------------------------------------------------------------------------------------
// The socket, as pg sees it.

/** The events a client emits (errors by message), and its query's outcome, when its backend is terminated. */
async function terminated(make: () => pg.Client, idle: boolean) {
  const client = make()
  const events: string[] = []
  client.on('error', (e) => events.push(`error: ${e.message}`))
  client.on('end', () => events.push('end'))
  await client.connect()
  const { rows } = await client.query('SELECT pg_backend_pid() AS pid')
  const running = idle ? undefined : client.query('SELECT pg_sleep(10)').then(() => 'resolved', (e: Error) => e.message)
  await sleep(100)
  const admin = new pg.Client(pgConfig('trust_user'))
  await admin.connect()
  await admin.query('SELECT pg_terminate_backend($1)', [rows[0].pid])
  await admin.end()
  const outcome = await running
  await eventually(() => events.includes('end'), "the client's end event")
  await sleep(200) // anything later
  await within(2000, 'end() after the connection ended', client.end())
  return { events, outcome }
}

test('Postgres hanging up reads as TCP end: the same events and errors as pg over TCP, idle or mid-query', async () => {
  for (const idle of [true, false]) {
    const expected = await terminated(() => new pg.Client(pgConfig('scram_user')), idle)
    const got = await terminated(() => new Client(edgeConfig(proxy.port)), idle)
    assert.deepEqual(got, expected, `${idle ? 'idle' : 'mid-query'}: as over TCP`)
    assert.ok(expected.events.includes('error: Connection terminated unexpectedly'), `pg's own words: ${expected.events}`)
  }
})

test("the socket has net.Socket's `destroyed`; end() closes it with no event after", async () => {
  const client = new Client(edgeConfig(proxy.port))
  const events: string[] = []
  for (const e of ['error', 'notice', 'notification'] as const) client.on(e as 'error', () => events.push(e))
  await client.connect()
  const stream = (client as any).connection.stream
  assert.equal(stream.destroyed, false)
  await client.query('SELECT 1')
  await client.end()
  assert.equal(stream.destroyed, true)
  await sleep(300)
  assert.deepEqual(events, [], 'nothing after end()')
})

/** Runs `code` (ESM, importing the built bundle) in a fresh Node; resolves with its exit code and output. */
function inFreshNode(code: string, timeoutMs = 10000): Promise<{ code: number | null; out: string; timedOut: boolean }> {
  return new Promise((resolve) => {
    const child = spawn(process.execPath, ['--input-type=module', '-e', code], { cwd: process.cwd(), stdio: ['ignore', 'pipe', 'pipe'] })
    let out = ''
    child.stdout.on('data', (d) => (out += d))
    child.stderr.on('data', (d) => (out += d))
    const timer = setTimeout(() => child.kill('SIGKILL'), timeoutMs)
    child.on('exit', (code, signal) => (clearTimeout(timer), resolve({ code, out, timedOut: signal === 'SIGKILL' })))
  })
}

test('a failed connect leaves nothing holding the event loop: Node exits by itself', async () => {
  const closedPort = await freePort()
  const cases = {
    'wrong password': `{ ...base, password: 'wrong' }`,
    'proxy unreachable': `{ ...base, wsProxy: () => 'ws://127.0.0.1:${closedPort}/v2' }`,
    'no such database': `{ ...base, database: 'no_such_db' }`,
  }
  for (const [what, config] of Object.entries(cases)) {
    const { code, out, timedOut } = await inFreshNode(`
      import { WebSocket } from 'ws'
      import { Client } from './dist/index.mjs'
      const base = ${JSON.stringify({ ...pgConfig('scram_user') })}
      Object.assign(base, { webSocketConstructor: WebSocket, wsProxy: () => 'ws://127.0.0.1:${proxy.port}/v2' })
      new Client(${config}).connect((err) => console.log('connect:', err ? 'failed' : 'connected'))
    `)
    assert.ok(!timedOut, `${what}: Node did not exit by itself:\n${out}`)
    assert.equal(code, 0, `${what}: ${out}`)
    assert.match(out, /connect: failed/, what)
  }
})

test('errors reach the domain they were raised in, and drain follows, as with pg over TCP', async () => {
  const run = (lib: string, config: string) =>
    inFreshNode(`
      import domain from 'node:domain'
      import { WebSocket } from 'ws'
      import { ${lib === 'pg' ? 'default as pg' : 'Pool, Query'} } from '${lib === 'pg' ? 'pg' : './dist/index.mjs'}'
      ${lib === 'pg' ? 'const { Pool, Query } = pg' : ''}
      const pool = new Pool(${config})
      const d = domain.create()
      d.on('error', (err) => console.log('domain:', err.code, err.message))
      d.run(() =>
        pool.connect((err, client, release) => {
          // A Query with no callback: its error is an 'error' event, which the domain receives.
          client.query(new Query('SELECT no_such_column'))
          client.on('drain', () => {
            console.log('drain')
            release()
            pool.end()
          })
        })
      )
    `)
  const config = pgConfig('scram_user')
  const tcp = await run('pg', JSON.stringify(config))
  const edge = await run('edgepg', `{ ...${JSON.stringify(config)}, webSocketConstructor: WebSocket, wsProxy: () => 'ws://127.0.0.1:${proxy.port}/v2' }`)
  assert.equal(tcp.out, 'domain: 42703 column "no_such_column" does not exist\ndrain\n', `pg over TCP: ${tcp.out}`)
  assert.equal(edge.out, tcp.out, 'the same through edgepg')
  assert.equal(edge.code, 0)
})

test("concurrent queries (pipelined) raise no DeprecationWarning; with pipeline: false pg's own warning still comes", async () => {
  const run = (extra: string) =>
    inFreshNode(`
      import { WebSocket } from 'ws'
      import Cursor from 'pg-cursor'
      import { Client } from './dist/index.mjs'
      const warnings = []
      process.on('warning', (w) => warnings.push(w.name + ': ' + w.message))
      const client = new Client({ ...${JSON.stringify(pgConfig('scram_user'))}, webSocketConstructor: WebSocket, wsProxy: () => 'ws://127.0.0.1:${proxy.port}/v2' ${extra} })
      const connecting = client.connect()
      // Queued before connect() resolves, while others run, and a cursor behind them.
      const all = [client.query('SELECT 1'), client.query('SELECT 2')]
      await connecting
      all.push(client.query('SELECT 3'), client.query('SELECT 4'))
      const cursor = client.query(new Cursor('SELECT generate_series(1, 3) AS n'))
      all.push(client.query('SELECT 5'))
      const rows = await new Promise((resolve, reject) => cursor.read(10, (err, r) => (err ? reject(err) : resolve(r))))
      await new Promise((resolve) => cursor.close(resolve))
      await Promise.all(all)
      await client.end()
      await new Promise((r) => setImmediate(r))
      console.log(JSON.stringify({ rows: rows.length, warnings }))
    `)
  const pipelined = await run('')
  assert.equal(pipelined.code, 0, pipelined.out)
  assert.deepEqual(JSON.parse(pipelined.out.trim().split('\n').at(-1)!), { rows: 3, warnings: [] })
  const serial = await run(', pipeline: false')
  assert.equal(serial.code, 0, serial.out)
  const { warnings } = JSON.parse(serial.out.trim().split('\n').at(-1)!)
  assert.ok(warnings.some((w: string) => /DeprecationWarning: Calling client\.query\(\) when the client is already executing a query/.test(w)), `pg's warning with pipeline: false: ${warnings}`)
})

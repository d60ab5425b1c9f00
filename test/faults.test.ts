/**
 * Faults: a client that vanishes mid-query (its backend must not linger), Postgres restarted under
 * running sessions, Postgres unreachable, and the proxy itself restarted under a Pool. Every wait
 * is bounded. Postgres restarts happen on a Postgres of this file's own (with TLS on, so the
 * cancel over TLS can be seen too); the shared test Postgres is never stopped.
 */
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import net from 'node:net'
import pg from 'pg'
import { WebSocket } from 'ws'
import { createProxy, type ProxyOptions, type SessionLog } from '../proxy/index'
import { LoginWatch, cancelRequest } from '../proxy/wire/startup'
import { Client, Pool, type ClientConfig } from '../src/index'
import { generateCerts, type TestCerts } from './support/certs'
import { backends, edgeConfig, eventually, pgConfig, testPostgres } from './support/helpers'
import { freePort, startPostgres, type Postgres } from './support/stack'
import { message } from './support/protocol'

const unhandled: unknown[] = []
const onUnhandled = (reason: unknown) => unhandled.push(reason)

let certs: TestCerts
/**
 * A Postgres 18 of this file's own, with TLS on, that can be shut down (fast shutdown, as `pg_ctl stop`
 * does by default) and started again on the same data.
 */
let own: Postgres
before(async () => {
  process.on('unhandledRejection', onUnhandled)
  certs = await generateCerts()
  own = await startPostgres({ name: 'faults-pg', ssl: certs.server })
})
after(async () => {
  await own?.stop()
  await certs?.cleanup()
  process.off('unhandledRejection', onUnhandled)
  assert.deepEqual(unhandled, [], 'no unhandled rejections')
})

/** An in-process proxy that records its session log. */
async function proxyTo(upstream: string, options: Partial<ProxyOptions> = {}, port = 0) {
  const logs: SessionLog[] = []
  const proxy = createProxy({ upstream, log: (l) => logs.push(l), ...options })
  const address = await proxy.listen(port, '127.0.0.1')
  return Object.assign(proxy, { port: address.port, logs })
}

/** Client options for `proxyPort`, aimed at `db` (default: the shared test Postgres). */
function configVia(proxyPort: number, extra: ClientConfig = {}, db: { host: string; port: number; database: string } = testPostgres()): ClientConfig {
  return { ...edgeConfig(proxyPort, 'scram_user', extra), host: db.host, port: db.port, database: db.database }
}

/** pg_stat_activity rows for an application_name, asked straight over TCP (trust_user). */
async function activity(app: string, db: { host: string; port: number; database: string } = testPostgres()) {
  const admin = new pg.Client({ host: db.host, port: db.port, database: db.database, user: 'trust_user' })
  await admin.connect()
  try {
    const { rows } = await admin.query('SELECT pid, state, query FROM pg_stat_activity WHERE application_name = $1', [app])
    return rows as Array<{ pid: number; state: string; query: string }>
  } finally {
    await admin.end()
  }
}

/** Sockets connected to `port`: the proxy's upstream connections, cancel requests included. */
const upstreamConnects = new Map<number, number>()
const socketConnect = net.Socket.prototype.connect
net.Socket.prototype.connect = function (this: net.Socket, ...args: any[]) {
  // net.connect() hands its arguments on already normalized: [options, callback].
  const port = Number((Array.isArray(args[0]) ? args[0][0] : args[0])?.port)
  if (port) upstreamConnects.set(port, (upstreamConnects.get(port) ?? 0) + 1)
  return socketConnect.apply(this, args as any)
} as typeof socketConnect
const connectsTo = (port: number) => upstreamConnects.get(port) ?? 0

/** Drops the client's TCP connection to the proxy without a word: no Terminate, no close frame. */
function vanish(client: Client) {
  const socket = (client.connection.stream as any).ws._socket as net.Socket
  assert.ok(socket, 'the client has a live socket to vanish from')
  socket.destroy()
}

/** Runs pg_sleep(30) on a client, makes it vanish, and checks its backend is gone within 2 s. */
async function vanishMidQuery(client: Client, app: string, db?: { host: string; port: number; database: string }) {
  client.on('error', () => {}) // the vanished connection's error; the query's rejection is checked below
  await client.connect()
  const query = client.query('SELECT pg_sleep(30)').then(
    () => assert.fail('pg_sleep(30) cannot finish here'),
    (err: Error) => err
  )
  // The backend is really at work before the client goes.
  await eventually(async () => {
    const rows = await activity(app, db)
    return rows.length === 1 && rows[0].state === 'active' && rows[0].query === 'SELECT pg_sleep(30)'
  }, `the backend of ${app} to be running pg_sleep(30)`, 3000)
  const vanished = Date.now()
  vanish(client)
  await eventually(async () => (await activity(app, db)).length === 0, `the backend of ${app} to exit after its client vanished`, 2000)
  const elapsed = Date.now() - vanished
  assert.ok(elapsed < 2000, `backend gone ${elapsed} ms after the client vanished`)
  const err = await query
  assert.match(err.message, /edgepg: WebSocket to ws:\/\/127\.0\.0\.1:\d+\/v2 (was closed|failed)/, `the query fails with the socket's error: ${err.message}`)
  await client.end().catch(() => {})
}

test('LoginWatch finds a cancel key of any length and the ReadyForQuery after it, across chunk boundaries, and gives up on non-messages', () => {
  const param = message('S', Buffer.from('server_version\u000018.0\u0000'))
  const ready = message('Z', Buffer.from('I'))
  for (const keyLength of [4, 32, 256]) {
    const secret = Buffer.alloc(keyLength, 0xab)
    const pidAndKey = Buffer.concat([Buffer.from([0, 0, 0x30, 0x39]), secret])
    const stream = Buffer.concat([message('R', Buffer.alloc(4)), param, param, message('K', pidAndKey), ready])
    for (const step of [1, 3, 7, stream.length]) {
      const watch = new LoginWatch()
      let done = false
      for (let i = 0; i < stream.length && !done; i += step) done = watch.feed(stream.subarray(i, i + step))
      assert.ok(done, `done by the end (key ${keyLength} bytes, chunks of ${step})`)
      assert.deepEqual(watch.key, { pid: 12345, secret }, `key found (key ${keyLength} bytes, chunks of ${step})`)
      assert.equal(watch.ready, true, `ReadyForQuery seen (chunks of ${step})`)
    }
    // The CancelRequest carries the whole key.
    const cancel = cancelRequest({ pid: 12345, secret })
    assert.equal(cancel.readInt32BE(0), 12 + keyLength, 'CancelRequest length')
    assert.equal(cancel.readInt32BE(4), 80877102, 'CancelRequest code')
    assert.equal(cancel.readInt32BE(8), 12345, 'CancelRequest pid')
    assert.ok(cancel.subarray(12).equals(secret), 'CancelRequest secret')
  }
  const noKey = new LoginWatch()
  assert.equal(noKey.feed(Buffer.concat([param, ready])), true, 'ReadyForQuery without a key ends the watch')
  assert.equal(noKey.key, undefined, 'no key')
  // TLS passthrough: Postgres's 'S', then TLS records, which do not frame as messages.
  const tlsWatch = new LoginWatch()
  assert.equal(tlsWatch.feed(Buffer.from([0x53, 0x16, 0x03, 0x03, 0x00, 0x7a, 0x02])), true, 'TLS records end the watch')
  assert.equal(tlsWatch.key, undefined, 'no key from TLS')
  assert.equal(tlsWatch.ready, false, 'no login seen through TLS')
  const refused = new LoginWatch()
  assert.equal(refused.feed(message('E', Buffer.from('SFATAL\u0000\u0000'))), true, 'an ErrorResponse ends the watch')
  assert.equal(refused.ready, false, 'a refused login is not ready')
})

test('client vanishes mid-query: the proxy cancels the query and the backend exits at once', async () => {
  const upstream = testPostgres()
  for (const authOffload of [true, false]) {
    const proxy = await proxyTo(`${upstream.host}:${upstream.port}`, { authOffload })
    try {
      const app = `edgepg-vanish-${authOffload ? 'offload' : 'passthrough'}`
      const before = connectsTo(upstream.port)
      await vanishMidQuery(new Client(configVia(proxy.port, { application_name: app })), app)
      // Without auth offload, ws first offers edgepg's subprotocol, is refused it, and opens again:
      // sessions without a byte moved. Each session connected upstream once; one more is the cancel.
      await eventually(() => proxy.logs.some((l) => l.bytesIn > 0), 'the vanished session to be logged')
      assert.equal(connectsTo(upstream.port) - before, proxy.logs.length + 1, 'one connection per session, plus one CancelRequest')
      const ended = proxy.logs.find((l) => l.bytesIn > 0)!
      assert.match(ended.outcome, /closed by client|client error/, ended.outcome)
    } finally {
      await proxy.close()
    }
  }
})

test('client vanishes mid-query with TLS from the proxy to Postgres: the cancel goes over TLS', async () => {
  const proxy = await proxyTo(`${own.host}:${own.port}`, { upstreamTls: { mode: 'require' } })
  try {
    const app = 'edgepg-vanish-upstream-tls'
    const client = new Client(configVia(proxy.port, { application_name: app }, own))
    const before = connectsTo(own.port)
    await vanishMidQuery(client, app, own)
    assert.equal(connectsTo(own.port) - before, 2, 'the session, then one CancelRequest')
  } finally {
    await proxy.close()
  }
})

test('a client that ends cleanly gets no CancelRequest sent after it', async () => {
  const upstream = testPostgres()
  const proxy = await proxyTo(`${upstream.host}:${upstream.port}`, { pool: { enabled: false } }) // (a pooled backend stays: test/pool.test.ts)
  try {
    const app = 'edgepg-clean-end'
    const before = connectsTo(upstream.port)
    const client = new Client(configVia(proxy.port, { application_name: app }))
    await client.connect()
    await client.query('SELECT 1')
    await client.end()
    await eventually(async () => (await backends(app)) === 0, 'the backend to exit')
    await eventually(() => proxy.logs.length === 1, 'the session to be logged')
    assert.equal(connectsTo(upstream.port) - before, 1, 'only the session itself connected upstream')
  } finally {
    await proxy.close()
  }
})

test('Postgres restarted mid-session: clear errors, the proxy stays up, new sessions and the Pool recover', async () => {
  const proxy = await proxyTo(`${own.host}:${own.port}`)
  const pool = new Pool({ ...configVia(proxy.port, { application_name: 'edgepg-restart-pool' }, own), max: 1 })
  const poolErrors: Error[] = []
  pool.on('error', (e) => poolErrors.push(e))
  const idle = new Client(configVia(proxy.port, { application_name: 'edgepg-restart-idle' }, own))
  const busy = new Client(configVia(proxy.port, { application_name: 'edgepg-restart-busy' }, own))
  const idleErrors: Error[] = []
  idle.on('error', (e) => idleErrors.push(e))
  busy.on('error', () => {}) // its query carries the error
  let restarted = false
  try {
    await Promise.all([idle.connect(), busy.connect()])
    await idle.query('SELECT 1')
    const firstPid = (await pool.query('SELECT pg_backend_pid() AS pid')).rows[0].pid
    const running = busy.query('SELECT pg_sleep(30)').then(
      () => assert.fail('pg_sleep(30) cannot finish here'),
      (err: Error) => err
    )
    await eventually(async () => (await activity('edgepg-restart-busy', own)).some((r) => r.state === 'active'), 'the busy backend to be running', 3000)

    const stopping = Date.now()
    await own.shutdown()
    assert.ok(Date.now() - stopping < 10_000, 'fast shutdown is quick')
    // The running query fails with Postgres's own FATAL, as it would over TCP.
    const err = (await running) as pg.DatabaseError
    assert.ok(err instanceof pg.DatabaseError, `a DatabaseError, not ${err}`)
    assert.equal(err.code, '57P01', `57P01 admin_shutdown: ${err.message}`)
    assert.match(err.message, /terminating connection due to administrator command/, err.message)
    // The idle client and the Pool's idle client hear about it too.
    await eventually(() => idleErrors.length > 0, 'the idle client to report the shutdown', 3000)
    assert.equal((idleErrors[0] as pg.DatabaseError).code, '57P01', `idle client error: ${idleErrors[0].message}`)
    await eventually(() => poolErrors.length > 0, 'the Pool to report its broken idle client', 3000)
    assert.match(poolErrors[0].message, /administrator command|terminated|was closed/, `Pool error: ${poolErrors[0].message}`)
    await eventually(() => proxy.logs.length >= 3, 'the proxy to log the three ended sessions', 3000)

    // While Postgres is down: a clear error, at once.
    assert.ok(proxy.server.listening, 'the proxy is still listening')
    const downStarted = Date.now()
    const duringOutage = new Client(configVia(proxy.port, {}, own))
    const outageErr = await duringOutage.connect().then(() => duringOutage.query('SELECT 1')).then(
      () => assert.fail('no Postgres to answer'),
      (e: Error) => e
    )
    assert.match(outageErr.message, /code 1011: edgepg-proxy: upstream 127\.0\.0\.1:\d+ unreachable: ECONNREFUSED/, outageErr.message)
    assert.ok(Date.now() - downStarted < 3000, 'the outage error is prompt')

    await own.start()
    restarted = true
    const fresh = new Client(configVia(proxy.port, {}, own))
    await fresh.connect()
    assert.deepEqual((await fresh.query('SELECT 1 AS x')).rows, [{ x: 1 }], 'a new session works')
    await fresh.end()
    const second = await pool.query('SELECT pg_backend_pid() AS pid')
    assert.notEqual(second.rows[0].pid, firstPid, 'the Pool opened a new connection')
    assert.equal(pool.totalCount, 1, 'the Pool holds one client')
  } finally {
    if (!restarted) await own.start().catch(() => {})
    await Promise.all([idle.end().catch(() => {}), busy.end().catch(() => {}), pool.end()])
    await proxy.close()
  }
})

test('transaction mode, Postgres restarted: a session on a backend ends with its FATAL, as over TCP; one holding none goes on, on a new one', async () => {
  const proxy = await proxyTo(`${own.host}:${own.port}`, { pool: { mode: 'transaction', size: 2, timeoutMs: 2000 } })
  const idle = new Client(configVia(proxy.port, { application_name: 'edgepg-txrestart-idle' }, own))
  const busy = new Client(configVia(proxy.port, { application_name: 'edgepg-txrestart-busy' }, own))
  const idleErrors: Error[] = []
  idle.on('error', (e) => idleErrors.push(e))
  const busyErrors: Error[] = []
  busy.on('error', (e) => busyErrors.push(e))
  let restarted = false
  try {
    // (The idle session's login was answered by its key's lender: it holds no backend until it runs something.)
    await Promise.all([idle.connect(), busy.connect()])
    const running = busy.query('SELECT pg_sleep(30)').then(
      () => assert.fail('pg_sleep(30) cannot finish here'),
      (err: Error) => err
    )
    await eventually(async () => (await activity('edgepg-txrestart-busy', own)).some((r) => r.state === 'active' && r.query.startsWith('SELECT pg_sleep')), 'the busy backend to be running', 3000)
    await own.shutdown()
    assert.equal(((await running) as pg.DatabaseError).code, '57P01')
    await eventually(() => busyErrors.length > 0, 'the busy session to end', 3000)

    // While Postgres is down, the idle session's statement fails clearly, and the session stays.
    const down = await idle.query('SELECT 1').then(() => assert.fail('no Postgres to answer'), (e: pg.DatabaseError) => e)
    assert.equal(down.code, '08006', down.message)
    assert.match(down.message, /edgepg-proxy: upstream 127\.0\.0\.1:\d+ unreachable: ECONNREFUSED/)

    await own.start()
    restarted = true
    assert.deepEqual((await idle.query('SELECT 1 AS x')).rows, [{ x: 1 }], 'on a backend of the restarted Postgres')
    assert.deepEqual(idleErrors, [], 'the idle session never saw the restart but for its one statement')
    const fresh = new Client(configVia(proxy.port, { application_name: 'edgepg-txrestart-busy' }, own))
    await fresh.connect()
    assert.deepEqual((await fresh.query('SELECT 1 AS x')).rows, [{ x: 1 }], 'a new session works')
    await fresh.end()
  } finally {
    if (!restarted) await own.start().catch(() => {})
    await Promise.all([idle.end().catch(() => {}), busy.end().catch(() => {})])
    await proxy.close()
  }
})

test('Postgres unreachable: Client and Pool get a clear error naming the upstream, promptly', async () => {
  const closedPort = await freePort()
  const proxy = await proxyTo(`127.0.0.1:${closedPort}`)
  const expected = new RegExp(`code 1011: edgepg-proxy: upstream 127\\.0\\.0\\.1:${closedPort} unreachable: ECONNREFUSED`)
  try {
    const started = Date.now()
    const client = new Client(configVia(proxy.port))
    client.on('error', () => {})
    const err = await client.connect().then(() => client.query('SELECT 1')).then(
      () => assert.fail('nothing to answer'),
      (e: Error) => e
    )
    assert.match(err.message, expected, err.message)
    const pool = new Pool({ ...configVia(proxy.port), max: 2 })
    pool.on('error', () => {})
    for (let i = 0; i < 2; i++) {
      const poolErr = await pool.query('SELECT 1').then(
        () => assert.fail('nothing to answer'),
        (e: Error) => e
      )
      assert.match(poolErr.message, expected, `pool.query ${i}: ${poolErr.message}`)
    }
    await eventually(() => pool.totalCount === 0, 'the Pool to drop its broken clients', 2000)
    await pool.end()
    assert.ok(Date.now() - started < 3000, `all errors within 3 s (took ${Date.now() - started} ms)`)
    assert.ok(proxy.logs.every((l) => /unreachable: ECONNREFUSED/.test(l.outcome)), proxy.logs.map((l) => l.outcome).join(' | '))
  } finally {
    await proxy.close()
  }
})

test('proxy restarted: the Pool fails fast during the outage and reconnects after', async () => {
  const upstream = testPostgres()
  const port = await freePort()
  const app = 'edgepg-proxy-restart'
  let proxy = await proxyTo(`${upstream.host}:${upstream.port}`, {}, port)
  const pool = new Pool({ ...configVia(port, { application_name: app }), max: 2 })
  const poolErrors: Error[] = []
  pool.on('error', (e) => poolErrors.push(e))
  try {
    // Two at once: two clients, two sessions.
    const pids = await Promise.all([1, 2].map(() => pool.query('SELECT pg_backend_pid() AS pid, pg_sleep(0.05)').then((r) => r.rows[0].pid)))
    assert.equal(new Set(pids).size, 2, 'two sessions')
    assert.equal(await backends(app), 2, 'two backends')

    await proxy.close()
    await eventually(() => pool.totalCount === 0, 'the Pool to drop the clients whose sessions were closed', 3000)
    assert.equal(poolErrors.length, 2, `each idle client reported its closed session: ${poolErrors.map((e) => e.message).join(' | ')}`)
    assert.match(poolErrors[0].message, new RegExp(`ws://127\\.0\\.0\\.1:${port}/v2 was closed`), poolErrors[0].message)
    await eventually(async () => (await backends(app)) === 0, 'the closed sessions to leave no backend', 3000)

    const started = Date.now()
    const outage = await pool.query('SELECT 1').then(
      () => assert.fail('no proxy to answer'),
      (e: Error) => e
    )
    assert.match(outage.message, new RegExp(`WebSocket to ws://127\\.0\\.0\\.1:${port}/v2 could not be opened: .*ECONNREFUSED`), outage.message)
    assert.ok(Date.now() - started < 2000, 'the outage error is prompt')

    proxy = await proxyTo(`${upstream.host}:${upstream.port}`, {}, port)
    assert.deepEqual((await pool.query('SELECT 1 AS x')).rows, [{ x: 1 }], 'the Pool reconnects')
    assert.equal(pool.totalCount, 1, 'one client, made on demand')
    await Promise.all([1, 2].map(() => pool.query('SELECT pg_sleep(0.05)')))
    assert.ok(pool.totalCount <= 2, `within max (${pool.totalCount})`)
  } finally {
    await pool.end()
    await proxy.close()
  }
  await eventually(async () => (await backends(app)) === 0, 'no backend left after pool.end()', 3000)
})

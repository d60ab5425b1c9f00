import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import net from 'node:net'
import pg from 'pg'
import { edgeClient, edgeConfig, edgePool, startProxy, pgConfig, testPostgres, backends, eventually } from './support/helpers'
import { Client, Pool, httpSql } from '../src/index'
import type { UpgradeRefusal } from '../proxy/index'
import { freePort } from './support/stack'

const unhandled: unknown[] = []
const onUnhandled = (reason: unknown) => unhandled.push(reason)
let proxy: Awaited<ReturnType<typeof startProxy>>
before(async () => {
  process.on('unhandledRejection', onUnhandled)
  proxy = await startProxy()
})
after(async () => {
  await proxy.close()
  process.off('unhandledRejection', onUnhandled)
  assert.deepEqual(unhandled, [], 'no unhandled rejections')
})

/** Client options aimed at an arbitrary WebSocket URL. */
const at = (url: string, extra = {}) => ({ ...edgeConfig(proxy.port), wsProxy: () => url, ...extra })

test('proxy unreachable: the error names the URL and the cause', async () => {
  const url = `ws://127.0.0.1:${await freePort()}/v2`
  const client = new Client(at(url))
  await assert.rejects(client.connect(), (err: Error) => {
    assert.match(err.message, /^edgepg: WebSocket to ws:\/\/127\.0\.0\.1:\d+\/v2 could not be opened: .*ECONNREFUSED/)
    assert.ok(err.message.includes(url), err.message)
    return true
  })
})

test("upgrade refused: the error carries the URL, the HTTP status and the proxy's reason; the proxy logs it", async () => {
  const refusals: UpgradeRefusal[] = []
  const own = await startProxy({ refusalLog: (entry) => refusals.push(entry) })
  try {
    const url = `ws://127.0.0.1:${own.port}/v1?address=127.0.0.1:1`
    await assert.rejects(new Client(at(url)).connect(), (err: Error) => {
      assert.ok(err.message.startsWith(`edgepg: WebSocket to ${url} was refused (HTTP 403): address 127.0.0.1:1 is not an allowed upstream`), err.message)
      assert.match(err.message, /--allow/)
      return true
    })
    await assert.rejects(new Client(at(`ws://127.0.0.1:${own.port}/nope`)).connect(), /was refused \(HTTP 404\): no WebSocket route at \/nope; use \/v1 or \/v2$/)
    assert.deepEqual(
      refusals.map(({ path, status, reason }) => ({ path, status, reason: reason.slice(0, 40) })),
      [
        { path: '/v1', status: 403, reason: 'address 127.0.0.1:1 is not an allowed up' },
        { path: '/nope', status: 404, reason: 'no WebSocket route at /nope; use /v1 or ' },
      ]
    )
    assert.equal(refusals[0].peer, '127.0.0.1')
  } finally {
    await own.close()
  }
})

test('a server that refuses the upgrade and never ends its response: the error still comes, with what it sent', async () => {
  const server = net.createServer((socket) => socket.once('data', () => socket.write('HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\n\r\nbusy, and more to come')))
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
  try {
    const url = `ws://127.0.0.1:${(server.address() as net.AddressInfo).port}/v2`
    await assert.rejects(new Client(at(url)).connect(), (err: Error) => (assert.equal(err.message, `edgepg: WebSocket to ${url} was refused (HTTP 503): busy, and more to come`), true))
  } finally {
    server.close()
  }
})

test('no config.wsProxy: the WebSocket and httpSql errors show the address tried and say to set it', async () => {
  const port = await freePort()
  // (Neon's default: the proxy on the Postgres host, here 127.0.0.1 on port 80, where nothing listens.)
  const { wsProxy: _, ...noProxy } = edgeConfig(proxy.port)
  await assert.rejects(new Client({ ...noProxy, host: '127.0.0.1', port }).connect(), (err: Error) => {
    assert.match(err.message, /^edgepg: WebSocket to ws:\/\/127\.0\.0\.1\/v2 could not be opened: .*ECONNREFUSED.* \(config\.wsProxy is not set, so edgepg tried Neon's address for this host: say where your edgepg-proxy listens, e\.g\. config\.wsProxy = '127\.0\.0\.1:8080\/v2'\)$/)
    return true
  })
  const sql = httpSql(`postgresql://u:p@127.0.0.1:${port}/db`)
  await assert.rejects(sql`SELECT 1`, (err: Error) => {
    assert.match(err.message, /^edgepg: POST http:\/\/127\.0\.0\.1\/sql failed: .*\(neither fetchEndpoint nor config\.wsProxy is set, so edgepg tried Neon's address/)
    return true
  })
})

test('Postgres down behind the proxy: the error says the upstream is unreachable', async () => {
  const down = await startProxy({ upstream: `127.0.0.1:${await freePort()}` })
  try {
    // With auth offload the driver pipelines, so connect() may resolve and the query carry the error.
    const client = edgeClient(down.port)
    await assert.rejects(client.connect().then(() => client.query('SELECT 1')), (err: Error) => {
      assert.match(err.message, /closed before it opened|was closed/)
      assert.match(err.message, /code 1011: edgepg-proxy: upstream 127\.0\.0\.1:\d+ unreachable: ECONNREFUSED/)
      return true
    })
  } finally {
    await down.close()
  }
})

test('WebSocket closed mid-query: the query rejects with the URL and close code', async () => {
  const own = await startProxy()
  const client = edgeClient(own.port)
  await client.connect()
  const errors: Error[] = []
  client.on('error', (e) => errors.push(e))
  const query = client.query('SELECT pg_sleep(5)')
  await new Promise((r) => setTimeout(r, 100))
  const rejected = assert.rejects(query, /edgepg: WebSocket to ws:\/\/127\.0\.0\.1:\d+\/v2 was closed \(code 1001: edgepg-proxy is shutting down\)/)
  await own.close() // no grace period: every session is closed at once, with code 1001
  await rejected
  // As pg does over TCP after a reset: the socket's error, then 'Connection terminated unexpectedly'.
  assert.match(errors[0].message, /was closed \(code 1001/)
  await client.end()
})

test('wrong database or user: the same DatabaseError as pg over TCP', async () => {
  for (const bad of [{ database: 'no_such_db' }, { user: 'no_such_user' }]) {
    const viaPg = await new pg.Client({ ...pgConfig(), ...bad }).connect().catch((e) => e)
    // Pipelined: connect() resolves at once and the first query carries Postgres's error.
    const client = edgeClient(proxy.port, 'scram_user', bad)
    const viaEdge = await client.connect().then(() => client.query('SELECT 1')).catch((e) => e)
    assert.ok(viaEdge instanceof pg.DatabaseError, String(viaEdge))
    assert.deepEqual({ ...viaEdge, message: viaEdge.message }, { ...viaPg, message: viaPg.message })
    assert.match(String(viaEdge.code), /^(3D000|28000|28P01)$/)
  }
})

test('connectionTimeoutMillis: a proxy that never answers the upgrade times out with a clear error', async () => {
  const held: net.Socket[] = []
  const silent = net.createServer((s) => held.push(s))
  await new Promise<void>((r) => silent.listen(0, '127.0.0.1', r))
  const url = `ws://127.0.0.1:${(silent.address() as net.AddressInfo).port}/v2`
  try {
    const started = Date.now()
    await assert.rejects(new Client(at(url, { connectionTimeoutMillis: 300 })).connect(), (err: Error) => {
      assert.equal(err.message, `edgepg: connection to ${url} failed: timeout expired`)
      return true
    })
    assert.ok(Date.now() - started < 3000, 'the timeout fired promptly')
    // and through a Pool
    const pool = new Pool({ ...at(url), connectionTimeoutMillis: 300 })
    await assert.rejects(pool.query('SELECT 1'), /timeout/)
    await pool.end()
  } finally {
    for (const s of held) s.destroy()
    silent.close()
  }
})

test('a Pool evicts a broken client and serves the next request', async () => {
  const pool = edgePool(proxy.port, { max: 1, application_name: 'edgepg-evict' })
  const poolErrors: Error[] = []
  pool.on('error', (e) => poolErrors.push(e))
  const first = await pool.query('SELECT pg_backend_pid() AS pid')
  const pid = first.rows[0].pid
  const admin = new pg.Client(pgConfig('trust_user'))
  await admin.connect()
  await admin.query('SELECT pg_terminate_backend($1)', [pid])
  await admin.end()
  await eventually(() => poolErrors.length === 1, 'the idle client to report its broken connection')
  assert.match(poolErrors[0].message, /terminating connection due to administrator command|terminated/)
  const second = await pool.query('SELECT pg_backend_pid() AS pid')
  assert.notEqual(second.rows[0].pid, pid)
  assert.equal(pool.totalCount, 1)
  await pool.end()
})

test('a Pool reports an unreachable proxy per request, then recovers', async () => {
  const port = await freePort()
  const pool = new Pool({ ...at(`ws://127.0.0.1:${port}/v2`), max: 2 })
  await assert.rejects(pool.query('SELECT 1'), /ECONNREFUSED/)
  assert.equal(pool.totalCount, 0)
  const revived = await startProxy()
  try {
    const moved = new Pool({ ...edgeConfig(revived.port), max: 2 })
    assert.deepEqual((await moved.query('SELECT 1 AS x')).rows, [{ x: 1 }])
    await moved.end()
  } finally {
    await revived.close()
    await pool.end()
  }
  // Of the evicting test's backends, at most the one the file's proxy keeps warm remains.
  await eventually(async () => (await backends('edgepg-evict')) <= 1, 'the evicted backends to exit')
})

test('a proxy sending text frames is a clear error', async () => {
  const { WebSocketServer } = await import('ws')
  const wss = new WebSocketServer({ port: 0, host: '127.0.0.1' })
  wss.on('connection', (ws) => ws.send('hello'))
  await new Promise((r) => wss.once('listening', r))
  const url = `ws://127.0.0.1:${(wss.address() as net.AddressInfo).port}/v2`
  try {
    // `ws` servers select an offered subprotocol by default, so this one seems to take the login;
    // connect() waits for Postgres's answer and gets the text frame instead.
    await assert.rejects(new Client(at(url)).connect(), /sent a text frame; expected binary/)
  } finally {
    for (const c of wss.clients) c.terminate()
    wss.close()
  }
})

test("Postgres's refusal before the password still reaches a client that waits to be asked (3D000, not a bare close)", async () => {
  // trust: Postgres checks the database right after the startup, answers FATAL and hangs up
  // while the proxy is still waiting for this client's password.
  const client = edgeClient(proxy.port, 'trust_user', { database: 'no_such_db', pipelineConnect: false })
  await assert.rejects(client.connect(), (err: any) => {
    assert.equal(err.code, '3D000', err.message)
    assert.match(err.message, /database "no_such_db" does not exist/)
    return true
  })
})

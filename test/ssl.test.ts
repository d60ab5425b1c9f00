/**
 * pg's `ssl` without `rootCerts`: edgepg-proxy makes the TLS to Postgres that the client asked for,
 * verified as pg would verify it, and the outcome is pg's over TCP: the same rows on a TLS backend,
 * or the same error (message and code) when Postgres refuses TLS, answers garbage, or presents a
 * certificate that does not verify. The operator's upstream sslmode stays a floor.
 */
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import net from 'node:net'
import { WebSocket } from 'ws'
import pg from 'pg'
import { createProxy, type ProxyOptions } from '../proxy/index'
import { Client, type ClientConfig } from '../src/index'
import { generateCerts, type TestCerts } from './support/certs'
import { backends, eventually, pgConfig, testPostgres, within } from './support/helpers'
import { startPostgres, tlsOnly, type Postgres } from './support/stack'

let certs: TestCerts
/** PostgreSQL 18 with TLS, on which scram_user may log in only over TLS (hostssl). */
let tlsPg: Postgres
/** Answers an SSLRequest with 'X', and counts the connections it still has open. */
let garbage: net.Server
let garbageOpen = 0

before(async () => {
  certs = await generateCerts()
  tlsPg = await startPostgres(tlsOnly(18, certs.server))
  garbage = net.createServer((socket) => {
    garbageOpen++
    socket.on('close', () => garbageOpen--)
    socket.on('data', () => socket.write('X'))
  })
  await new Promise<void>((resolve) => garbage.listen(0, '127.0.0.1', resolve))
})

after(async () => {
  garbage?.close()
  await tlsPg?.stop()
  await certs?.cleanup()
})

const garbagePort = () => (garbage.address() as net.AddressInfo).port

/** An edgepg-proxy that may reach the TLS Postgres, the suite's (no TLS) and the garbage server. */
async function withProxy<T>(options: Partial<ProxyOptions>, fn: (port: number) => Promise<T>): Promise<T> {
  const plain = testPostgres()
  const proxy = createProxy({
    upstream: `127.0.0.1:${tlsPg.port}`,
    allow: [`localhost:${tlsPg.port}`, `${plain.host}:${plain.port}`, `127.0.0.1:${garbagePort()}`],
    ...options,
  })
  const { port } = await proxy.listen(0, '127.0.0.1')
  try {
    return await fn(port)
  } finally {
    await proxy.close()
  }
}

const edge = (proxyPort: number, config: pg.ClientConfig): ClientConfig => ({
  ...config,
  webSocketConstructor: WebSocket as any,
  wsProxy: (host, port) => `ws://127.0.0.1:${proxyPort}/v1?address=${host}:${port}`,
})

const SSL_CHECK = 'SELECT current_user AS u, ssl, version FROM pg_stat_ssl WHERE pid = pg_backend_pid()'

/** What connecting and one query came to: the row and how the stream presents itself, or the error. */
async function outcome(client: pg.Client) {
  try {
    await within(10000, 'connect', client.connect())
    const { rows } = await client.query(SSL_CHECK)
    const stream = (client as any).connection.stream
    return { row: rows[0], encrypted: stream.encrypted === true, alpnProtocol: stream.alpnProtocol }
  } catch (err: any) {
    return { kind: err.constructor.name, message: err.message, code: err.code }
  } finally {
    await client.end().catch(() => {})
  }
}

/** pg over TCP and edgepg through the proxy on `proxyPort`, same config (edgepg's may differ by `edgeOnly`). */
async function same(what: string, proxyPort: number, config: pg.ClientConfig, edgeOnly: ClientConfig = {}) {
  const expected = await outcome(new pg.Client(config))
  const got = await outcome(new Client({ ...edge(proxyPort, config), ...edgeOnly }))
  assert.deepEqual(got, expected, `${what}: as pg over TCP`)
  return got
}

const onTls = (extra: pg.ClientConfig) => ({ ...pgConfig('scram_user', tlsPg), ...extra })

test('TLS to a Postgres that has it: the same rows on a TLS backend, SSLRequest or direct negotiation (ALPN postgresql)', async () => {
  await withProxy({}, async (port) => {
    const viaRequest = await same('rejectUnauthorized: false', port, onTls({ ssl: { rejectUnauthorized: false } }))
    assert.deepEqual(viaRequest, { row: { u: 'scram_user', ssl: true, version: 'TLSv1.3' }, encrypted: true, alpnProtocol: false })
    const direct = await same('sslnegotiation direct', port, onTls({ ssl: { rejectUnauthorized: false }, sslnegotiation: 'direct' } as pg.ClientConfig))
    assert.equal((direct as any).alpnProtocol, 'postgresql')
  })
})

test("a certificate that does not verify fails as pg's does, whichever way `ssl` asks for verification", async () => {
  await withProxy({}, async (port) => {
    // The test CA is in no trust store: Node's roots are what both sides verify against.
    for (const ssl of [true, {}, { rejectUnauthorized: true }] as const) {
      const got: any = await same(`ssl: ${JSON.stringify(ssl)}`, port, onTls({ ssl: ssl as any }))
      assert.equal(got.code, 'UNABLE_TO_VERIFY_LEAF_SIGNATURE')
    }
    const url = `postgresql://scram_user:${encodeURIComponent(String(pgConfig().password))}@127.0.0.1:${tlsPg.port}/${tlsPg.database}?sslmode=verify-full`
    assert.equal(((await same('sslmode=verify-full in a connection string', port, { connectionString: url })) as any).code, 'UNABLE_TO_VERIFY_LEAF_SIGNATURE')
  })
})

test("with the operator's CA the proxy verifies the name as pg does (verify-full), and a wrong servername fails", async () => {
  await withProxy({ upstreamTls: { mode: 'disable', ca: certs.ca.cert } }, async (port) => {
    // pg over TCP is given the CA itself; edgepg's client names none (a CA would mean TLS inside the socket).
    const ca = { ca: certs.ca.cert }
    const tcp = await outcome(new pg.Client(onTls({ host: 'localhost', ssl: ca })))
    const got = await outcome(new Client(edge(port, onTls({ host: 'localhost', ssl: true }))))
    assert.deepEqual(got, tcp, 'verified by name, as pg over TCP')
    assert.equal((got as any).row?.ssl, true)
    const wrongTcp = await outcome(new pg.Client(onTls({ ssl: { ...ca, servername: 'db.example.com' } })))
    const wrongEdge = await outcome(new Client(edge(port, onTls({ ssl: { servername: 'db.example.com' } }))))
    assert.deepEqual(wrongEdge, wrongTcp, 'a name the certificate does not carry: as pg over TCP')
    assert.equal((wrongEdge as any).code, 'ERR_TLS_CERT_ALTNAME_INVALID')
  })
})

test("a Postgres without TLS, or one answering garbage: pg's own errors, and nothing left open", async () => {
  await withProxy({}, async (port) => {
    const plain = testPostgres()
    const before = await backends()
    // pg's error, then what edgepg offers instead (a Neon URL's sslmode=require, aimed at a Postgres without TLS).
    const noTls = { ...pgConfig('scram_user', plain), ssl: { rejectUnauthorized: false } }
    assert.deepEqual(await outcome(new pg.Client(noTls)), { kind: 'Error', message: 'The server does not support SSL connections', code: undefined })
    const refused: any = await outcome(new Client(edge(port, noTls)))
    assert.equal(refused.kind, 'Error')
    assert.ok(refused.message.startsWith('The server does not support SSL connections (edgepg: '), refused.message)
    assert.match(refused.message, /set config\.forceDisablePgSSL = true, or drop sslmode\)$/)
    const x: any = await same('the server answers X', port, { host: '127.0.0.1', port: garbagePort(), user: 'u', password: 'p', ssl: 'require' as any })
    assert.deepEqual(x, { kind: 'Error', message: 'There was an error establishing an SSL connection', code: undefined })
    await eventually(() => garbageOpen === 0, 'the proxy closed its connection to the garbage server')
    await eventually(async () => (await backends()) <= before, 'no backend left behind')
  })
})

test("the operator's sslmode is a floor: a client's rejectUnauthorized: false does not lower verify-full", async () => {
  await withProxy({ upstreamTls: { mode: 'verify-full', ca: certs.otherCa.cert } }, async (port) => {
    const got: any = await outcome(new Client(edge(port, onTls({ ssl: { rejectUnauthorized: false } }))))
    assert.equal(got.code, 'UNABLE_TO_VERIFY_LEAF_SIGNATURE', JSON.stringify(got))
  })
})

test('a query on a TLS backend the proxy made is cancelled through another client, as pg cancels', async () => {
  await withProxy({}, async (port) => {
    const config = edge(port, onTls({ ssl: { rejectUnauthorized: false } }))
    const client = new Client(config)
    await client.connect()
    try {
      const sleeping = client.query('SELECT pg_sleep(30)')
      await new Promise((r) => setTimeout(r, 200))
      const canceller: any = new Client(config)
      canceller.cancel(client, (client as any)._activeQuery ?? (client as any)._sentQueryQueue[0])
      const err: any = await within(5000, 'the cancelled query', sleeping.then(() => assert.fail('not cancelled'), (e) => e))
      assert.equal(err.code, '57014')
      // Postgres hangs up on a CancelRequest once it has read it, as over TCP; the proxy closes only after.
      await eventually(() => canceller.connection.stream.destroyed, 'the cancel connection to be closed by Postgres')
    } finally {
      await client.end()
    }
  })
})

test('client certificates are refused at connect() with a clear error, before anything is opened', async () => {
  await withProxy({}, async (port) => {
    const client = new Client(edge(port, onTls({ ssl: { rejectUnauthorized: false, key: 'KEY', cert: 'CERT' } })))
    await assert.rejects(client.connect(), /client certificates \(ssl\.key, ssl\.cert, ssl\.pfx\) are not supported/)
  })
})

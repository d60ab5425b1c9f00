/**
 * Round trips, counted: a TCP relay (test/support/delay-relay.ts) holds every chunk for ONE_WAY_MS in each
 * direction between the driver and edgepg-proxy, so a test's elapsed time divided by the RTT is the
 * number of network round trips it took. Time runs from just before `new Client(...)` / `new Pool(...)`
 * to the first query's result.
 *
 * The TCP connect is excluded naturally: the relay listens on loopback, so the driver's TCP handshake
 * with it costs microseconds, and the relay opens its own connection to the proxy when it accepts,
 * without delay. Only data is delayed; the first thing that pays an RTT is the first byte the driver
 * sends (the TLS ClientHello for wss://, else the HTTP upgrade request). The proxy ↔ Postgres leg is
 * loopback too, so upstream auth (md5, SCRAM) costs no RTT.
 *
 * Tolerances are one-sided wide enough for scheduling noise and tight enough that adjacent counts
 * cannot be confused: a count of N passes for N - 0.1 ≤ rounds < N + 0.5 (setTimeout never fires
 * early, so a round trip cannot take less than the RTT). Each connect case is measured twice, after an
 * untimed warm-up straight to the proxy, and the better run counts; both are in the diagnostics.
 */
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { WebSocket } from 'ws'
import { createProxy } from '../proxy/index'
import { Client, Pool, type ClientConfig } from '../src/index'
import { generateCerts, type TestCerts } from './support/certs'
import { startDelayRelay } from './support/delay-relay'
import { edgeConfig, pgConfig, startProxy, testPostgres } from './support/helpers'
import { token, tokenFixture, WEB_USER } from './support/tokens'
import { PASSWORD, startPostgres, tlsOnly, type Postgres, type Role } from './support/stack'

const ONE_WAY_MS = 100
const RTT_MS = 2 * ONE_WAY_MS
/**
 * subtls does its handshake's crypto in JavaScript: 50-100 ms of CPU on a busy 2-core machine,
 * half a 200 ms round trip. Behind a slower relay that CPU is a small part of one.
 */
const TLS_ONE_WAY_MS = 300
const TLS_RTT_MS = 2 * TLS_ONE_WAY_MS

type Closer = { close(): Promise<void> | void }
const closers: Closer[] = []
const relay = async (port: number, oneWayMs = ONE_WAY_MS) => {
  const r = await startDelayRelay({ host: '127.0.0.1', port }, oneWayMs)
  closers.push(r)
  return r
}

let certs: TestCerts
let pg18: Postgres | undefined
let pg16: Postgres | undefined
/** ws:// proxy to the suite's Postgres (roles per auth method), direct and behind the delay. */
let plainProxy: number
let plainDelayed: number
/** wss:// proxy (test certificate for localhost) to the suite's Postgres, behind the delay. */
let tlsProxy: number
let tlsDelayed: number
/** ws:// proxies to TLS-enabled PostgreSQL 18 and 16, direct (and 18 behind the delay). */
let proxy18: number
let delayed18: number
let proxy16: number
/** The same two behind the slower relay, for subtls. */
let slow18: number
let slow16: number

before(async () => {
  certs = await generateCerts()
  const pgs = Promise.all([
    startPostgres(tlsOnly(18, certs.server)),
    startPostgres(tlsOnly(16, certs.server)),
  ])

  const plain = await startProxy()
  closers.push(plain)
  plainProxy = plain.port
  plainDelayed = (await relay(plainProxy)).port

  const secure = await startProxy({ tls: { cert: certs.server.cert, key: certs.server.key } })
  closers.push(secure)
  tlsProxy = secure.port
  tlsDelayed = (await relay(tlsProxy)).port

  ;[pg18, pg16] = await pgs
  const proxyTo = async (db: Postgres) => {
    const proxy = createProxy({ upstream: `${db.host}:${db.port}` })
    closers.push(proxy)
    return (await proxy.listen(0, '127.0.0.1')).port
  }
  proxy18 = await proxyTo(pg18)
  delayed18 = (await relay(proxy18)).port
  proxy16 = await proxyTo(pg16)
  slow18 = (await relay(proxy18, TLS_ONE_WAY_MS)).port
  slow16 = (await relay(proxy16, TLS_ONE_WAY_MS)).port
})

after(async () => {
  for (const c of closers.reverse()) await c.close()
  await Promise.all([pg18?.stop(), pg16?.stop()])
  await certs?.cleanup()
})

/** Round trips that `fn` took: elapsed / RTT. */
async function rounds(fn: () => Promise<unknown>, rttMs = RTT_MS): Promise<number> {
  const started = performance.now()
  await fn()
  return (performance.now() - started) / rttMs
}

/**
 * Best of two runs of a measurement, against a busy machine's noise (a real extra round
 * trip shows in both). Returns the best and a description of both runs, for diagnostics.
 */
async function bestOfTwo(measure: () => Promise<number>): Promise<{ best: number; runs: string }> {
  const all = [await measure(), await measure()]
  return { best: Math.min(...all), runs: all.map((r) => r.toFixed(2)).join(', ') }
}

/** Asserts `measured` is `expected` round trips (expected - 0.1 ≤ measured < expected + 0.5). */
function assertRounds(measured: number, expected: number, what: string) {
  assert.ok(
    measured >= expected - 0.1 && measured < expected + 0.5,
    `${what}: ${measured.toFixed(2)} round trips, expected ${expected}`
  )
}

/** Client options through the ws:// proxy on `port` (the delay relay, or the proxy itself to warm up). */
const wsConfig = (port: number, role: Role, extra: ClientConfig = {}): ClientConfig =>
  edgeConfig(port, role, { connectionTimeoutMillis: 5000, ...extra })

/** A `ws` WebSocket that trusts the test CA, for the wss:// proxy. */
const TrustingWebSocket = () =>
  class extends WebSocket {
    constructor(url: string, protocols?: string | string[]) {
      super(url, protocols, { ca: certs.ca.cert })
    }
  }

/** Connect + first query + end, untimed: JIT, subtls's import and the roots database warm up. */
async function warmUp(config: ClientConfig) {
  const client = new Client(config)
  try {
    await client.connect()
    await client.query('SELECT 1')
  } finally {
    await client.end().catch(() => {})
  }
}

/** Times `new Client(config)` → `await client.connect()` → `await client.query(…)`; checks the result. */
async function connectAndQuery(config: ClientConfig): Promise<number> {
  let client: Client | undefined
  try {
    let row: any
    const measured = await rounds(async () => {
      client = new Client(config)
      await client.connect()
      row = (await client.query('SELECT current_user AS u')).rows[0]
    })
    assert.equal(row.u, config.user)
    return measured
  } finally {
    await client?.end().catch(() => {})
  }
}

/** Roles, their auth method, and the round trips of connect() + query with authentication end to end. */
const AUTH: Array<[Role, string, number]> = [
  ['trust_user', 'trust', 2],
  ['password_user', 'password', 3],
  ['md5_user', 'md5', 3],
  ['scram_user', 'scram-sha-256', 4],
]

for (const [role, method, endToEnd] of AUTH) {
  test(`ws://, ${method} upstream: new Client + connect() + first query = 2 round trips (upgrade carrying the login, then the query)`, async (t) => {
    await warmUp(wsConfig(plainProxy, role))
    const { best, runs } = await bestOfTwo(() => connectAndQuery(wsConfig(plainDelayed, role)))
    t.diagnostic(`ws:// ${method}, client.connect() + query: ${best.toFixed(2)} round trips (expected 2; runs: ${runs})`)
    assertRounds(best, 2, `ws:// ${method}, client.connect() + query`)
  })

  test(`ws://, ${method} upstream: pool.query() on a fresh Pool = 2 round trips`, async (t) => {
    await warmUp(wsConfig(plainProxy, role))
    const poolQuery = async () => {
      let pool: Pool | undefined
      try {
        let row: any
        const measured = await rounds(async () => {
          pool = new Pool(wsConfig(plainDelayed, role))
          row = (await pool.query('SELECT current_user AS u')).rows[0]
        })
        assert.equal(row.u, role)
        return measured
      } finally {
        await pool?.end()
      }
    }
    const { best, runs } = await bestOfTwo(poolQuery)
    t.diagnostic(`ws:// ${method}, pool.query(): ${best.toFixed(2)} round trips (expected 2; runs: ${runs})`)
    assertRounds(best, 2, `ws:// ${method}, pool.query()`)
  })

  test(`ws://, ${method} upstream, authOffload: false: ${endToEnd} round trips (the client authenticates itself; the saving is real)`, async (t) => {
    await warmUp(wsConfig(plainProxy, role, { authOffload: false }))
    const { best, runs } = await bestOfTwo(() => connectAndQuery(wsConfig(plainDelayed, role, { authOffload: false })))
    t.diagnostic(`ws:// ${method}, authOffload: false: ${best.toFixed(2)} round trips (expected ${endToEnd}; runs: ${runs})`)
    // upgrade carrying the startup (→ Postgres's request), one per auth step, then the query
    assertRounds(best, endToEnd, `ws:// ${method}, authOffload: false`)
  })
}

test('ws://, a login by token (no password): new Client + connect() + first query = 2 round trips, as with a password', async (t) => {
  const fixture = await tokenFixture(`roundtrip_notes_${process.pid}`)
  try {
    const byToken = await startProxy({ tokens: fixture.options })
    closers.push(byToken)
    const delayed = (await relay(byToken.port)).port
    const { host, port, database } = testPostgres()
    const jwt = await token('alice')
    const config = (to: number): ClientConfig => ({ host, port, database, authToken: () => jwt, webSocketConstructor: WebSocket as any, wsProxy: () => `ws://127.0.0.1:${to}/v2`, connectionTimeoutMillis: 5000 })
    await warmUp(config(byToken.port))
    const measure = async () => {
      const client = new Client(config(delayed))
      try {
        let row: any
        const measured = await rounds(async () => {
          await client.connect()
          row = (await client.query(`SELECT edgepg.claims() ->> 'sub' AS sub, current_user AS u`)).rows[0]
        })
        assert.deepEqual(row, { sub: 'alice', u: WEB_USER })
        return measured
      } finally {
        await client.end().catch(() => {})
      }
    }
    const { best, runs } = await bestOfTwo(measure)
    t.diagnostic(`ws:// by token, client.connect() + query: ${best.toFixed(2)} round trips (expected 2; runs: ${runs})`)
    assertRounds(best, 2, 'ws:// by token, client.connect() + query')
  } finally {
    await fixture.teardown()
  }
})

test('wss:// (the proxy terminates TLS): new Client + connect() + first query = 3 round trips', async (t) => {
  const config = (port: number) =>
    wsConfig(port, 'scram_user', { webSocketConstructor: TrustingWebSocket() as any, wsProxy: () => `wss://localhost:${port}/v2` })
  await warmUp(config(tlsProxy))
  const { best, runs } = await bestOfTwo(() => connectAndQuery(config(tlsDelayed)))
  t.diagnostic(`wss://: ${best.toFixed(2)} round trips (expected 3: TLS handshake + upgrade carrying the login + the query; runs: ${runs})`)
  assertRounds(best, 3, 'wss://')
})

test("pg's `ssl` without rootCerts (the proxy makes the TLS to Postgres): still 2 round trips, and the backend is on TLS", async (t) => {
  const config = (port: number, extra: ClientConfig) => wsConfig(port, 'scram_user', { ...pgConfig('scram_user', pg18!), ssl: { rejectUnauthorized: false }, ...extra })
  for (const sslnegotiation of ['postgres', 'direct'] as const) {
    await warmUp(config(proxy18, { sslnegotiation } as ClientConfig))
    const measure = async () => {
      let client: Client | undefined
      try {
        const measured = await rounds(async () => {
          client = new Client(config(delayed18, { sslnegotiation } as ClientConfig))
          await client.connect()
          await client.query('SELECT 1')
        })
        // scram_user may log in only over TLS here (hostssl); checked after the clock stopped.
        assert.deepEqual((await client!.query('SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()')).rows, [{ ssl: true }])
        return measured
      } finally {
        await client?.end().catch(() => {})
      }
    }
    const { best, runs } = await bestOfTwo(measure)
    t.diagnostic(`ssl made by the proxy (sslnegotiation ${sslnegotiation}): ${best.toFixed(2)} round trips (expected 2; runs: ${runs})`)
    assertRounds(best, 2, `ssl made by the proxy, sslnegotiation ${sslnegotiation}`)
  }
})

/** TLS to Postgres itself inside the WebSocket, as a user configures it: `ssl` + `rootCerts`. */
const subtlsConfig = (port: number): ClientConfig => ({
  host: 'localhost', // the name in the certificate; wsProxy picks the actual address
  port: 5432,
  database: 'postgres',
  user: 'password_user', // hostssl … password: Postgres asks for a cleartext password, so it can be pipelined
  password: PASSWORD,
  ssl: true,
  rootCerts: certs.ca.cert,
  pipelineTLS: true,
  pipelineConnect: 'password',
  connectionTimeoutMillis: 5000,
  webSocketConstructor: WebSocket as any,
  wsProxy: () => `ws://127.0.0.1:${port}/v2`,
})

const SSL_CHECK = `SELECT current_user AS u, ssl, version, current_setting('server_version_num') AS v
  FROM pg_stat_ssl WHERE pid = pg_backend_pid()`

for (const version of [18, 16] as const) {
  test(`TLS inside the socket (subtls, pipelineTLS), PostgreSQL ${version} via the proxy: 3 round trips`, async (t) => {
    const [direct, delayed] = version === 18 ? [proxy18, slow18] : [proxy16, slow16]
    // Warm up (subtls's import, the roots database) through the other path to `ssl`: sslmode in a
    // connection string, which pg parses into `ssl`; edgepg's stream factory then picks TlsSocket.
    const { ssl: _, ...rest } = subtlsConfig(direct)
    const warm = new Client({ ...rest, connectionString: `postgresql://password_user:${PASSWORD}@localhost:5432/postgres?sslmode=verify-full` })
    try {
      await warm.connect()
      assert.equal((await warm.query(SSL_CHECK)).rows[0].ssl, true)
    } finally {
      await warm.end().catch(() => {})
    }

    const measure = async () => {
      let client: Client | undefined
      try {
        const measured = await rounds(async () => {
          client = new Client(subtlsConfig(delayed))
          await client.connect()
          await client.query('SELECT 1')
        }, TLS_RTT_MS)
        // It really was TLS 1.3 to that Postgres (checked after the clock stopped).
        const { rows } = await client!.query(SSL_CHECK)
        assert.deepEqual(rows[0], { u: 'password_user', ssl: true, version: 'TLSv1.3', v: rows[0].v })
        assert.match(rows[0].v, new RegExp(`^${version}`))
        return measured
      } finally {
        await client?.end().catch(() => {})
      }
    }
    const { best, runs } = await bestOfTwo(measure)
    t.diagnostic(`subtls + pipelineTLS, PG ${version}: ${best.toFixed(2)} round trips (expected 3; runs: ${runs})`)
    // (upgrade carrying SSLRequest + ClientHello → 'S' + ServerHello … Finished) + (Finished + startup + password →
    // ReadyForQuery: connect() resolves) + (query → result)
    assertRounds(best, 3, `subtls + pipelineTLS, PG ${version}`)
  })
}

test('warm client: 10 concurrent queries = 1 round trip; 10 sequential = 10', async (t) => {
  const client = new Client(wsConfig(plainDelayed, 'scram_user'))
  try {
    await client.connect()
    await client.query('SELECT 1')

    let results: any[] = []
    const { best: concurrent, runs: concurrentRuns } = await bestOfTwo(() =>
      rounds(async () => {
        results = await Promise.all(Array.from({ length: 10 }, (_, i) => client.query('SELECT $1::int AS i', [i])))
      })
    )
    assert.deepEqual(results.map((r) => r.rows[0].i), Array.from({ length: 10 }, (_, i) => i))

    const { best: sequential, runs: sequentialRuns } = await bestOfTwo(() =>
      rounds(async () => {
        for (let i = 0; i < 10; i++) assert.equal((await client.query('SELECT $1::int AS i', [i])).rows[0].i, i)
      })
    )
    t.diagnostic(`warm client: ${concurrent.toFixed(2)} round trips for 10 concurrent queries (expected 1; runs: ${concurrentRuns}), ${sequential.toFixed(2)} for 10 sequential (expected 10; runs: ${sequentialRuns})`)
    assertRounds(concurrent, 1, '10 concurrent queries')
    assertRounds(sequential, 10, '10 sequential queries')
  } finally {
    await client.end().catch(() => {})
  }
})

import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { createRequire } from 'node:module'
import { WebSocket } from 'ws'
import { createProxy, type ProxyOptions } from '../proxy/index'
import { Client } from '../src/index'
import { generateCerts, type TestCerts } from './support/certs'
import { PASSWORD, startPostgres, testPostgres, tlsOnly, type Postgres } from './support/stack'
import { LIFTED_LIMITS, startChildProxy } from './support/child-proxy'
import { sessionsByWorker } from './support/by-worker'
import { eventually } from './support/helpers'

// The proxy's own link to Postgres over TLS (sslmode require / verify-full), where SCRAM binds to
// the channel (SCRAM-SHA-256-PLUS). The roles here may log in only over TLS (hostssl).
let certs: TestCerts
let pg18: Postgres
before(async () => {
  certs = await generateCerts()
  pg18 = await startPostgres(tlsOnly(18, certs.server))
})
after(async () => {
  await pg18?.stop()
  await certs?.cleanup()
})

/** pg's SCRAM module, shared with the in-process proxy: records which mechanism each session chose. */
const sasl = createRequire(import.meta.url)('pg/lib/crypto/sasl.js')
const mechanisms: string[] = []
const startSession = sasl.startSession
sasl.startSession = (...args: unknown[]) => {
  const session = startSession(...args)
  mechanisms.push(session.mechanism)
  return session
}

async function query(options: Partial<ProxyOptions>, upstream = `127.0.0.1:${pg18.port}`) {
  const proxy = createProxy({ upstream, ...options })
  const { port } = await proxy.listen(0, '127.0.0.1')
  const client = new Client({
    host: '127.0.0.1', port: Number(upstream.split(':')[1]), user: 'scram_user', password: PASSWORD, database: 'postgres',
    webSocketConstructor: WebSocket as any, wsProxy: () => `ws://127.0.0.1:${port}/v2`,
  })
  try {
    await client.connect()
    const { rows } = await client.query('SELECT ssl, version FROM pg_stat_ssl WHERE pid = pg_backend_pid()')
    return rows[0]
  } finally {
    await client.end().catch(() => {})
    await proxy.close()
  }
}

test('verify-full: the proxy speaks TLS to Postgres and SCRAM binds to the channel (SCRAM-SHA-256-PLUS)', async () => {
  mechanisms.length = 0
  assert.deepEqual(await query({ upstreamTls: { mode: 'verify-full', ca: certs.ca.cert } }), { ssl: true, version: 'TLSv1.3' })
  assert.deepEqual(mechanisms, ['SCRAM-SHA-256-PLUS'])
})

test('require: TLS without verifying the certificate', async () => {
  assert.deepEqual(await query({ upstreamTls: { mode: 'require' } }), { ssl: true, version: 'TLSv1.3' })
})

test('verify-full against an unknown CA fails with a clear error', async () => {
  await assert.rejects(query({ upstreamTls: { mode: 'verify-full', ca: certs.otherCa.cert } }), (err: any) => {
    assert.equal(err.code, '08P01')
    assert.match(err.message, /^TLS to Postgres at 127\.0\.0\.1:\d+ failed: .*(certificate|issuer)/i)
    return true
  })
})

test('a Postgres without TLS is refused clearly when the proxy requires it', async () => {
  const plain = testPostgres()
  await assert.rejects(query({ upstreamTls: { mode: 'require' } }, `${plain.host}:${plain.port}`), /does not accept TLS \(upstream sslmode=require\)/)
})

test('--workers 2 over TLS to Postgres: a backend cannot move between workers; the one with a backend to spare closes it, and the one whose sessions wait logs one in, in its place', async () => {
  const p = await startChildProxy(`127.0.0.1:${pg18.port}`, {
    built: true,
    env: { EDGEPG_WORKERS: '2' },
    flags: ['--upstream-sslmode', 'require', '--pool-mode', 'transaction', '--pool-size', '2', '--pool-timeout', '4000', ...LIFTED_LIMITS],
  })
  const app = `edgepg-tls-moves-${process.pid}`
  const admin = pg18.admin()
  await admin.connect()
  const backends = async () => (await admin.query('SELECT array_agg(pid ORDER BY pid) AS pids FROM pg_stat_activity WHERE application_name = $1', [app])).rows[0].pids ?? []
  const connect = async () => {
    const c = new Client({
      host: '127.0.0.1', port: pg18.port, user: 'scram_user', password: PASSWORD, database: 'postgres', application_name: app,
      webSocketConstructor: WebSocket as any, wsProxy: () => `ws://127.0.0.1:${p.port}/v2`,
    })
    c.on('error', () => {})
    await c.connect()
    return c
  }
  const ranOn = async (c: Client) => (await c.query('SELECT pid, ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()')).rows[0] as { pid: number; ssl: boolean }
  let all: Client[] = []
  try {
    // (Sessions on both workers, each of whose logins leaves a backend there; two on one of them.)
    const by = await sessionsByWorker(connect, (by) => by.every((w) => w.length >= 1) && by.some((w) => w.length >= 2))
    all = by.flat()
    await ranOn(all[0])
    await eventually(async () => (await backends()).length === 2, "the key's backend on each worker").catch(async (err) => {
      throw new Error(`${err.message}; at Postgres: ${JSON.stringify(await backends())}, sessions by worker: ${by.map((w) => w.length)}`)
    })
    const logged: number[] = await backends()
    const [a, b] = by[by[0].length >= 2 ? 0 : 1]
    await a.query('BEGIN')
    const onA = await ranOn(a)
    const onB = await ranOn(b)
    assert.ok(onB.ssl && !logged.includes(onB.pid), `b ran on a backend logged in for it, over TLS: ${JSON.stringify(onB)}`)
    const other = logged.find((pid) => pid !== onA.pid)
    await eventually(async () => !(await backends()).includes(other), "the other worker's backend closed: its place went with the ask")
    assert.deepEqual(await backends(), [onA.pid, onB.pid].sort((x, y) => x - y))
    await a.query('COMMIT')
  } finally {
    await Promise.all(all.map((c) => c.end().catch(() => {})))
    await admin.end()
    await p.stop()
  }
})

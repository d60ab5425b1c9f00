import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { createRequire } from 'node:module'
import { WebSocket } from 'ws'
import { createProxy, type ProxyOptions } from '../proxy/index'
import { Client } from '../src/index'
import { generateCerts, type TestCerts } from './support/certs'
import { PASSWORD, startPostgres, testPostgres, tlsOnly, type Postgres } from './support/stack'

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

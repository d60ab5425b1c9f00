/**
 * Cloudflare Workers with the Pool at module scope, for real: the BUILT bundle in workerd
 * (miniflare), with and without nodejs_compat. Workers let a connection serve only the request that
 * opened it, so a Pool's idle connections from an earlier request must be replaced before anything
 * is sent on them (no hang, no error, no extra round trip) and closed (the proxy frees their
 * backends); a Client kept across requests fails at once, saying what to do.
 */
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { readdirSync } from 'node:fs'
import { fileURLToPath } from 'node:url'
import { Miniflare } from 'miniflare'
import { startProxy, testPostgres, eventually, within } from './support/helpers'
import { startDelayRelay } from './support/delay-relay'
import { PASSWORD } from './support/stack'

const root = fileURLToPath(new URL('..', import.meta.url))
const APP = `edgepg-module-scope-${process.pid}`

let proxy: Awaited<ReturnType<typeof startProxy>>
before(async () => (proxy = await startProxy()))
after(() => proxy?.close())

function worker(proxyPort: number, nodejsCompat: boolean, entry = 'test/workers/module-scope.mjs') {
  const { host, port, database } = testPostgres()
  const chunks = readdirSync(`${root}dist/chunks`).filter((f) => f.endsWith('.mjs'))
  return new Miniflare({
    modulesRoot: root,
    modules: [
      { type: 'ESModule', path: `${root}${entry}` },
      { type: 'ESModule', path: `${root}dist/index.mjs` },
      ...chunks.map((f) => ({ type: 'ESModule' as const, path: `${root}dist/chunks/${f}` })),
    ],
    compatibilityDate: '2026-04-01',
    compatibilityFlags: nodejsCompat ? ['nodejs_compat'] : [],
    bindings: { PROXY_PORT: String(proxyPort), DATABASE_URL: `postgres://scram_user:${encodeURIComponent(PASSWORD)}@${host}:${port}/${database}`, APP },
  })
}

async function call(mf: Miniflare, mode: string, n: number) {
  const res = await within(15_000, `${mode} request n=${n}`, mf.dispatchFetch(`http://worker.test/?mode=${mode}&n=${n}`))
  const text = await res.text()
  try {
    return { status: res.status, body: JSON.parse(text) }
  } catch {
    return { status: res.status, body: { error: text } }
  }
}

for (const nodejsCompat of [false, true]) {
  test(`module-scope Pool and httpSql serve every request in workerd ${nodejsCompat ? 'with' : 'without'} nodejs_compat, one after another and at once`, async () => {
    const mf = worker(proxy.port, nodejsCompat)
    try {
      await within(30_000, 'miniflare ready', mf.ready)
      for (let i = 0; i < 4; i++) {
        for (const mode of ['pool', 'tx', 'http']) {
          const { status, body } = await call(mf, mode, 10 * i)
          assert.equal(status, 200, `${mode} request ${i}: ${JSON.stringify(body)}`)
          assert.equal(body.rows[0].n, 10 * i)
          if (mode === 'pool') {
            assert.equal(body.rows[1].n, 10 * i + 1)
            assert.equal(body.max, 5, "the Pool's default fits Workers' six connections per request")
          }
        }
        // Connections an earlier request left idle are closed, so the proxy does not keep piling them up.
        await eventually(() => proxy.sessionCount <= 2, `request ${i}: at most the last request's two connections open (${proxy.sessionCount})`)
      }
      // Concurrent requests on the one module-scope Pool, more connections at once than its max.
      for (let round = 0; round < 3; round++) {
        const many = await Promise.all(Array.from({ length: 8 }, (_, i) => call(mf, i % 2 ? 'pool' : 'tx', 100 + i)))
        for (const { status, body } of many) assert.equal(status, 200, JSON.stringify(body))
      }
    } finally {
      await mf.dispose()
    }
    await eventually(() => proxy.sessionCount === 0, 'every session closed once the Worker is gone')
  })
}

test('a Client kept across requests fails at once, saying to create it per request or use a Pool', async () => {
  const mf = worker(proxy.port, false)
  try {
    await within(30_000, 'miniflare ready', mf.ready)
    const first = await call(mf, 'client', 1)
    assert.equal(first.status, 200, JSON.stringify(first.body))
    for (let i = 2; i < 4; i++) {
      const later = await call(mf, 'client', i)
      assert.equal(later.status, 500)
      assert.match(later.body.error, /earlier request.*in the request handler.*Pool/s)
    }
  } finally {
    await mf.dispose()
  }
})

test('behind a 200 ms RTT: a module-scope Pool pays what a new connection does (upgrade with the login + query), no more', async () => {
  const relay = await startDelayRelay({ host: '127.0.0.1', port: proxy.port }, 100)
  const mf = worker(relay.port, false)
  try {
    await within(30_000, 'miniflare ready', mf.ready)
    const timed = async (mode: string, n: number) => {
      const start = performance.now()
      const { status, body } = await call(mf, mode, n)
      assert.equal(status, 200, JSON.stringify(body))
      return (performance.now() - start) / relay.rttMs
    }
    await timed('pool', 1) // warms the proxy's backends
    // Two queries at once: two connections, each the upgrade carrying the login, then its query.
    const replaced = await timed('pool', 2) // the connections request 1 left idle are replaced
    assert.ok(replaced >= 2 && replaced < 2.75, `a request after another: ${replaced.toFixed(2)} round trips (expected 2; a third would make 3)`)
  } finally {
    await mf.dispose()
    await relay.close()
  }
})
